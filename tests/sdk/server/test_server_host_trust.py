"""Host trust for egress: `kiln serve` trusts the host's extra CA certificates (the `*.crt`
files of `--host-ca-dir`, here a temporary directory holding a test CA, never the host's real
/usr/local/share/ca-certificates) inside every sandbox, beside kiln's own interception CA, and
`--host-cas off` trusts only kiln's. The HTTPS server the sandbox calls runs inside the sandbox
itself (127.0.0.1), with a leaf of the test CA: no traffic leaves the sandbox."""

import os
import shutil
import tempfile
import textwrap

import pytest
from e2b import Sandbox

from .conftest import KilnServer, cleanup_state
from .internet import run
from .testnet import sh

HTTPS = textwrap.dedent("""
    import http.server, ssl
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")
        def log_message(self, *a):
            pass
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain("/tmp/leaf.pem", "/tmp/leaf.key")
    srv = http.server.HTTPServer(("127.0.0.1", 8443), H)
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    srv.serve_forever()
""")


@pytest.fixture(scope="module")
def pki():
    """A test CA in a directory laid out as /usr/local/share/ca-certificates (a `.crt` in a
    subdirectory, a stray key that must not be read), and a leaf of it for localhost."""
    d = tempfile.mkdtemp(prefix="kiln-hosttrust-")
    cas = os.path.join(d, "ca-certificates")
    os.makedirs(os.path.join(cas, "corp"))
    ca_key, ca = os.path.join(d, "ca.key"), os.path.join(cas, "corp", "test-proxy.crt")
    sh("openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
       "-keyout", ca_key, "-out", ca, "-days", "2", "-subj", "/CN=kiln host trust test CA",
       "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign")
    shutil.copy(ca_key, os.path.join(cas, "stray.key"))
    key, csr, leaf, ext = (os.path.join(d, f"leaf.{x}") for x in ("key", "csr", "pem", "ext"))
    with open(ext, "w") as f:
        f.write("subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
                "extendedKeyUsage=serverAuth\n")
    sh("openssl", "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
       "-keyout", key, "-out", csr, "-subj", "/CN=localhost")
    sh("openssl", "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
       "-out", leaf, "-days", "2", "-extfile", ext)
    try:
        yield {"dir": cas, "ca": open(ca).read(), "leaf": open(leaf).read(), "key": open(key).read()}
    finally:
        shutil.rmtree(d, ignore_errors=True)


def serve(pki, *flags):
    base = tempfile.mkdtemp(prefix="kiln-hosttrust-srv-")
    extra = os.environ.get("KILN_SERVE_EXTRA_ARGS", "").split()
    return KilnServer(os.path.join(base, "state"), [*extra, "--host-ca-dir", pki["dir"], *flags]).start()


def stop(srv):
    srv.kill_all_sandboxes()
    srv.stop()
    log = srv.log()
    cleanup_state(srv.state_dir)
    shutil.rmtree(os.path.dirname(srv.state_dir), ignore_errors=True)
    assert "panicked" not in log, log[-8000:]


def https_in(sbx, pki):
    """Starts the HTTPS server in the sandbox; (curl exit code, body) of a call to it."""
    sbx.files.write("/tmp/leaf.pem", pki["leaf"])
    sbx.files.write("/tmp/leaf.key", pki["key"])
    sbx.files.write("/tmp/https.py", HTTPS)
    sbx.commands.run("python3 /tmp/https.py", background=True)
    code, out = run(sbx, "for i in $(seq 50); do curl -sk -m 2 https://127.0.0.1:8443/ && break; "
                         "sleep 0.1; done")
    assert out.strip() == "ok", out
    return run(sbx, "curl -sS -m 5 https://localhost:8443/ 2>&1")


def test_sandboxes_trust_the_hosts_extra_cas(pki):
    srv = serve(pki)
    try:
        sbx = Sandbox.create(timeout=120, **srv.opts(), envs={"PIP_CERT": "/mine.pem"})
        try:
            code, out = https_in(sbx, pki)
            assert (code, out.strip()) == (0, "ok"), out
            # Python's ssl (the system bundle) and requests' variable trust it too.
            code, out = run(sbx, "python3 -c \"import urllib.request as u; "
                                 "print(u.urlopen('https://localhost:8443/', timeout=5).read().decode())\"")
            assert (code, out.strip()) == (0, "ok"), out
            env = run(sbx, "env")[1]
            assert "REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt" in env, env
            assert "NODE_EXTRA_CA_CERTS=/usr/local/share/ca-certificates/kiln-extra-cas.crt" in env
            assert "PIP_CERT=/mine.pem" in env, env  # the request's own value wins
            # One file for every extra CA (Node reads one): the host's, then kiln's own.
            got = sbx.files.read("/usr/local/share/ca-certificates/kiln-extra-cas.crt")
            assert got.startswith(pki["ca"].strip()) and got.count("BEGIN CERTIFICATE") == 2, got
            bundle = sbx.files.read("/etc/ssl/certs/ca-certificates.crt")
            assert bundle.count(pki["ca"].strip()) == 1
            assert "PRIVATE KEY" not in got and "PRIVATE KEY" not in bundle
        finally:
            sbx.kill()
    finally:
        stop(srv)


def test_host_cas_off_trusts_nothing_extra(pki):
    srv = serve(pki, "--host-cas", "off")
    try:
        sbx = Sandbox.create(timeout=120, **srv.opts())
        try:
            code, out = https_in(sbx, pki)
            assert code != 0 and "certificate" in out.lower(), (code, out)
            # Only kiln's interception CA is added.
            got = sbx.files.read("/usr/local/share/ca-certificates/kiln-extra-cas.crt")
            assert got.count("BEGIN CERTIFICATE") == 1 and pki["ca"].strip() not in got, got
            assert pki["ca"].strip() not in sbx.files.read("/etc/ssl/certs/ca-certificates.crt")
        finally:
            sbx.kill()
    finally:
        stop(srv)
