"""Sandbox networking through the real e2b SDK against a real `kiln serve` (networking is on by
default; `--network off` turns it off):
egress to a small test "internet" (namespace `ktsdk`, 198.51.100.0/24, with its own DNS server),
E2B's policy (allow_internet_access, allow_out/deny_out, update_network), the always-denied
ranges, and ingress to any port of a sandbox through kiln's proxy.

Nothing here sends traffic outside this machine: the test hosts live in a network namespace.
Needs root (namespaces, nftables)."""

import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.error
import urllib.request

import pytest
from e2b import Sandbox

from .conftest import KilnServer, cleanup_state
from .internet import (HOST_SIDE, fetch, internet, namespaces_of, remove_slots_in_range, run,  # noqa: F401
                       net_server_in, slot_prefixes_in, start_net_server, wait_http)
from .testnet import sh

RANGE = "10.135.0.0/24"


@pytest.fixture(scope="module")
def net_server(internet):
    with net_server_in("network", RANGE) as srv:
        yield srv

def slot_tables(srv) -> dict:
    """The `kiln` nftables table of each network slot of `srv`, by namespace."""
    from .conftest import net_prefix
    out = {}
    for ns in namespaces_of(net_prefix(srv.state_dir)):
        r = subprocess.run(["ip", "netns", "exec", ns, "nft", "list", "table", "ip", "kiln"],
                           capture_output=True, text=True)
        if r.returncode == 0:
            out[ns] = r.stdout
    return out


def create(srv, **kw):
    return Sandbox.create(timeout=120, **srv.opts(), **kw)


def test_default_create_reaches_a_test_host_by_ip_and_name(net_server):
    sbx = create(net_server)
    try:
        assert fetch(sbx, "http://198.51.100.10/") == "ten"
        code, out = run(sbx, "getent hosts host-b.test")
        assert code == 0 and out.split()[0] == "198.51.100.11", out
        assert fetch(sbx, "http://host-a.test/") == "ten"
        info = sbx.get_info()
        assert info.allow_internet_access is True
    finally:
        sbx.kill()


def test_internet_off_reaches_nothing(net_server):
    sbx = create(net_server, allow_internet_access=False)
    try:
        assert fetch(sbx, "http://198.51.100.10/") is None
        assert sbx.get_info().allow_internet_access is False
    finally:
        sbx.kill()


def test_allow_and_deny_by_cidr_and_update_while_running(net_server):
    sbx = create(net_server, network={"deny_out": ["198.51.100.11/32"]})
    try:
        assert fetch(sbx, "http://198.51.100.10/") == "ten"
        assert fetch(sbx, "http://198.51.100.11/") is None
        assert sbx.get_info().network["deny_out"] == ["198.51.100.11"]
        # Deny everything but one host: allow beats deny.
        sbx.update_network({"deny_out": ["0.0.0.0/0"], "allow_out": ["198.51.100.11"]})
        assert fetch(sbx, "http://198.51.100.11/") == "eleven"
        assert fetch(sbx, "http://198.51.100.10/") is None
        # Omitted fields are cleared.
        sbx.update_network({})
        assert fetch(sbx, "http://198.51.100.10/") == "ten"
        assert fetch(sbx, "http://198.51.100.11/") == "eleven"
    finally:
        sbx.kill()


def test_host_and_other_sandboxes_stay_unreachable_even_when_all_is_allowed(net_server):
    other = create(net_server)
    sbx = create(net_server, network={"allow_out": ["0.0.0.0/0"]})
    host_listener = subprocess.Popen(
        [sys.executable, "-m", "http.server", "--bind", HOST_SIDE, "18080"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        other.commands.run("cd /tmp && python3 -m http.server 8000", background=True)
        wait_http(f"http://{HOST_SIDE}:18080/")
        assert fetch(sbx, "http://198.51.100.10/") == "ten"
        # The host's own address (a server is listening there), kiln's API port on it,
        # loopback, and every slot address of the range (the other sandbox): all on this
        # machine, so a broken refusal is seen without traffic leaving it.
        port = net_server.url.rsplit(":", 1)[1]
        for url in [f"http://{HOST_SIDE}:18080/", f"http://{HOST_SIDE}:{port}/health",
                    "http://127.0.0.53:53/"]:
            assert fetch(sbx, url) is None, url
        # Link-local (cloud metadata) is checked in the rules the slots run, never by a
        # request to it: every slot's table denies it before the sandbox's own policy.
        tables = slot_tables(net_server)
        assert tables, "no slot has a kiln table"
        for ns, text in tables.items():
            assert "169.254.0.0/16" in text, (ns, text)
            egress = text[text.index("chain egress"):]
            assert egress.index("@always_deny") < egress.rindex("goto user_policy"), (ns, egress)
        code, out = run(sbx, "for i in 1 3 5 7 9 11; do curl -s -m 1 http://10.135.0.$i:8000/ && echo reached; done; true",
                        timeout=60)
        assert "reached" not in out, out
    finally:
        host_listener.kill()
        host_listener.wait()
        sbx.kill()
        other.kill()


def proxied(srv, sandbox_id: str, port: int, host_form: bool = False, extra=None):
    headers = ({"Host": f"{port}-{sandbox_id}.localhost"} if host_form
               else {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": str(port)})
    headers.update(extra or {})
    req = urllib.request.Request(srv.url + "/", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


# An HTTP/2-only server (as a gRPC server is), by hand: it refuses anything that does not open
# with HTTP/2's preface, and answers every request with a gRPC-style reply (headers, one
# length-prefixed message, trailers with grpc-status).
H2_ONLY_SERVER = r"""
import socket, struct
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
def frame(t, f, sid, payload=b""):
    return struct.pack(">I", len(payload))[1:] + bytes([t, f]) + struct.pack(">I", sid) + payload
def exact(c, n):
    b = b""
    while len(b) < n:
        d = c.recv(n - len(b))
        if not d:
            raise EOFError
        b += d
    return b
def literal(name, value):
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 7000))
s.listen()
while True:
    c, _ = s.accept()
    try:
        if exact(c, 24) != PREFACE:
            continue
        c.sendall(frame(4, 0, 0))
        while True:
            h = exact(c, 9)
            n, t, f = int.from_bytes(h[:3], "big"), h[3], h[4]
            sid = int.from_bytes(h[5:9], "big") & 0x7FFFFFFF
            exact(c, n)
            if t == 4 and not f & 1:
                c.sendall(frame(4, 1, 0))
            if t in (0, 1) and f & 1 and sid:
                c.sendall(frame(1, 4, sid, b"\x88" + literal(b"content-type", b"application/grpc")))
                c.sendall(frame(0, 0, sid, b"\x00\x00\x00\x00\x05h2-ok"))
                c.sendall(frame(1, 5, sid, literal(b"grpc-status", b"0")))
    except EOFError:
        pass
    finally:
        c.close()
"""


def test_grpc_reaches_an_http2_only_server_in_the_sandbox(net_server):
    """A gRPC call (HTTP/2 with content-type application/grpc) goes to the sandbox over HTTP/2
    (h2c), trailers included; the same server refuses the HTTP/1.1 other requests use."""
    import subprocess
    sbx = create(net_server)
    try:
        sbx.files.write("/tmp/h2only.py", H2_ONLY_SERVER)
        sbx.commands.run("python3 /tmp/h2only.py", background=True)
        cmd = ["curl", "-sS", "--http2-prior-knowledge", "-D", "-", "-o", "/tmp/kiln-grpc-body",
               "-H", f"E2b-Sandbox-Id: {sbx.sandbox_id}", "-H", "E2b-Sandbox-Port: 7000",
               "-H", "content-type: application/grpc", "-H", "te: trailers",
               "--data-binary", "ping", net_server.url + "/kiln.Test/Call"]
        deadline = time.time() + 30
        while True:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
            if out.stdout.startswith("HTTP/2 200") or time.time() > deadline:
                break
            time.sleep(0.3)
        assert out.stdout.startswith("HTTP/2 200"), (out.stdout, out.stderr)
        assert "grpc-status: 0" in out.stdout, out.stdout  # the trailer came through
        with open("/tmp/kiln-grpc-body", "rb") as f:
            assert f.read() == b"\x00\x00\x00\x00\x05h2-ok"
        # Not gRPC: HTTP/1.1 to the sandbox, which this server refuses: a 502, not a hang.
        status, body = proxied(net_server, sbx.sandbox_id, 7000)
        assert status == 502 and "7000" in body, body
    finally:
        sbx.kill()


def test_a_server_in_the_sandbox_is_reachable_on_any_port(net_server):
    sbx = create(net_server)
    try:
        sbx.files.write("/tmp/www/index.html", "served from inside")
        sbx.commands.run("cd /tmp/www && python3 -m http.server 8000", background=True)
        deadline = time.time() + 30
        status, body = proxied(net_server, sbx.sandbox_id, 8000)
        while status != 200 and time.time() < deadline:
            time.sleep(0.3)
            status, body = proxied(net_server, sbx.sandbox_id, 8000)
        assert (status, body) == (200, "served from inside")
        assert proxied(net_server, sbx.sandbox_id, 8000, host_form=True) == (200, "served from inside")
        # A large body through the proxy.
        sbx.commands.run("head -c 5000000 /dev/zero | tr '\\0' x > /tmp/www/big.txt")
        req = urllib.request.Request(net_server.url + "/big.txt",
                                     headers={"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8000"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.read() == b"x" * 5_000_000
        # Nothing listens on 8001: a clear 502 naming the port, not a hang.
        status, body = proxied(net_server, sbx.sandbox_id, 8001)
        assert status == 502 and "8001" in body, body
    finally:
        sbx.kill()


def test_allow_and_deny_by_domain_over_http_and_https(net_server):
    # Only host-a.test and *.site.test; alias-a.test is the same address under another name.
    sbx = create(net_server, network={"allow_out": ["host-a.test", "*.site.test"],
                                      "deny_out": ["0.0.0.0/0"]})
    try:
        assert fetch(sbx, "http://host-a.test/") == "ten"
        assert fetch(sbx, "http://www.site.test/") == "ten"
        assert fetch(sbx, "http://alias-a.test/") is None
        assert fetch(sbx, "http://198.51.100.10/") is None
        assert fetch(sbx, "-k https://host-a.test/") == "tls:host-a.test"
        assert fetch(sbx, "-k https://www.site.test/") == "tls:www.site.test"
        assert fetch(sbx, "-k https://alias-a.test/") is None
        # A deny by name, internet otherwise on; updates reach the name rules too.
        sbx.update_network({"deny_out": ["alias-a.test"]})
        assert fetch(sbx, "-k https://alias-a.test/") is None
        assert fetch(sbx, "-k https://host-a.test/") == "tls:host-a.test"
        assert fetch(sbx, "http://198.51.100.11/") == "eleven"
        sbx.update_network({})
        assert fetch(sbx, "-k https://alias-a.test/") == "tls:alias-a.test"
    finally:
        sbx.kill()


# A WebSocket echo server (stdlib only) for inside a sandbox.
WS_ECHO = textwrap.dedent("""
    import base64, hashlib, socket, threading
    def recv_exact(c, n):
        b = b""
        while len(b) < n:
            chunk = c.recv(n - len(b))
            if not chunk:
                raise EOFError
            b += chunk
        return b
    def handle(c):
        data = b""
        while b"\\r\\n\\r\\n" not in data:
            data += c.recv(4096)
        key = [l.split(b":", 1)[1].strip() for l in data.split(b"\\r\\n")
               if l.lower().startswith(b"sec-websocket-key")][0]
        accept = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
        c.sendall(b"HTTP/1.1 101 Switching Protocols\\r\\nUpgrade: websocket\\r\\n"
                  b"Connection: Upgrade\\r\\nSec-WebSocket-Accept: " + accept + b"\\r\\n\\r\\n")
        try:
            while True:
                head = recv_exact(c, 2)
                n = head[1] & 127
                mask = recv_exact(c, 4)
                text = bytes(b ^ mask[i % 4] for i, b in enumerate(recv_exact(c, n)))
                out = b"echo:" + text
                c.sendall(bytes([0x81, len(out)]) + out)
        except EOFError:
            pass
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", 8765))
    s.listen()
    while True:
        conn, _ = s.accept()
        threading.Thread(target=handle, args=(conn,), daemon=True).start()
""")


def test_websocket_to_a_sandbox_port_through_the_proxy(net_server):
    import socket as pysocket

    sbx = create(net_server)
    try:
        sbx.files.write("/tmp/ws_echo.py", WS_ECHO)
        sbx.commands.run("python3 /tmp/ws_echo.py", background=True)
        host, port = net_server.url.removeprefix("http://").split(":")
        deadline = time.time() + 30
        while True:
            c = pysocket.create_connection((host, int(port)), timeout=10)
            c.sendall((f"GET /ws HTTP/1.1\r\nHost: 8765-{sbx.sandbox_id}.localhost\r\n"
                       "Upgrade: websocket\r\nConnection: Upgrade\r\n"
                       "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
                       ).encode())
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = c.recv(4096)
                if not chunk:
                    break
                head += chunk
            if head.startswith(b"HTTP/1.1 101"):
                break
            c.close()
            assert time.time() < deadline, head
            time.sleep(0.3)
        assert b"s3pPLMBiTxaQ9kYGzzhZRbK+xOo=" in head, head
        # A long-lived stream: messages a while apart on the same upgraded connection.
        for i in range(3):
            msg = f"hi{i}".encode()
            mask = b"\x01\x02\x03\x04"
            c.sendall(bytes([0x81, 0x80 | len(msg)]) + mask +
                      bytes(b ^ mask[j % 4] for j, b in enumerate(msg)))
            frame = c.recv(64)
            assert frame[2:] == b"echo:" + msg, frame
            time.sleep(1)
        c.close()
    finally:
        sbx.kill()


def test_private_ports_need_the_traffic_access_token(net_server):
    sbx = create(net_server, network={"allow_public_traffic": False})
    try:
        token = sbx.traffic_access_token
        assert token and len(token) >= 16
        assert sbx.get_info().network["allow_public_traffic"] is False
        sbx.files.write("/tmp/www/index.html", "private")
        sbx.commands.run("cd /tmp/www && python3 -m http.server 8000", background=True)
        good = {"e2b-traffic-access-token": token}
        deadline = time.time() + 30
        while proxied(net_server, sbx.sandbox_id, 8000, extra=good)[0] != 200:
            assert time.time() < deadline
            time.sleep(0.3)
        assert proxied(net_server, sbx.sandbox_id, 8000, extra=good) == (200, "private")
        status, body = proxied(net_server, sbx.sandbox_id, 8000)
        assert status == 403 and "traffic access token" in body, body
        status, _ = proxied(net_server, sbx.sandbox_id, 8000, extra={"e2b-traffic-access-token": "x" * 32})
        assert status == 403
        # The agent keeps working through the SDK (its own token, not the traffic token).
        assert sbx.commands.run("echo ok").stdout.strip() == "ok"
    finally:
        sbx.kill()


HOST_ECHO = textwrap.dedent("""
    import http.server
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = self.headers.get("Host", "").encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
    http.server.HTTPServer(("0.0.0.0", 8001), H).serve_forever()
""")


def test_mask_request_host_rewrites_the_host_header(net_server):
    sbx = create(net_server, network={"mask_request_host": "app.internal:${PORT}"})
    try:
        sbx.files.write("/tmp/host_echo.py", HOST_ECHO)
        sbx.commands.run("python3 /tmp/host_echo.py", background=True)
        deadline = time.time() + 30
        while proxied(net_server, sbx.sandbox_id, 8001)[0] != 200:
            assert time.time() < deadline
            time.sleep(0.3)
        assert proxied(net_server, sbx.sandbox_id, 8001) == (200, "app.internal:8001")
        assert proxied(net_server, sbx.sandbox_id, 8001, host_form=True) == (200, "app.internal:8001")
        assert sbx.get_info().network["mask_request_host"] == "app.internal:${PORT}"
    finally:
        sbx.kill()


def test_unsupported_network_options_are_refused_not_ignored(net_server):
    for network in [{"egress_proxy": {"address": "10.0.0.1:1080"}},
                    {"egress_proxy": {"address": "198.51.100.9:1080", "tls": {"ca_cert": "x"}}}]:
        with pytest.raises(Exception) as e:
            create(net_server, network=network)
        assert "400" in str(e.value) and "egressProxy" in str(e.value), str(e.value)


def test_pooled_and_cold_sandboxes_get_the_same_identity_and_policy(net_server):
    """The warm pool (on by default) gives a sandbox the request's environment, metadata and
    network policy when a create claims it: of six created at once with the same request, some
    come from the pool and the rest boot cold, and they look alike inside and through the API."""
    import threading
    kw = dict(envs={"FROM_REQUEST": "yes"}, metadata={"who": "pool-test"},
              network={"deny_out": ["198.51.100.11/32"]})
    made, errors = [], []

    def one():
        try:
            made.append(create(net_server, **kw))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert not errors, errors
        log = net_server.log().splitlines()
        pooled = {s.sandbox_id for s in made
                  if any(s.sandbox_id in l and "from the warm pool" in l for l in log)}
        assert pooled and len(pooled) < len(made), f"{len(pooled)} of {len(made)} pooled"
        own = {"E2B_SANDBOX_ID", "HOSTNAME"}
        seen = {}
        for s in made:
            code, env = run(s, "env | sort")
            assert code == 0, env
            env = "\n".join(l for l in env.splitlines() if l.split("=", 1)[0] not in own)
            info = s.get_info()
            seen[s.sandbox_id] = (
                env, info.metadata, info.allow_internet_access, run(s, "id -un; pwd; umask")[1],
                fetch(s, "http://198.51.100.10/"), fetch(s, "http://198.51.100.11/"))
        first = next(iter(seen.values()))
        assert "FROM_REQUEST=yes" in first[0] and first[1] == {"who": "pool-test"}, first
        assert first[4] == "ten" and first[5] is None, first
        for sid, v in seen.items():
            assert v == first, (sid in pooled, sid, v, first)
    finally:
        for s in made:
            s.kill()


def test_kill9_restart_keeps_live_sandboxes_networked_and_frees_dead_ones(internet):
    base = tempfile.mkdtemp(prefix="kiln-netre-")
    state = os.path.join(base, "state")
    first = second = None
    try:
        # --pool-off: this test counts the network slots left; a warm pool's sandbox holds one.
        first = start_net_server(state, "10.136.0.0/24", extra=["--pool-off"])
        keep = create(first)
        doomed = create(first)
        assert fetch(keep, "http://198.51.100.10/") == "ten"
        [prefix] = slot_prefixes_in("10.136.0.")
        first.kill9()
        # While the server is down, one sandbox dies behind its back.
        root = os.path.join(state, "gvisor", "runsc")
        sh(os.environ.get("KILN_RUNSC") or "runsc", f"--root={root}", "delete", "--force",
           doomed.sandbox_id)
        second = start_net_server(state, "10.136.0.0/24", previous=first, extra=["--pool-off"])
        keep = Sandbox.connect(keep.sandbox_id, **second.opts())
        assert fetch(keep, "http://198.51.100.10/") == "ten", second.log()[-3000:]
        code, out = run(keep, "getent hosts host-a.test")
        assert code == 0 and "198.51.100.10" in out, out
        # The dead sandbox's slot is gone: only the live one's and the pool's (2) remain.
        deadline = time.time() + 20
        while len(namespaces_of(prefix)) != 2 * 3:
            assert time.time() < deadline, namespaces_of(prefix)
            time.sleep(0.2)
        keep.kill()
        deadline = time.time() + 20
        while len(namespaces_of(prefix)) != 2 * 2:
            assert time.time() < deadline, namespaces_of(prefix)
            time.sleep(0.2)
    finally:
        for srv in (second, first):
            if srv:
                srv.kill_all_sandboxes()
                srv.stop()
        cleanup_state(state)
        remove_slots_in_range("10.136.0.")
        shutil.rmtree(base, ignore_errors=True)
    assert not slot_prefixes_in("10.136.0."), "slots left behind"


def test_pause_resume_and_fork_keep_the_network_and_its_policy(net_server):
    """A networked sandbox pauses and resumes into its own slot, and forks into fresh slots
    with the same inside addressing: egress, the sandbox's policy and ingress to a port all
    work afterwards."""
    sbx = create(net_server, network={"deny_out": ["198.51.100.11/32"]})
    children = []
    try:
        sbx.files.write("/tmp/www/index.html", "served")
        sbx.commands.run("cd /tmp/www && python3 -m http.server 8000", background=True)
        deadline = time.time() + 15
        while time.time() < deadline and proxied(net_server, sbx.sandbox_id, 8000)[0] != 200:
            time.sleep(0.2)
        assert proxied(net_server, sbx.sandbox_id, 8000) == (200, "served")
        assert fetch(sbx, "http://198.51.100.10/") == "ten"

        assert sbx.pause() is True
        again = Sandbox.connect(sbx.sandbox_id, timeout=120, **net_server.opts())
        assert fetch(again, "http://198.51.100.10/") == "ten", "egress after resume"
        assert fetch(again, "http://198.51.100.11/") is None, "policy kept after resume"
        assert proxied(net_server, sbx.sandbox_id, 8000) == (200, "served"), "ingress after resume"

        children = again.fork(count=2, timeout=120)
        assert all(not isinstance(c, Exception) for c in children), children
        for child in children:
            assert fetch(child, "http://198.51.100.10/") == "ten", "egress in a fork"
            assert proxied(net_server, child.sandbox_id, 8000) == (200, "served"), "ingress in a fork"
        assert fetch(again, "http://198.51.100.10/") == "ten", "the parent keeps its network"
    finally:
        for c in children:
            if not isinstance(c, Exception):
                c.kill()
        sbx.kill()


def test_networking_is_on_by_default_with_an_automatic_range(internet):
    """A server started with no network flags gives sandboxes the internet (E2B's default) in a
    free host range it chose and names at startup; the same state directory gets the same
    range again."""
    base = tempfile.mkdtemp(prefix="kiln-netdef-")
    srv = KilnServer(os.path.join(base, "state"), os.environ.get("KILN_SERVE_EXTRA_ARGS", "").split())
    chosen = None
    try:
        srv.start()
        m = re.search(r"sandbox networking on, host range (10\.(\d+)\.0\.0/16) \(chosen automatically",
                      srv.log())
        assert m, srv.log()
        chosen = m.group(1)
        assert 200 <= int(m.group(2)) <= 254
        sbx = create(srv)
        try:
            assert fetch(sbx, "http://198.51.100.10/") == "ten"
            assert sbx.get_info().allow_internet_access is True
        finally:
            sbx.kill()
        srv.stop()
        again = KilnServer(srv.state_dir, srv.extra_args)
        # Same state: the key persists (none is printed), and the log file is shared.
        again.api_key, again.url = srv.api_key, srv.url
        again.start()
        srv = again
        assert f"host range {chosen} (the range this state directory used before" in srv.log(), srv.log()
    finally:
        srv.kill_all_sandboxes()
        srv.stop()
        log = srv.log()
        cleanup_state(srv.state_dir)
        if chosen:
            remove_slots_in_range(chosen.rsplit(".", 2)[0] + ".")
        shutil.rmtree(base, ignore_errors=True)
        assert "panicked" not in log, log


def test_network_off_answers_501_for_internet_access(internet):
    """`--network off`: sandboxes have no network; asking for internet access (or a policy
    update) is a 501 that says why, while a create that needs no network works."""
    from e2b import SandboxException

    base = tempfile.mkdtemp(prefix="kiln-netoff-")
    srv = KilnServer(os.path.join(base, "state"),
                     ["--network", "off"] + os.environ.get("KILN_SERVE_EXTRA_ARGS", "").split())
    try:
        srv.start()
        assert "sandbox networking off: turned off (--network off)" in srv.log(), srv.log()
        status, resp, _ = srv.request("POST", "/sandboxes",
                                      body={"templateID": "base", "allow_internet_access": True})
        assert status == 501, resp
        assert "--network off" in resp["message"], resp
        sbx = create(srv, allow_internet_access=False)
        try:
            assert fetch(sbx, "http://198.51.100.10/") is None
            # The isolation driver's own "not implemented" reaches the SDK as a 501.
            with pytest.raises(SandboxException) as ei:
                sbx.update_network({"allow_out": ["198.51.100.7"]})
            assert getattr(ei.value, "status_code", None) == 501, repr(ei.value)
            assert "not implemented by this isolation driver" in str(ei.value), str(ei.value)
            assert sbx.commands.run("echo still-here").stdout == "still-here\n"
        finally:
            sbx.kill()
    finally:
        srv.kill_all_sandboxes()
        srv.stop()
        log = srv.log()
        cleanup_state(srv.state_dir)
        shutil.rmtree(base, ignore_errors=True)
        assert "panicked" not in log, log
