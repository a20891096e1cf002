"""UDP and ICMP leaving a gVisor sandbox are on record, through the real e2b SDK against a real
`kiln serve` (audit on, its default): datagrams to a test host answered by it, datagrams to a
denyOut address, pings to both, and a datagram to the host's own side of the slot range produce
exactly the expected `net` records — `connect` (the first packet of a let-out flow), `deny` (once
per refused flow), and when the sandbox is killed, `close` for each let-out flow with the payload
bytes and packets each way that the sandbox itself sent and received.

The test hosts live in namespace `ktflows` on 198.51.100.176/29 (host side .182, hosts .177 and
.178); the server's slots take 10.165.1.0/24. Nothing here sends traffic outside this machine.
Needs root (namespaces, nftables)."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from .conftest import kiln_bin
from .internet import net_server_in, require_root
from .testnet import NetNs

RANGE = "10.165.1.0/24"
OK_HOST, DENIED_HOST = "198.51.100.177", "198.51.100.178"

# A UDP server answering every datagram with "pong".
UDP_SERVER = textwrap.dedent("""
    import socket, sys
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((sys.argv[1], 7000))
    while True:
        _, peer = s.recvfrom(512)
        s.sendto(b"pong", peer)
""")

# Run in the sandbox as root: two datagrams to the test host (answered), three to the denied one,
# three pings (ICMP echo, identifier 0x4b1, 8 data bytes) to each, one datagram to the slot's
# gateway side of the host range (given as argv[1]). Prints the answers it got.
SANDBOX_SCRIPT = textwrap.dedent("""
    import socket, struct, sys
    ok, denied = "198.51.100.177", "198.51.100.178"
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.bind(("0.0.0.0", 40001))
    u.settimeout(3)
    got = []
    for _ in range(2):
        u.sendto(b"hello", (ok, 7000))
        got.append(u.recv(64).decode())
    for _ in range(3):
        u.sendto(b"hello", (denied, 7000))
    def echo(seq):
        m = struct.pack("!BBHHH", 8, 0, 0, 0x4b1, seq) + b"kilnping"
        s = sum(struct.unpack("!%dH" % (len(m) // 2), m))
        while s > 0xffff:
            s = (s & 0xffff) + (s >> 16)
        return m[:2] + struct.pack("!H", ~s & 0xffff) + m[4:]
    # An ICMP datagram ("ping") socket: gVisor gives no raw sockets; its port is the echo id.
    r = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP)
    r.bind(("0.0.0.0", 0x4b1))
    r.settimeout(1)
    for host in (ok, denied):
        replies = 0
        for seq in range(3):
            r.sendto(echo(seq), (host, 0))
            try:
                while True:
                    p = r.recv(256)
                    if p[0] == 0 and p[4:6] == b"\\x04\\xb1":
                        replies += 1
                        break
            except socket.timeout:
                pass
        got.append(replies)
    u.sendto(b"x", (sys.argv[1], 9))
    print(got)
""")


@pytest.fixture(scope="module")
def flows_server():
    require_root()
    hosts = NetNs("ktflows", "ktflows0", "198.51.100.182/29",
                  [f"{OK_HOST}/29", f"{DENIED_HOST}/29"], "198.51.100.182")
    try:
        hosts.up()
        hosts.spawn(sys.executable, "-c", UDP_SERVER, OK_HOST)
        # No warm pool: its booted sandboxes hold network slots (and flow logs) of their own,
        # and the last test counts the server's sockets across sandbox lives.
        with net_server_in("audit flows", RANGE, extra=["--pool-off"]) as srv:
            yield srv
    finally:
        hosts.down()


def net_records(srv, sid, n, timeout=15):
    deadline = time.time() + timeout
    while True:
        status, page, _ = srv.request("GET", f"/sandboxes/{sid}/audit?kind=net&limit=1000")
        assert status == 200, page
        recs = page["records"]
        if len(recs) >= n or time.time() > deadline:
            return [r["body"] for r in recs]
        time.sleep(0.2)


def test_udp_and_icmp_flows_are_recorded_with_rule_and_bytes(flows_server):
    from e2b import Sandbox

    srv = flows_server
    sbx = Sandbox.create(timeout=120, **srv.opts(), network={"deny_out": [DENIED_HOST]})
    sid = sbx.sandbox_id
    killed = False
    try:
        # Any address of the slot range is the host's: denied whatever the policy ("host").
        sbx.files.write("/tmp/flows.py", SANDBOX_SCRIPT)
        r = sbx.commands.run("python3 /tmp/flows.py 10.165.1.254", user="root", timeout=60)
        code, out = r.exit_code, r.stdout
        assert code == 0, out
        assert out.strip() == "['pong', 'pong', 3, 0]", out
        opened = net_records(srv, sid, 5)
        sbx.kill()
        killed = True
        recs = net_records(srv, sid, 7)
    finally:
        if not killed:
            sbx.kill()

    def flow(event, proto, dst, rule, src_port=None, icmp=False):
        b = {"event": event, "proto": proto, "name": None, "rule": rule,
             "src": "169.254.0.21" + (f":{src_port}" if src_port else ""), "dst": dst}
        if icmp:
            b.update(icmpType=8, icmpCode=0, icmpId=0x4b1)
        return b

    udp_ok = flow("connect", "udp", f"{OK_HOST}:7000", "default", 40001)
    icmp_ok = flow("connect", "icmp", OK_HOST, "default", icmp=True)
    assert opened == [
        udp_ok,
        flow("deny", "udp", f"{DENIED_HOST}:7000", f"denyOut {DENIED_HOST}", 40001),
        icmp_ok,
        flow("deny", "icmp", DENIED_HOST, f"denyOut {DENIED_HOST}", icmp=True),
        flow("deny", "udp", "10.165.1.254:9", "host", 40001),
    ], opened
    assert recs[:5] == opened
    closes = sorted(recs[5:], key=lambda b: b["proto"])
    for c in closes:
        assert c.pop("durationMs") >= 0
    assert closes == [
        {**icmp_ok, "event": "close", "bytesOut": 24, "bytesIn": 24, "packetsOut": 3, "packetsIn": 3},
        {**udp_ok, "event": "close", "bytesOut": 10, "bytesIn": 8, "packetsOut": 2, "packetsIn": 2},
    ], recs
    status, v, _ = srv.request("GET", f"/audit/verify?sandboxID={sid}")
    assert status == 200 and v["ok"], v
    # `kiln audit ID --kind net`: one line per record, ICMP with its type/code.
    env = {**os.environ, "KILN_URL": srv.url, "KILN_API_KEY": srv.api_key}
    out = subprocess.run([kiln_bin(), "audit", sid, "--kind", "net"], capture_output=True,
                         text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 7, out.stdout
    assert f"deny icmp 169.254.0.21 → {DENIED_HOST} icmp=8/0" in lines[3], lines[3]


def socket_fds(pid: int) -> int:
    d = f"/proc/{pid}/fd"
    n = 0
    for f in os.listdir(d):
        try:
            n += os.readlink(os.path.join(d, f)).startswith("socket:")
        except OSError:
            pass
    return n


def test_the_flow_log_goes_on_after_resume_and_leaves_no_socket_behind(flows_server):
    """Each sandbox's flow log (a netlink socket and a task) lives with its slot: a flow after a
    pause and resume is recorded, both flows close at the kill, and four such lives leave the
    server with no more sockets than one did."""
    from e2b import Sandbox

    srv = flows_server
    counts = []
    for i in range(4):
        sbx = Sandbox.create(timeout=120, **srv.opts())
        sid = sbx.sandbox_id
        ping = "python3 -c \"import socket,sys; u=socket.socket(2,2); u.bind(('',int(sys.argv[1]))); " \
               f"u.settimeout(3); u.sendto(b'hi',('{OK_HOST}',7000)); print(u.recv(9).decode())\" "
        r = sbx.commands.run(ping + str(41000 + i), timeout=30)
        assert r.stdout.strip() == "pong"
        assert sbx.pause() is True
        again = Sandbox.connect(sid, timeout=120, **srv.opts())
        r = again.commands.run(ping + str(42000 + i), timeout=30)
        assert r.stdout.strip() == "pong"
        again.kill()
        recs = net_records(srv, sid, 4)
        assert [(b["event"], b["src"]) for b in recs[:2]] == [
            ("connect", f"169.254.0.21:{41000 + i}"), ("connect", f"169.254.0.21:{42000 + i}")], recs
        closes = sorted((b["event"], b["src"], b["bytesOut"], b["bytesIn"]) for b in recs[2:])
        assert closes == [("close", f"169.254.0.21:{p}", 2, 4) for p in (41000 + i, 42000 + i)], recs
        time.sleep(0.5)
        counts.append(socket_fds(srv.proc.pid))
    print("server sockets after each life:", counts)
    assert counts[-1] <= counts[0] + 1, counts
