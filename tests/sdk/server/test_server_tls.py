"""The e2b SDK with E2B_DOMAIN alone against `kiln serve --tls-cert/--tls-key` on port 443.

The SDK then talks `https://api.<domain>` and `https://<port>-<id>.<domain>` (pyqwest: rustls,
its own DNS resolver reading /etc/resolv.conf). The client runs in a network namespace
(`ktls`) whose /etc/netns/ktls/resolv.conf points at a tiny DNS server in that namespace that
answers `<domain>` and `*.<domain>` with kiln's address, on a veth pair in 198.51.100.200/30;
it trusts a test CA through SSL_CERT_FILE. Nothing on the host's own DNS or /etc/hosts is
touched, and no traffic leaves this machine.

Checked: create, commands, files over TLS; a server inside the sandbox reached with
`get_host(port)` over https with HTTP/2 (ALPN) and HTTP/1.1, seeing X-Forwarded-Proto https;
h2c with prior knowledge on the same port in plain text. Needs root."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from .conftest import cleanup_state, kiln_bin
from .testnet import NetNs, require, sh

NS = "ktls"
HOST_SIDE = "198.51.100.201"
NS_SIDE = "198.51.100.202"
DOMAIN = "kiln-tls.test"
RANGE = "10.161.0.0/24"

# Serves, in the sandbox, what the proxy told it: the scheme the client used.
ECHO_SERVER = textwrap.dedent("""
    import http.server
    class H(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        def do_GET(self):
            body = ("proto=" + str(self.headers.get("X-Forwarded-Proto"))).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *a):
            pass
    http.server.ThreadingHTTPServer(("0.0.0.0", 8000), H).serve_forever()
""")

# Runs in the namespace with E2B_DOMAIN, E2B_API_KEY and SSL_CERT_FILE only.
CLIENT = textwrap.dedent("""
    import json, os, subprocess, sys, time, urllib.request
    from e2b import Sandbox
    out = {}
    sbx = Sandbox.create(timeout=120)
    try:
        out["api_url"] = sbx.connection_config.api_url
        out["echo"] = sbx.commands.run("echo hello over tls").stdout.strip()
        sbx.files.write("/tmp/f.txt", "file over tls")
        out["file"] = sbx.files.read("/tmp/f.txt")
        sbx.files.write("/tmp/echo.py", sys.argv[1])
        sbx.commands.run("python3 /tmp/echo.py", background=True)
        host = sbx.get_host(8000)
        out["host"] = host
        deadline = time.time() + 30
        while True:
            try:
                out["urllib"] = urllib.request.urlopen(f"https://{host}/", timeout=5).read().decode()
                break
            except OSError as e:
                if time.time() > deadline:
                    out["urllib"] = repr(e)
                    break
                time.sleep(0.3)
        def curl(*args):
            r = subprocess.run(["curl", "-sS", "-m", "20", "--cacert", os.environ["SSL_CERT_FILE"],
                                "-w", " %{http_version}", *args],
                               capture_output=True, text=True)
            return (r.stdout + r.stderr).strip()
        out["h2"] = curl("--http2", f"https://{host}/")
        out["h1"] = curl("--http1.1", f"https://{host}/")
        out["h2c"] = curl("--http2-prior-knowledge", f"http://{host}:443/")
    finally:
        sbx.kill()
    print("RESULT " + json.dumps(out))
""")


def make_certs(d: str):
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    sh("openssl", "req", "-x509", "-days", "2", *ec, "-keyout", f"{d}/ca.key", "-out", f"{d}/ca.pem",
       "-subj", "/CN=kiln test CA")
    sh("openssl", "req", *ec, "-keyout", f"{d}/key.pem", "-out", f"{d}/leaf.csr", "-subj", f"/CN={DOMAIN}")
    with open(f"{d}/ext.cnf", "w") as f:
        f.write(f"subjectAltName=DNS:{DOMAIN},DNS:*.{DOMAIN}\nbasicConstraints=CA:FALSE\n"
                "keyUsage=digitalSignature\nextendedKeyUsage=serverAuth\n")
    sh("openssl", "x509", "-req", "-in", f"{d}/leaf.csr", "-CA", f"{d}/ca.pem", "-CAkey", f"{d}/ca.key",
       "-CAcreateserial", "-days", "2", "-out", f"{d}/cert.pem", "-extfile", f"{d}/ext.cnf")


@pytest.fixture(scope="module")
def client_ns():
    require(os.geteuid() == 0, "needs root (network namespaces)")
    require(bool(shutil.which("openssl") and shutil.which("curl")), "needs openssl and curl")
    ns = NetNs(NS, "ktls0", f"{HOST_SIDE}/30", [f"{NS_SIDE}/30"])
    try:
        ns.up().resolver("127.0.0.1")
        ns.dns("127.0.0.1", {DOMAIN: HOST_SIDE, f"*.{DOMAIN}": HOST_SIDE}, ttl=5)
        deadline = time.time() + 20
        while sh("ip", "netns", "exec", NS, "getent", "hosts", f"api.{DOMAIN}", check=False).stdout.split()[:1] \
                != [HOST_SIDE]:
            assert time.time() < deadline, "the test DNS server did not come up"
            time.sleep(0.2)
        yield
    finally:
        ns.down()


@pytest.fixture(scope="module")
def tls_server(client_ns):
    base = tempfile.mkdtemp(prefix="kiln-tls-")
    certs = os.path.join(base, "certs")
    os.makedirs(certs)
    make_certs(certs)
    state = os.path.join(base, "state")
    log_path = os.path.join(base, "serve.log")
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [kiln_bin(), "serve", "--no-prepare", "--listen", f"{HOST_SIDE}:443", "--state-dir", state,
         "--domain", DOMAIN, "--tls-cert", f"{certs}/cert.pem", "--tls-key", f"{certs}/key.pem",
         "--net-range", RANGE, "--net-pool", "1"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        env={**os.environ, "NO_COLOR": "1"})
    try:
        deadline = time.time() + 60
        key = None
        while time.time() < deadline and not key:
            text = open(log_path).read()
            assert proc.poll() is None, f"kiln serve exited:\n{text}"
            if "E2B_DOMAIN=" in text:
                key = text.split("first API key (shown once, store it now): ")[1].split()[0]
                break
            time.sleep(0.1)
        assert key, f"kiln serve did not start:\n{open(log_path).read()}"
        yield {"key": key, "ca": f"{certs}/ca.pem", "log": log_path}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        text = open(log_path).read()
        print("---- kiln serve (tls) log (tail) ----\n" + text[-4000:])
        cleanup_state(state)
        shutil.rmtree(base, ignore_errors=True)
        assert "panicked" not in text


def test_sdk_with_e2b_domain_alone_over_tls_and_http2_to_a_sandbox_port(tls_server):
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update({"E2B_DOMAIN": DOMAIN, "E2B_API_KEY": tls_server["key"], "SSL_CERT_FILE": tls_server["ca"]})
    r = subprocess.run(["ip", "netns", "exec", NS, sys.executable, "-c", CLIENT, ECHO_SERVER],
                       capture_output=True, text=True, env=env, timeout=300)
    lines = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
    assert r.returncode == 0 and lines, f"client failed:\n{r.stdout}\n{r.stderr}"
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["api_url"] == f"https://api.{DOMAIN}"
    assert out["echo"] == "hello over tls"
    assert out["file"] == "file over tls"
    assert out["host"].startswith("8000-") and out["host"].endswith("." + DOMAIN), out
    assert out["urllib"] == "proto=https", out
    assert out["h2"] == "proto=https 2", out
    assert out["h1"] == "proto=https 1.1", out
    assert out["h2c"] == "proto=http 2", out
