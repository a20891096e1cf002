"""`egressProxy` carries over to a sandbox's descendants, through the pinned `e2b` SDK against a
networked `kiln serve` and a test internet of our own (namespace `ktfork`, 198.51.100.240/29,
its own DNS, a web host and a SOCKS5 server with user/password):

- a fork of a sandbox created with `egressProxy` sends its egress through the proxy (the proxy
  logs one more tunnel per request) and its info shows the proxy (never the password);
- a create from a snapshot of it, naming no network settings of its own, does too;
- the fork keeps the proxy across a server restart (kill -9): once recovery has put its
  settings back, its requests go through the proxy again;
- with the proxy down, the parent, the fork and the snapshot's sandbox all fail closed (no
  direct fallback).
Nothing here sends traffic off this machine."""

import os
import shutil
import sys
import tempfile
import textwrap
import time
import uuid

import pytest
from e2b import Sandbox

from .conftest import own_server
from .internet import remove_slots_in_range, require_root, run, wait_command
from .test_server_egress_rules import SOCKS
from .testnet import NetNs, sh

RANGE = "10.187.0.0/24"
NS, HOST_SIDE, WEB_ADDR, SOCKS_ADDR, DNS_ADDR = (
    "ktfork", "198.51.100.241", "198.51.100.242", "198.51.100.243", "198.51.100.244")
HOSTS = {"web.fork.test": WEB_ADDR, "socks.fork.test": SOCKS_ADDR}
USER, PASSWORD = "kiln", "pw-fork-" + uuid.uuid4().hex[:8]

# A plain HTTP server answering `fork-ok <path>`.
WEB = textwrap.dedent("""
    import http.server, sys
    class H(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        def do_GET(self):
            body = f"fork-ok {self.path}".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *a):
            pass
    http.server.ThreadingHTTPServer((sys.argv[1], 80), H).serve_forever()
""")


@pytest.fixture(scope="module")
def forknet():
    """The test internet (web host, DNS); yields the namespace and a scratch directory."""
    require_root()
    ns = NetNs(NS, "ktfork0", f"{HOST_SIDE}/29",
               [f"{a}/29" for a in (WEB_ADDR, SOCKS_ADDR, DNS_ADDR)], HOST_SIDE)
    d = tempfile.mkdtemp(prefix="kiln-forknet-")
    try:
        ns.up()
        ns.dns(DNS_ADDR, HOSTS)
        ns.spawn(sys.executable, "-c", WEB, WEB_ADDR)
        wait_command(["curl", "-s", "-m", "2", f"http://{WEB_ADDR}/up"], "the test web host")
        yield ns, d
    finally:
        ns.down()
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def srv(forknet):
    with own_server("kiln-egressfork-",
                    ["--net-range", RANGE, "--net-pool", "2", "--dns-upstream", DNS_ADDR],
                    after=lambda: remove_slots_in_range(RANGE.rsplit(".", 1)[0] + ".")) as s:
        yield s


def socks_up(ns, log, port):
    proc = ns.spawn(sys.executable, "-c", SOCKS, SOCKS_ADDR, USER, PASSWORD, log, str(port))
    deadline = time.time() + 20
    while sh("ip", "netns", "exec", NS, "python3", "-c",
             f"import socket; socket.create_connection(('{SOCKS_ADDR}', {port}), timeout=1)",
             check=False).returncode != 0:
        assert time.time() < deadline, "the SOCKS5 server did not come up"
        time.sleep(0.2)
    return proc


def tunnels(log):
    try:
        return open(log).read().count(f"CONNECT {WEB_ADDR}:80")
    except OSError:
        return 0


def get(sbx, path):
    """(exit code, body) of a GET of the web host from inside `sbx`."""
    code, out = run(sbx, f"curl -s -m 8 http://web.fork.test{path}")
    return code, out.strip()


def through_proxy(sbx, log, path):
    """Asserts one GET from `sbx` succeeds and was carried by the proxy (one more tunnel)."""
    before = tunnels(log)
    code, body = get(sbx, path)
    assert (code, body) == (0, f"fork-ok {path}"), (code, body)
    assert tunnels(log) == before + 1, f"{path}: the request did not go through the proxy"


def test_forks_and_snapshot_creates_keep_the_egress_proxy(srv, forknet):
    ns, d = forknet
    log = os.path.join(d, "socks.log")
    proc = socks_up(ns, log, 1080)
    opts = srv.opts()
    proxy = {"address": f"{SOCKS_ADDR}:1080", "username": USER, "password": PASSWORD}
    shown = {"address": f"{SOCKS_ADDR}:1080", "username": USER}
    made = []
    try:
        parent = Sandbox.create(timeout=300, **opts, network={"egress_proxy": proxy})
        made.append(parent)
        through_proxy(parent, log, "/parent")

        child = parent.fork(timeout=300)[0]
        made.append(child)
        through_proxy(child, log, "/child")
        assert child.get_info().network.get("egress_proxy") == shown, child.get_info().network
        status, info, _ = srv.request("GET", f"/sandboxes/{child.sandbox_id}")
        assert status == 200 and PASSWORD not in str(info), info

        snap = parent.create_snapshot()
        restored = Sandbox.create(snap.snapshot_id, timeout=300, **opts)
        made.append(restored)
        through_proxy(restored, log, "/restored")
        assert restored.get_info().network.get("egress_proxy") == shown

        # A restart: recovery adopts the fork, then its proxy comes back (until then, for
        # the first moments, its egress follows its lists alone).
        srv.kill9()
        srv.start()
        opts = srv.opts()
        child = Sandbox.connect(child.sandbox_id, **opts)
        made[1] = child
        deadline = time.time() + 30
        while True:
            before = tunnels(log)
            code, body = get(child, "/after-restart")
            if (code, body) == (0, "fork-ok /after-restart") and tunnels(log) == before + 1:
                break
            assert time.time() < deadline, (code, body, srv.log()[-3000:])
            time.sleep(0.5)
        assert child.get_info().network.get("egress_proxy") == shown
        parent = Sandbox.connect(parent.sandbox_id, **opts)
        restored = Sandbox.connect(restored.sandbox_id, **opts)
        made[0], made[2] = parent, restored
        for s, path in ((parent, "/parent-2"), (restored, "/restored-2")):
            deadline = time.time() + 30
            while True:
                before = tunnels(log)
                code, body = get(s, path)
                if (code, body) == (0, f"fork-ok {path}") and tunnels(log) == before + 1:
                    break
                assert time.time() < deadline, (path, code, body)
                time.sleep(0.5)

        # The proxy down: every one of them fails closed.
        proc.kill()
        proc.wait()
        for s, path in ((parent, "/p-down"), (child, "/c-down"), (restored, "/r-down")):
            code, body = get(s, path)
            assert code != 0 and "fork-ok" not in body, (path, code, body)
    finally:
        for s in made:
            try:
                s.kill()
            except Exception:
                pass
    assert PASSWORD not in srv.log()
