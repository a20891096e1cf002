"""The test "internet" of the SDK network tests (namespace `ktsdk`, 198.51.100.0/24): two HTTP
hosts, an HTTPS host that echoes the SNI name, and a DNS server, plus helpers to start a networked
`kiln serve` against it and to clean up its slots. Nothing here sends traffic off this machine."""

import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
import textwrap
import time
import urllib.request

import pytest

from .conftest import KilnServer, cleanup_state
from .testnet import NetNs, require, sh

NS = "ktsdk"
HOST_SIDE = "198.51.100.254"
HTTP_HOSTS = {"198.51.100.10": "ten", "198.51.100.11": "eleven"}
DNS_ADDR = "198.51.100.53"
NAMES = {"host-a.test": "198.51.100.10", "alias-a.test": "198.51.100.10",
         "www.site.test": "198.51.100.10", "host-b.test": "198.51.100.11"}

# An HTTPS server answering with the SNI name the client sent.
TLS_SERVER = textwrap.dedent("""
    import http.server, ssl, sys
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = ("tls:" + self.request.server_hostname_seen).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *a):
            pass
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(sys.argv[2], sys.argv[3])
    def sni(sock, name, _ctx):
        sock.server_hostname_seen = name or ""
    ctx.sni_callback = sni
    srv = http.server.ThreadingHTTPServer((sys.argv[1], 443), H)
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    srv.serve_forever()
""")

def require_root():
    require(os.geteuid() == 0, "the network tests need root (network namespaces, nftables)")


def wait_http(url: str, timeout: float = 30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            return urllib.request.urlopen(url, timeout=2).read().decode()
        except OSError:
            time.sleep(0.2)
    pytest.fail(f"test host {url} did not come up")


def wait_command(args, what: str, tries: int = 150):
    """Runs the probe `args` every 0.2 s until it succeeds (`tries` times at most), else fails
    the test saying `what` did not come up."""
    for _ in range(tries):
        if sh(*args, check=False).returncode == 0:
            return
        time.sleep(0.2)
    pytest.fail(f"{what} did not come up")


@pytest.fixture(scope="module")
def internet():
    require_root()
    ns = NetNs(NS, "ktsdk0", f"{HOST_SIDE}/24", [f"{a}/24" for a in [*HTTP_HOSTS, DNS_ADDR]], HOST_SIDE)
    www = tempfile.mkdtemp(prefix="kiln-inet-")
    try:
        ns.up()
        for ip, body in HTTP_HOSTS.items():
            d = os.path.join(www, ip)
            os.makedirs(d)
            with open(os.path.join(d, "index.html"), "w") as f:
                f.write(body)
            ns.spawn(sys.executable, "-m", "http.server", "--bind", ip, "80", cwd=d)
        ns.dns(DNS_ADDR, NAMES)
        cert, key = os.path.join(www, "c.pem"), os.path.join(www, "k.pem")
        sh("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
           "-days", "1", "-subj", "/CN=host-a.test",
           "-addext", "subjectAltName=DNS:host-a.test,DNS:alias-a.test,DNS:www.site.test")
        ns.spawn(sys.executable, "-c", TLS_SERVER, "198.51.100.10", cert, key)
        for ip, body in HTTP_HOSTS.items():
            assert wait_http(f"http://{ip}/") == body
        deadline = time.time() + 30
        while sh("curl", "-sk", "-m", "2", "--resolve", "host-a.test:443:198.51.100.10",
                 "https://host-a.test/", check=False).stdout != "tls:host-a.test":
            assert time.time() < deadline, "the TLS test host did not come up"
            time.sleep(0.2)
        yield
    finally:
        ns.down()
        shutil.rmtree(www, ignore_errors=True)


def slot_prefixes_in(net: str) -> set:
    """Name prefixes of kiln slots whose host veths route into `net` (e.g. "10.135.0.")."""
    routes = json.loads(sh("ip", "-j", "route").stdout or "[]")
    return {r["dev"][:5] for r in routes
            if re.fullmatch(r"k[0-9a-f]{4}h\d+", r.get("dev", "")) and r["dst"].startswith(net)}


def namespaces_of(prefix: str) -> list:
    return sorted(n for n in os.listdir("/run/netns") if n.startswith(prefix + "-"))


def remove_slots_in_range(net: str = "10.135.0."):
    """Removes the namespaces, veths and host table a stopped kiln left in `net`."""
    prefixes = slot_prefixes_in(net)
    for p in prefixes:
        for ns in os.listdir("/run/netns"):
            if ns.startswith(p + "-"):
                sh("ip", "netns", "del", ns, check=False)
        for dev in os.listdir("/sys/class/net"):
            if dev.startswith(p + "h"):
                sh("ip", "link", "del", dev, check=False)
        sh("nft", "delete", "table", "ip", f"kiln_{p}", check=False)
    return prefixes


def start_net_server(state_dir: str, net_range: str, previous: KilnServer = None,
                     extra=(), dns: str = DNS_ADDR) -> KilnServer:
    # Networking is on by default; the flags pick this test's range, pool and resolver.
    flags = ["--net-range", net_range, "--net-pool", "2", "--dns-upstream", dns, *extra]
    srv = KilnServer(state_dir, flags + os.environ.get("KILN_SERVE_EXTRA_ARGS", "").split())
    if previous:
        # Same state: the key persists (none is printed), and the log file is shared.
        srv.api_key, srv.url = previous.api_key, previous.url
    return srv.start()


@contextlib.contextmanager
def net_server_in(name: str, net_range: str, extra=(), dns: str = DNS_ADDR):
    """A networked `kiln serve` in a temporary state dir, for one test module (`extra`: more
    `kiln serve` flags, `dns`: the sandboxes' upstream resolver); afterwards its sandboxes, state, slots (in `net_range`, a /24) and dir
    are gone, its log's tail is printed, and a panic in that log fails the module."""
    base = tempfile.mkdtemp(prefix=f"kiln-{name.replace(' ', '-')}-")
    srv, log = None, ""
    try:
        srv = start_net_server(os.path.join(base, "state"), net_range, extra=extra, dns=dns)
        yield srv
    finally:
        if srv:
            srv.kill_all_sandboxes()
            srv.stop()
            log = srv.log()
            print(f"---- kiln serve ({name}) log (tail) ----\n" + log[-6000:])
            cleanup_state(srv.state_dir)
        remove_slots_in_range(net_range.split("/")[0].rsplit(".", 1)[0] + ".")
        shutil.rmtree(base, ignore_errors=True)
        assert "panicked" not in log, f"the server panicked:\n{log}"


def run(sbx, cmd: str, timeout: float = 30):
    """(exit code, stdout) of a shell command in the sandbox."""
    try:
        r = sbx.commands.run(cmd, timeout=timeout)
        return r.exit_code, r.stdout
    except Exception as e:  # CommandExitException carries the result
        return getattr(e, "exit_code", -1), getattr(e, "stdout", "")


def fetch(sbx, url: str):
    code, out = run(sbx, f"curl -s -m 3 {url}")
    return out.strip() if code == 0 else None
