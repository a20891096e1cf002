"""Login shells that start nothing (docs/speed.md): the SDK runs every command as
`/bin/bash -l -c CMD`; the template's login scripts reach the same environment without a
subprocess, while PTY shells keep their colours and prompt. Execs are counted from the
sandbox's syscall audit records (gVisor's runtime monitoring sees every execve)."""

import time

from e2b import CommandExitException, PtySize, Sandbox

from .test_server_audit_syscalls import FLAG, syscalls

USER_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/local/games:/usr/games"
ROOT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def execs(server, sbx_id):
    return [r["body"]["argv"] for r in syscalls(server, sbx_id) if r["body"]["call"] == "execve"]


def test_login_shells_reach_the_environment_and_exec_nothing(server):
    sbx = Sandbox.create(timeout=120, metadata=FLAG, envs={"SBX_ENV": "kept"}, **server.opts())
    try:
        show = "echo $PATH; umask; echo $LANG; echo $HOME; echo $SBX_ENV; id -un"
        assert sbx.commands.run(show).stdout.split("\n")[:6] == [
            USER_PATH, "0022", "C.UTF-8", "/home/user", "kept", "user"]
        assert sbx.commands.run(show, user="root").stdout.split("\n")[:6] == [
            ROOT_PATH, "0022", "C.UTF-8", "/root", "kept", "root"]
        # A marker exec shows when the records of what ran before it are in.
        sbx.commands.run("/bin/true marker")
        deadline = time.time() + 10
        while ["/bin/true", "marker"] not in execs(server, sbx.sandbox_id) and time.time() < deadline:
            time.sleep(0.1)
        before = len(execs(server, sbx.sandbox_id))
        for user in ("user", "root"):
            assert sbx.commands.run("true", user=user).exit_code == 0
        sbx.commands.run("/bin/true marker2")
        deadline = time.time() + 10
        while ["/bin/true", "marker2"] not in execs(server, sbx.sandbox_id) and time.time() < deadline:
            time.sleep(0.1)
        got = execs(server, sbx.sandbox_id)[before:]
    finally:
        sbx.kill()
    # Three login shells (the last one execs /bin/true itself) and nothing else: no `id -u`
    # from /etc/profile, no `mesg` from root's ~/.profile.
    assert got == [["/bin/bash", "-l", "-c", "true"], ["/bin/bash", "-l", "-c", "true"],
                   ["/bin/bash", "-l", "-c", "/bin/true marker2"], ["/bin/true", "marker2"]], got


def test_a_pty_shell_keeps_its_colours_and_prompt(sandbox):
    out = []
    term = sandbox.pty.create(PtySize(rows=24, cols=80), envs={"TERM": "xterm-256color"})
    try:
        sandbox.pty.send_stdin(term.pid, b"alias ls; echo \"ps1=[$PS1]\"\n")
        sandbox.pty.send_stdin(term.pid, b"exit\n")
        term.wait(on_pty=lambda data: out.append(data))
    except CommandExitException:
        pass
    text = b"".join(out).decode(errors="replace")
    assert "ls --color=auto" in text, text
    assert "ps1=[" in text and "\\u@\\h" in text, text
