import os
import time

import pytest

from e2b import CommandExitException
from e2b.exceptions import AuthenticationException, SandboxException
from framework.skip import need_root


def test_stdout_stderr_exit_code(sbx):
    r = sbx.commands.run("echo out; echo err >&2")
    assert r.stdout == "out\n"
    assert r.stderr == "err\n"
    assert r.exit_code == 0
    with pytest.raises(CommandExitException) as ei:
        sbx.commands.run("echo before; exit 7")
    assert ei.value.exit_code == 7
    assert ei.value.stdout == "before\n"


def test_login_shell_env_and_cwd(sbx, agent):
    r = sbx.commands.run('echo "$GREETING-$0"; pwd', envs={"GREETING": "hello"}, cwd=agent.workdir)
    lines = r.stdout.splitlines()
    assert lines[0] == "hello-/bin/bash"
    assert lines[1] == agent.workdir


def test_init_env_vars_and_default_workdir(sbx, agent):
    agent.init(envVars={"KILN_X": "42"}, defaultWorkdir=agent.workdir)
    r = sbx.commands.run("echo $KILN_X; pwd")
    assert r.stdout.split() == ["42", agent.workdir]
    status, body = agent.http("GET", "/envs")
    assert status == 200 and b"KILN_X" in body


def test_user_selection(sbx):
    need_root("switching users")
    assert sbx.commands.run("id -un", user="root").stdout == "root\n"
    r = sbx.commands.run("id -un; echo $HOME; id -u", user="nobody")
    name, home, uid = r.stdout.split()
    assert name == "nobody" and uid != "0"
    with pytest.raises(AuthenticationException):
        sbx.commands.run("true", user="kiln-no-such-user")


def test_background_list_kill(sbx):
    h = sbx.commands.run("sleep 60", background=True)
    pids = [p.pid for p in sbx.commands.list()]
    assert h.pid in pids
    assert sbx.commands.kill(h.pid) is True
    with pytest.raises(CommandExitException) as ei:
        h.wait()
    assert ei.value.exit_code == -1
    assert "killed" in (ei.value.error or "") or ei.value.exit_code == -1
    # unknown pid
    assert sbx.commands.kill(999999) is False


def test_stdin_send_and_close(sbx):
    h = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.send_stdin(h.pid, "line one\n")
    h.send_stdin("line two\n")
    h.close_stdin()
    r = h.wait()
    assert r.stdout == "line one\nline two\n"


def test_stream_input(sbx):
    h = sbx.commands.run("wc -c", background=True, stdin=True)
    sbx.commands.stream_input(h.pid, [b"abc", "def", b"\n"])
    sbx.commands.close_stdin(h.pid)
    assert h.wait().stdout.strip() == "7"


def test_reconnect_after_disconnect(sbx):
    h = sbx.commands.run("for i in $(seq 1 30); do echo n$i; sleep 0.1; done", background=True)
    pid = h.pid
    h.disconnect()
    time.sleep(0.3)
    h2 = sbx.commands.connect(pid)
    r = h2.wait()
    assert r.exit_code == 0
    assert "n30" in r.stdout


def test_output_callbacks_and_large_output(sbx):
    seen = []
    r = sbx.commands.run("head -c 3000000 /dev/zero | tr '\\0' 'a'; echo", on_stdout=seen.append)
    assert len(r.stdout) == 3000001
    assert sum(len(s) for s in seen) == 3000001


def test_unobserved_output_does_not_block(sbx):
    # 20 MB of output nobody reads must not stall the process.
    h = sbx.commands.run("head -c 20000000 /dev/zero; echo done; sleep 0.1", background=True)
    pid = h.pid
    h.disconnect()
    deadline = time.time() + 20
    while time.time() < deadline and pid in [p.pid for p in sbx.commands.list()]:
        time.sleep(0.1)
    assert pid not in [p.pid for p in sbx.commands.list()], "process blocked on unread output"


def test_connect_unknown_pid(sbx):
    with pytest.raises(SandboxException):
        sbx.commands.connect(999999)


def test_default_user_from_init(sbx, agent):
    need_root("switching users")
    agent.init(defaultUser="nobody")
    assert sbx.commands.run("id -un").stdout == "nobody\n"
    # an explicit user still wins
    assert sbx.commands.run("id -un", user="root").stdout == "root\n"
    # directories created for a user belong to that user
    d = os.path.join(agent.workdir, "pub")
    os.makedirs(d)
    os.chmod(d, 0o777)
    sbx.files.make_dir(os.path.join(d, "x/y"))
    import pwd

    assert os.stat(os.path.join(d, "x")).st_uid == pwd.getpwnam("nobody").pw_uid
    assert os.stat(os.path.join(d, "x/y")).st_uid == pwd.getpwnam("nobody").pw_uid
