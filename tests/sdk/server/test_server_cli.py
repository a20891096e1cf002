"""`kiln sandbox …` and `kiln keys …` against a running `kiln serve`."""

import os
import subprocess

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
