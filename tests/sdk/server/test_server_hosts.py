"""`localhost` resolves in every sandbox: Debian's minbase variant (the `base` and
`code-interpreter-v1` templates) ships no /etc/hosts, so the agent writes one at boot when the
root filesystem has none (crates/agent/src/pid1.rs), naming localhost and the sandbox's host
name. A template's own /etc/hosts is left alone."""


def test_localhost_and_the_hostname_resolve_in_a_base_sandbox(sandbox):
    r = sandbox.commands.run("getent ahostsv4 localhost")
    assert r.exit_code == 0 and "127.0.0.1" in r.stdout, r.stdout
    r = sandbox.commands.run("getent hosts localhost")
    assert "localhost" in r.stdout, r.stdout
    # glibc programs (Python's resolver here) see it too, and the sandbox's own name.
    r = sandbox.commands.run(
        "python3 -c \"import socket; print(socket.gethostbyname('localhost'),"
        " socket.gethostbyname(socket.gethostname()))\"")
    assert r.stdout.split() == ["127.0.0.1", "127.0.1.1"], r.stdout
    r = sandbox.commands.run("stat -c '%U %a' /etc/hosts")
    assert r.stdout.strip() == "root 644"


def test_a_local_server_is_reached_by_name(sandbox):
    # Python's urllib resolves through glibc (curl would not: it knows localhost itself).
    sandbox.commands.run("cd /tmp && exec python3 -m http.server 8765 --bind 127.0.0.1",
                         background=True, timeout=0)
    r = sandbox.commands.run(
        "python3 -c \"import time, urllib.request\n"
        "for _ in range(100):\n"
        "    try:\n"
        "        urllib.request.urlopen('http://localhost:8765/', timeout=5); print('up'); break\n"
        "    except OSError: time.sleep(0.2)\n\"")
    assert r.stdout.strip() == "up", r.stdout + r.stderr
