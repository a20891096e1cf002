"""`kiln sandbox …` and `kiln keys …` against a running `kiln serve`."""

import json
import os
import re
import signal
import subprocess
import time

from framework.skip import need_tools

from .conftest import kiln_bin


def kiln(server, *args, input=None, env_extra=None):
    env = {**os.environ, "KILN_URL": server.url, "KILN_API_KEY": server.api_key, **(env_extra or {})}
    return subprocess.run([kiln_bin(), *args], capture_output=True, env=env, input=input, timeout=120)


def test_sandbox_cli_create_ls_exec_cp_kill(server, tmp_path):
    r = kiln(server, "sandbox", "create", "--timeout", "120", "-m", "cli=yes", "-e", "CLI_ENV=hello")
    assert r.returncode == 0, r.stderr
    sid = r.stdout.decode().strip()
    try:
        ls = kiln(server, "sandbox", "ls")
        assert ls.returncode == 0 and sid in ls.stdout.decode() and "cli=yes" in ls.stdout.decode()

        r = kiln(server, "sandbox", "exec", sid, "--", "echo $CLI_ENV; echo oops >&2; exit 4")
        assert r.returncode == 4
        assert r.stdout == b"hello\n"
        assert r.stderr == b"oops\n"
        r = kiln(server, "sandbox", "exec", "-u", "root", "--cwd", "/tmp", sid, "--", "id -u; pwd")
        assert r.returncode == 0 and r.stdout == b"0\n/tmp\n"

        local = tmp_path / "in.bin"
        local.write_bytes(bytes(range(256)) * 100)
        assert kiln(server, "sandbox", "cp", str(local), f"{sid}:/home/user/in.bin").returncode == 0
        out = tmp_path / "out.bin"
        assert kiln(server, "sandbox", "cp", f"{sid}:/home/user/in.bin", str(out)).returncode == 0
        assert out.read_bytes() == local.read_bytes()

        r = kiln(server, "sandbox", "kill", sid)
        assert r.returncode == 0
        r = kiln(server, "sandbox", "exec", sid, "--", "true")
        assert r.returncode == 1 and b"not found" in r.stderr
    finally:
        kiln(server, "sandbox", "kill", sid)


def test_sandbox_cli_needs_a_valid_key(server):
    r = kiln(server, "sandbox", "ls", env_extra={"KILN_API_KEY": "e2b_wrong"})
    assert r.returncode == 1 and b"401" in r.stderr


def test_keys_create_list_revoke(server):
    state = ["--state-dir", server.state_dir]
    r = kiln(server, "keys", "create", "--name", "ci-key", *state)
    assert r.returncode == 0, r.stderr
    key = r.stdout.decode().strip()
    assert key.startswith("e2b_")
    status, _, _ = server.request("GET", "/sandboxes", api_key=key)
    assert status == 200
    r = kiln(server, "keys", "list", *state)
    listing = r.stdout.decode()
    assert "ci-key" in listing and key not in listing
    key_id = next(line.split()[0] for line in listing.splitlines() if "ci-key" in line)
    assert kiln(server, "keys", "revoke", key_id, *state).returncode == 0
    status, body, _ = server.request("GET", "/sandboxes", api_key=key)
    assert status == 401 and "revoked" in body["message"]
    assert kiln(server, "keys", "revoke", key_id, *state).returncode == 1


def test_sandbox_cli_shell_is_an_interactive_pty(server):
    import pty
    import select
    import time

    r = kiln(server, "sandbox", "create", "--timeout", "120")
    assert r.returncode == 0, r.stderr
    sid = r.stdout.decode().strip()
    try:
        env = {**os.environ, "KILN_URL": server.url, "KILN_API_KEY": server.api_key}
        pid, fd = pty.fork()
        if pid == 0:
            os.execve(kiln_bin(), [kiln_bin(), "sandbox", "shell", sid], env)
        out = b""
        sent = False
        deadline = time.time() + 60
        while time.time() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(fd, 4096)
                except OSError:
                    break
                if not chunk:
                    break
                out += chunk
            if not sent and time.time() > deadline - 58:
                os.write(fd, b"tty; echo shell-$((20+22))\r")
                os.write(fd, b"exit 3\r")
                sent = True
        _, status = os.waitpid(pid, 0)
        text = out.decode(errors="replace")
        assert "shell-42" in text, text
        assert "/dev/pts/" in text, text
        assert os.WEXITSTATUS(status) == 3, text
    finally:
        kiln(server, "sandbox", "kill", sid)


def wait_until(fn, what, timeout=30, interval=0.2):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")


def create_sandbox(server, *extra):
    r = kiln(server, "sandbox", "create", "--timeout", "120", *extra)
    assert r.returncode == 0, r.stderr
    return r.stdout.decode().strip()


class Tmux:
    """A private tmux server (its own socket) whose one window runs a command."""

    def __init__(self, tmp_path, env):
        need_tools("tmux", hint="Debian package tmux")
        self.sock = str(tmp_path / "tmux.sock")
        self.env = env

    def __call__(self, *args):
        r = subprocess.run(["tmux", "-S", self.sock, "-f", "/dev/null", *args],
                           capture_output=True, text=True, env=self.env, timeout=30)
        assert r.returncode == 0, r.stderr
        return r.stdout

    def screen(self):
        return self("capture-pane", "-p", "-J", "-S", "-200", "-t", "kt")

    def kill(self):
        subprocess.run(["tmux", "-S", self.sock, "kill-server"], capture_output=True)


def shell_in_tmux(server, tmp_path, sid, tag):
    """`kiln sandbox shell` in a 100x30 tmux window, wrapped so that what happens after it
    exits (its status, the terminal's settings) lands in `<tag>.after`."""
    env = {**os.environ, "KILN_URL": server.url, "KILN_API_KEY": server.api_key}
    after = tmp_path / f"{tag}.after"
    wrapper = (f'"{kiln_bin()}" sandbox shell {sid}; echo "EXIT=$?" > {after}.tmp; '
               f"stty -a >> {after}.tmp; mv {after}.tmp {after}")
    t = Tmux(tmp_path, env)
    t("new-session", "-d", "-x", "100", "-y", "30", "-s", "kt", "sh", "-c", wrapper)
    return t, after


def cooked(stty: str) -> bool:
    words = stty.split()
    return "icanon" in words and "echo" in words and "-icanon" not in words


def test_shell_follows_window_resizes_and_restores_the_terminal(server, tmp_path):
    sid = create_sandbox(server)
    t = None
    try:
        t, after = shell_in_tmux(server, tmp_path, sid, "exit")

        def cols():
            t("send-keys", "-t", "kt", "echo cols=$(tput cols)", "Enter")
            time.sleep(0.3)
            return [int(c) for c in re.findall(r"^cols=(\d+)", t.screen(), re.M)]

        assert wait_until(lambda: 100 in cols(), "tput cols = 100", 60)
        t("resize-window", "-t", "kt", "-x", "130")
        assert wait_until(lambda: 130 in cols(), "tput cols = 130 after the resize", 30)
        t("send-keys", "-t", "kt", "exit 7", "Enter")
        wait_until(after.exists, "the shell to exit")
        text = after.read_text()
        assert text.startswith("EXIT=7\n"), text
        assert cooked(text), f"the terminal was left in raw mode:\n{text}"
    finally:
        if t:
            t.kill()
        kiln(server, "sandbox", "kill", sid)


def test_shell_restores_the_terminal_when_killed_or_when_the_sandbox_goes(server, tmp_path):
    sid = create_sandbox(server)
    t = None
    try:
        t, after = shell_in_tmux(server, tmp_path, sid, "term")
        t("send-keys", "-t", "kt", "echo ready-$((6*7))", "Enter")
        wait_until(lambda: "ready-42" in t.screen(), "the shell prompt", 60)
        sh_pid = int(t("display-message", "-p", "-t", "kt", "#{pane_pid}").strip())
        kids = open(f"/proc/{sh_pid}/task/{sh_pid}/children").read().split()
        assert len(kids) == 1, kids
        os.kill(int(kids[0]), signal.SIGTERM)
        wait_until(after.exists, "the shell to end on SIGTERM")
        text = after.read_text()
        assert text.startswith("EXIT=143\n"), text
        assert cooked(text), f"SIGTERM left the terminal in raw mode:\n{text}"
        t.kill()

        # The sandbox is killed under a running shell: kiln fails, the terminal is restored.
        t, after = shell_in_tmux(server, tmp_path, sid, "gone")
        t("send-keys", "-t", "kt", "echo ready-$((6*7))", "Enter")
        wait_until(lambda: "ready-42" in t.screen(), "the shell prompt", 60)
        assert kiln(server, "sandbox", "kill", sid).returncode == 0
        wait_until(after.exists, "the shell to end with its sandbox")
        text = after.read_text()
        assert text.startswith("EXIT=1\n"), text
        assert cooked(text), f"an error left the terminal in raw mode:\n{text}"
    finally:
        if t:
            t.kill()
        kiln(server, "sandbox", "kill", sid)


def test_json_on_lists_and_shows(server):
    sid = create_sandbox(server, "-m", "owner=json")
    try:
        r = kiln(server, "sandbox", "show", sid, "--json")
        assert r.returncode == 0, r.stderr
        v = json.loads(r.stdout)
        assert v["sandboxID"] == sid and v["state"] == "running" and v["metadata"] == {"owner": "json"}
        r = kiln(server, "sandbox", "show", sid)
        assert r.returncode == 0 and f"id          {sid}" in r.stdout.decode()
        assert sid in [s["sandboxID"] for s in json.loads(kiln(server, "sandbox", "ls", "--json").stdout)]
        r = kiln(server, "sandbox", "show", "nosuchsandbox", "--json")
        assert r.returncode == 1 and b"404" in r.stderr
    finally:
        kiln(server, "sandbox", "kill", sid)
    state = ["--state-dir", server.state_dir]
    r = kiln(server, "keys", "list", "--json", *state)
    keys = json.loads(r.stdout)
    assert keys and {"id", "name", "team", "prefix"} <= set(keys[0])
    assert server.api_key not in r.stdout.decode()
    teams = json.loads(kiln(server, "team", "list", "--json", *state).stdout)
    assert any(t["team"] == "default" and t["activeKeys"] >= 1 for t in teams), teams
    hooks = kiln(server, "webhooks", "ls", "--json")
    assert hooks.returncode == 0 and isinstance(json.loads(hooks.stdout), list), hooks.stderr


def test_sandbox_logs_and_follow(server):
    sid = create_sandbox(server)
    follower = None
    try:
        r = kiln(server, "sandbox", "logs", sid)
        assert r.returncode == 0, r.stderr
        assert "created" in r.stdout.decode(), r.stdout
        lines = kiln(server, "sandbox", "logs", sid, "--json").stdout.decode().splitlines()
        assert any(json.loads(line)["fields"].get("event") == "created" for line in lines), lines
        env = {**os.environ, "KILN_URL": server.url, "KILN_API_KEY": server.api_key}
        follower = subprocess.Popen([kiln_bin(), "sandbox", "logs", sid, "--follow"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        time.sleep(1.5)
        assert follower.poll() is None, follower.stderr.read()
        assert kiln(server, "sandbox", "kill", sid).returncode == 0
        out, err = follower.communicate(timeout=30)
        assert follower.returncode == 0, err
        text = out.decode()
        assert text.count("created") == 1 and "killed" in text, text
    finally:
        if follower and follower.poll() is None:
            follower.kill()
        kiln(server, "sandbox", "kill", sid)


def test_top_once_shows_state_cpu_and_memory(server):
    sid = create_sandbox(server)
    try:
        def sample():
            r = kiln(server, "top", "--once", "--json")
            assert r.returncode == 0, r.stderr
            rows = {row["sandboxID"]: row for row in json.loads(r.stdout)}
            row = rows.get(sid)
            return row if row and row["metrics"] else None

        row = wait_until(sample, "a metrics sample in `kiln top`", 30, 1)
        assert row["state"] == "running" and row["templateID"] == "base"
        assert row["metrics"]["memTotal"] > 0 and row["metrics"]["cpuUsedPct"] >= 0
        table = kiln(server, "top", "--once").stdout.decode()
        line = next(line for line in table.splitlines() if line.startswith(sid))
        assert "running" in line and re.search(r"\d+M/\d+M", line), table
    finally:
        kiln(server, "sandbox", "kill", sid)


def test_completions_and_man_page(server, tmp_path):
    r = kiln(server, "completions", "bash")
    assert r.returncode == 0, r.stderr
    script = tmp_path / "kiln.bash"
    script.write_bytes(r.stdout)
    # Bash completes `kiln sa<TAB>` and `kiln sandbox <TAB>` from the generated script.
    probe = (f"source {script}; COMP_WORDS=(kiln sa); COMP_CWORD=1; _kiln kiln sa kiln; "
             f"echo \"${{COMPREPLY[*]}}\"; COMP_WORDS=(kiln sandbox ''); COMP_CWORD=2; "
             f"_kiln kiln '' sandbox; echo \"${{COMPREPLY[*]}}\"")
    out = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, timeout=30)
    first, second = out.stdout.splitlines()[:2]
    assert first.split() == ["sandbox"], out
    assert {"create", "exec", "shell", "logs", "show"} <= set(second.split()), out
    for shell in ("zsh", "fish"):
        r = kiln(server, "completions", shell)
        assert r.returncode == 0 and b"sandbox" in r.stdout
    r = kiln(server, "man")
    assert r.returncode == 0 and b".TH kiln 1" in r.stdout and b"completions" in r.stdout
    r = kiln(server, "man", "--dir", str(tmp_path / "man"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "man" / "kiln-sandbox-logs.1").read_bytes().count(b"follow") >= 1


def test_top_refreshes_live_and_quits_on_ctrl_c(server, tmp_path):
    env = {**os.environ, "KILN_URL": server.url, "KILN_API_KEY": server.api_key}
    after = tmp_path / "top.after"
    t = Tmux(tmp_path, env)
    try:
        t("new-session", "-d", "-x", "140", "-y", "30", "-s", "kt", "sh", "-c",
          # The trap keeps sh (which gets the Ctrl-C too) alive to record kiln's status.
          f'trap true INT; "{kiln_bin()}" top --interval 0.3; echo "EXIT=$?" > {after}; sleep 60')
        wait_until(lambda: "STATE" in t.screen(), "the table header")

        def alternate():
            return t("display-message", "-p", "-t", "kt", "#{alternate_on}").strip()

        assert alternate() == "1"
        sid = create_sandbox(server)
        try:
            wait_until(lambda: sid in t.screen(), "the new sandbox in the live table")
        finally:
            kiln(server, "sandbox", "kill", sid)
        wait_until(lambda: sid not in t.screen(), "the killed sandbox to leave the table")
        t("send-keys", "-t", "kt", "C-c")
        wait_until(after.exists, "kiln top to quit on Ctrl-C")
        assert after.read_text() == "EXIT=0\n"
        assert alternate() == "0", "kiln top left the terminal on its alternate screen"
    finally:
        t.kill()
