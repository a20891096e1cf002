"""`network.rules` header transforms with secrets, through the pinned `e2b` SDK against a
networked `kiln serve` and a test internet of our own (namespace `ktsec`, 198.51.100.0/24, its
own DNS and its own upstream CA, which the server trusts through KILN_EGRESS_TRUST):

- HTTPS to a rule's host is intercepted: the echo service sees the injected header (the
  sandbox's own `Authorization` replaced), for curl and for Python, while a search of the
  sandbox's environment, files and /proc for the secret's value finds nothing, and neither
  the audit log, the server log nor any API answer holds it;
- a host without a rule is not intercepted (a client pinned to the test CA succeeds);
- an upstream with a bad certificate is refused with a clear 502, never bypassed;
- an unknown secret in a placeholder fails the create with a 400 naming it;
- `update_network` replaces the rules (without them the host is relayed plainly again);
- `mcp` at create is stored and echoed by get_info;
- `egressProxy`: egress goes through a SOCKS5 server of the test (user/password), fails closed
  when it is down or refuses the credentials, and `update_network` without it goes direct.
Nothing here sends traffic off this machine."""

import json
import os
import shutil
import sys
import tempfile
import textwrap
import uuid

import pytest
from e2b import Sandbox, Secret

from .conftest import own_server
from .internet import remove_slots_in_range, require_root, run, wait_command
from .testnet import NetNs, sh

RANGE = "10.167.0.0/24"
NS, HOST_SIDE, DNS_ADDR = "ktsec", "198.51.100.254", "198.51.100.53"
HOSTS = {"api.sec.test": "198.51.100.20", "other.sec.test": "198.51.100.21",
         "bad.sec.test": "198.51.100.22", "socks.sec.test": "198.51.100.30"}
SOCKS_ADDR = "198.51.100.30"

# A SOCKS5 server (RFC 1928, user/password RFC 1929, CONNECT only): argv = bind address, user,
# password, log file (one `CONNECT host:port` line per tunnel), port, and for TLS a
# certificate and key.
SOCKS = textwrap.dedent(r"""
    import socket, struct, sys, threading
    import ssl
    bind, user, pw, log = sys.argv[1], sys.argv[2].encode(), sys.argv[3].encode(), sys.argv[4]
    port, tls = int(sys.argv[5]), None
    if len(sys.argv) > 6:
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain(sys.argv[6], sys.argv[7])
    def pipe(a, b):
        try:
            while True:
                d = a.recv(65536)
                if not d:
                    break
                b.sendall(d)
        except OSError:
            pass
        try:
            b.shutdown(socket.SHUT_WR)
        except OSError:
            pass
    def exact(c, n):
        b = b""
        while len(b) < n:
            d = c.recv(n - len(b))
            if not d:
                raise OSError("eof")
            b += d
        return b
    def serve(c):
        try:
            if tls:
                c = tls.wrap_socket(c, server_side=True)
            ver, n = exact(c, 2)
            methods = exact(c, n)
            if 2 not in methods:
                c.sendall(b"\x05\xff"); return
            c.sendall(b"\x05\x02")
            _, ul = exact(c, 2); u = exact(c, ul); pl = exact(c, 1)[0]; p = exact(c, pl)
            if (u, p) != (user, pw):
                c.sendall(b"\x01\x01"); return
            c.sendall(b"\x01\x00")
            ver, cmd, _, atyp = exact(c, 4)
            if atyp == 1:
                host = socket.inet_ntoa(exact(c, 4))
            elif atyp == 3:
                host = exact(c, exact(c, 1)[0]).decode()
            else:
                c.sendall(b"\x05\x08\x00\x01" + bytes(6)); return
            port = struct.unpack("!H", exact(c, 2))[0]
            with open(log, "a") as f:
                f.write(f"CONNECT {host}:{port}\n")
            try:
                up = socket.create_connection((host, port), timeout=5)
            except OSError:
                c.sendall(b"\x05\x05\x00\x01" + bytes(6)); return
            c.sendall(b"\x05\x00\x00\x01" + socket.inet_aton(up.getsockname()[0])
                      + struct.pack("!H", up.getsockname()[1]))
            t = threading.Thread(target=pipe, args=(up, c), daemon=True)
            t.start()
            pipe(c, up)
            t.join()
        except OSError:
            pass
        finally:
            c.close()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((bind, port))
    s.listen(64)
    while True:
        c, _ = s.accept()
        threading.Thread(target=serve, args=(c,), daemon=True).start()
""")

# An HTTPS server answering with the request's headers as JSON.
ECHO = textwrap.dedent("""
    import http.server, json, ssl, sys
    class H(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        def do_GET(self):
            body = json.dumps({"path": self.path,
                               "headers": {k.lower(): v for k, v in self.headers.items()}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *a):
            pass
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(sys.argv[2], sys.argv[3])
    srv = http.server.ThreadingHTTPServer((sys.argv[1], 443), H)
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    srv.serve_forever()
""")

# Looks for the value (given in two halves, so no process's environment or command line holds
# it whole) in every file and in every other process's environ and cmdline.
SEARCH = textwrap.dedent("""
    import os, sys
    needle = (os.environ["HALF_A"] + os.environ["HALF_B"]).encode()
    me, hits = str(os.getpid()), []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and pid != me:
            for f in ("environ", "cmdline"):
                try:
                    if needle in open(f"/proc/{pid}/{f}", "rb").read():
                        hits.append(f"/proc/{pid}/{f}")
                except OSError:
                    pass
    for top in ("/etc", "/home", "/root", "/tmp", "/usr/local", "/var", "/run", "/opt"):
        for d, dirs, files in os.walk(top):
            for f in files:
                p = os.path.join(d, f)
                try:
                    if os.path.isfile(p) and os.path.getsize(p) < 8 << 20 and needle in open(p, "rb").read():
                        hits.append(p)
                except OSError:
                    pass
    print("\\n".join(hits) or "none")
""")


def openssl(*args):
    sh("openssl", *args)


@pytest.fixture(scope="module")
def secnet():
    """The test internet: the echo hosts (two with certificates of the test CA, one
    self-signed) and a DNS server; yields the test CA's path."""
    require_root()
    ns = NetNs(NS, "ktsec0", f"{HOST_SIDE}/24",
               [f"{a}/24" for a in [*set(HOSTS.values()), DNS_ADDR]], HOST_SIDE)
    d = tempfile.mkdtemp(prefix="kiln-secnet-")
    try:
        ns.up()
        ns.dns(DNS_ADDR, HOSTS)
        ca_key, ca = os.path.join(d, "ca.key"), os.path.join(d, "ca.pem")
        openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                "-keyout", ca_key, "-out", ca, "-days", "2", "-subj", "/CN=kiln test upstream CA",
                "-addext", "basicConstraints=critical,CA:TRUE",
                "-addext", "keyUsage=critical,keyCertSign,cRLSign")
        for name, ip in HOSTS.items():
            key, cert = os.path.join(d, f"{name}.key"), os.path.join(d, f"{name}.pem")
            ext = os.path.join(d, f"{name}.ext")
            with open(ext, "w") as f:
                f.write(f"subjectAltName=DNS:{name}\nbasicConstraints=CA:FALSE\n"
                        "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n"
                        "authorityKeyIdentifier=keyid\n")
            if name == "bad.sec.test":
                openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
                        "-nodes", "-keyout", key, "-out", cert, "-days", "2", "-subj", f"/CN={name}",
                        "-addext", f"subjectAltName=DNS:{name}")
            else:
                csr = os.path.join(d, f"{name}.csr")
                openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
                        "-nodes", "-keyout", key, "-out", csr, "-subj", f"/CN={name}")
                openssl("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
                        "-out", cert, "-days", "2", "-extfile", ext)
            if name != "socks.sec.test":
                ns.spawn(sys.executable, "-c", ECHO, ip, cert, key)
        for name, ip in HOSTS.items():
            if name == "socks.sec.test":
                continue
            args = ["curl", "-s", "-m", "2", "--resolve", f"{name}:443:{ip}", f"https://{name}/up"]
            args[1:1] = ["-k"] if name == "bad.sec.test" else ["--cacert", ca]
            wait_command(args, f"the test host {name}")
        yield ca, ns, d
    finally:
        ns.down()
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def srv(secnet):
    with own_server("kiln-rules-",
                    ["--net-range", RANGE, "--net-pool", "2", "--dns-upstream", DNS_ADDR],
                    env={"KILN_EGRESS_TRUST": secnet[0]},
                    after=lambda: remove_slots_in_range(RANGE.rsplit(".", 1)[0] + ".")) as s:
        yield s


def curl(sbx, args):
    """(exit code, HTTP status, body) of a curl in the sandbox."""
    code, out = run(sbx, f"curl -s -m 10 -w '\\n%{{http_code}}' {args}")
    body, _, status = out.rpartition("\n")
    return code, status.strip(), body


def test_rules_inject_secrets_that_never_enter_the_sandbox(srv, secnet):
    secnet = secnet[0]
    opts = srv.opts()
    tag = uuid.uuid4().hex[:8]
    value = f"sk-{uuid.uuid4().hex}"
    name = f"svc-{tag}"
    Secret.create(name, value, **opts)
    rules = {
        "api.sec.test": [
            {"transform": {"headers": {"Authorization": "Bearer " + Secret.fill(name)}}},
            {"transform": {"headers": {"X-Kiln-Rule": "one"}}},
        ],
        "bad.sec.test": [{"transform": {"headers": {"X-Kiln-Rule": "bad"}}}],
    }
    # An unknown secret fails the create, naming it.
    with pytest.raises(Exception) as e:
        Sandbox.create(timeout=120, **opts, network={"rules": {
            "api.sec.test": [{"transform": {"headers": {"A": Secret.fill(f"nope-{tag}")}}}]}})
    assert f"nope-{tag}" in str(e.value) and "400" in str(e.value), e.value

    sbx = Sandbox.create(timeout=120, **opts, network={"rules": rules})
    try:
        sbx.files.write("/tmp/testca.pem", open(secnet).read())
        # curl through the system bundle: kiln's CA signs the rule host's leaf.
        code, status, body = curl(sbx, "-H 'Authorization: mine' https://api.sec.test/a?b=1")
        assert (code, status) == (0, "200"), body
        seen = json.loads(body)
        assert seen["headers"]["authorization"] == f"Bearer {value}", seen
        assert seen["headers"]["x-kiln-rule"] == "one" and seen["path"] == "/a?b=1", seen
        # HTTP/2 towards the sandbox when its client offers it (curl's default over TLS).
        code, out = run(sbx, "curl -s -m 10 --http2 -w '\\n%{http_version}' https://api.sec.test/h2 "
                             "https://api.sec.test/h2b")
        assert code == 0 and out.strip().endswith("2") and out.count(f"Bearer {value}") == 2, out
        # Keep-alive: both requests of one connection carry it.
        code, out = run(sbx, "curl -s -m 10 https://api.sec.test/1 https://api.sec.test/2")
        assert code == 0 and out.count(f"Bearer {value}") == 2, out
        # Python's ssl (OpenSSL's default paths) trusts it too.
        code, out = run(sbx, "python3 -c \"import urllib.request as u; "
                             "print(u.urlopen('https://api.sec.test/py', timeout=10).read().decode())\"")
        assert code == 0 and f"Bearer {value}" in out, out
        env = run(sbx, "env")[1]
        assert "REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt" in env, env
        assert "NODE_EXTRA_CA_CERTS=/usr/local/share/ca-certificates/kiln-extra-cas.crt" in env

        # The rule host is intercepted: pinned to the test CA, curl refuses kiln's leaf ...
        code, status, _ = curl(sbx, "--cacert /tmp/testca.pem https://api.sec.test/")
        assert code != 0, status
        # ... while a host without a rule is the upstream's own TLS.
        code, status, body = curl(sbx, "--cacert /tmp/testca.pem -H 'Authorization: mine' "
                                       "https://other.sec.test/")
        assert (code, status) == (0, "200"), body
        assert json.loads(body)["headers"]["authorization"] == "mine"

        # A bad upstream certificate is refused, clearly, never bypassed.
        code, status, body = curl(sbx, "https://bad.sec.test/")
        assert status == "502" and "kiln egress: upstream bad.sec.test" in body, (status, body)
        assert "certificate" in body.lower(), body
        assert "x-kiln-rule" not in body

        # The value is nowhere in the sandbox.
        half = len(value) // 2
        sbx.files.write("/tmp/search.py", SEARCH)
        code, out = run(sbx, f"HALF_A={value[:half]} HALF_B={value[half:]} python3 /tmp/search.py",
                        timeout=120)
        assert code == 0 and out.strip() == "none", out

        # API answers echo the placeholders, never the value.
        info = sbx.get_info()
        assert info.network["rules"]["api.sec.test"][0]["transform"]["headers"]["authorization"] \
            == "Bearer " + Secret.fill(name), info.network
        status, detail, _ = srv.request("GET", f"/sandboxes/{sbx.sandbox_id}")
        assert status == 200 and value not in json.dumps(detail)

        # The audit log names the rule that fired, not the value.
        status, page, _ = srv.request("GET", f"/sandboxes/{sbx.sandbox_id}/audit?kind=net&limit=1000")
        assert status == 200, page
        assert value not in json.dumps(page)
        fired = [r["body"]["rule"] for r in page["records"] if r["body"].get("name") == "api.sec.test"]
        assert fired and all("transform api.sec.test (authorization, x-kiln-rule)" in f
                             for f in fired), fired
        bad = [r["body"] for r in page["records"]
               if r["body"].get("name") == "bad.sec.test" and r["body"]["event"] == "close"]
        assert bad and "certificate" in bad[-1].get("error", "").lower(), bad

        # Replace semantics: no rules any more, the host is the upstream's own TLS again.
        sbx.update_network({})
        code, status, body = curl(sbx, "--cacert /tmp/testca.pem https://api.sec.test/")
        assert (code, status) == (0, "200"), body
        assert "authorization" not in json.loads(body)["headers"]
        assert "rules" not in (sbx.get_info().network or {})
        # And back, by update: the CA is already trusted.
        sbx.update_network({"rules": rules})
        code, status, body = curl(sbx, "https://api.sec.test/")
        assert (code, status) == (0, "200") and f"Bearer {value}" in body, body
        # A new version applies to the next request.
        Secret.update(name, value + "-v2", **opts)
        code, status, body = curl(sbx, "https://api.sec.test/")
        assert f"Bearer {value}-v2" in body, body
        # Deleted: the next request is answered by kiln, never sent on without the header.
        Secret.destroy(name, **opts)
        code, status, body = curl(sbx, "https://api.sec.test/")
        assert status == "502" and "does not exist" in body and value not in body, body
    finally:
        sbx.kill()
    assert value not in srv.log()


def test_mcp_is_stored_and_echoed(srv):
    mcp = {"github/kiln-test/none": {"run_cmd": "true", "envs": {"A": "b"}}}
    status, body, _ = srv.request("POST", "/sandboxes", {"templateID": "base", "timeout": 60,
                                                         "mcp": mcp})
    assert status == 201, body
    sid = body["sandboxID"]
    try:
        status, info, _ = srv.request("GET", f"/sandboxes/{sid}")
        assert status == 200 and info["mcp"] == mcp, info
    finally:
        srv.request("DELETE", f"/sandboxes/{sid}")
    status, body, _ = srv.request("POST", "/sandboxes", {"templateID": "base", "mcp": "x"})
    assert status == 400, body


def wait_socks(*ports):
    """Waits until the test's SOCKS5 servers answer on `ports` of SOCKS_ADDR."""
    import time
    deadline = time.time() + 20
    while any(sh("ip", "netns", "exec", NS, "python3", "-c",
                 f"import socket; socket.create_connection(('{SOCKS_ADDR}', {port}), timeout=1)",
                 check=False).returncode != 0 for port in ports):
        assert time.time() < deadline, "the SOCKS5 server did not come up"
        time.sleep(0.2)


def test_egress_proxy_tunnels_and_fails_closed(srv, secnet):
    ca, ns, d = secnet
    log = os.path.join(d, "socks.log")
    proc = ns.spawn(sys.executable, "-c", SOCKS, SOCKS_ADDR, "kiln", "pw-" + "x" * 8, log, "1080")
    ns.spawn(sys.executable, "-c", SOCKS, SOCKS_ADDR, "kiln", "pw-" + "x" * 8, log, "1081",
             os.path.join(d, "socks.sec.test.pem"), os.path.join(d, "socks.sec.test.key"))
    wait_socks(1080, 1081)
    opts = srv.opts()
    proxy = {"address": f"{SOCKS_ADDR}:1080", "username": "kiln", "password": "pw-" + "x" * 8}
    # A proxy on a private address is refused before any sandbox exists.
    with pytest.raises(Exception) as e:
        Sandbox.create(timeout=60, **opts, network={"egress_proxy": {"address": "10.1.2.3:1080"}})
    assert "always-denied" in str(e.value), e.value
    sbx = Sandbox.create(timeout=120, **opts, network={"egress_proxy": proxy})
    try:
        sbx.files.write("/tmp/testca.pem", open(ca).read())
        url = "--cacert /tmp/testca.pem https://other.sec.test/through"
        code, status, body = curl(sbx, url)
        assert (code, status) == (0, "200"), body
        assert "CONNECT 198.51.100.21:443" in open(log).read()
        # Never the password in an answer.
        assert sbx.get_info().network["egress_proxy"] == {"address": f"{SOCKS_ADDR}:1080",
                                                          "username": "kiln"}
        status, detail, _ = srv.request("GET", f"/sandboxes/{sbx.sandbox_id}")
        assert "pw-" not in json.dumps(detail), detail
        # SOCKS5 inside TLS to the proxy, verified against the given CA.
        tls = {**proxy, "address": f"{SOCKS_ADDR}:1081",
               "tls": {"server_name": "socks.sec.test", "ca_cert": open(ca).read()}}
        sbx.update_network({"egress_proxy": tls})
        before = open(log).read().count("CONNECT")
        code, status, body = curl(sbx, url)
        assert (code, status) == (0, "200"), body
        assert open(log).read().count("CONNECT") == before + 1
        assert sbx.get_info().network["egress_proxy"]["tls"] == {"server_name": "socks.sec.test"}
        # A proxy certificate that does not verify: fails closed.
        sbx.update_network({"egress_proxy": {**tls, "tls": {"server_name": "wrong.sec.test",
                                                            "ca_cert": open(ca).read()}}})
        code, status, _ = curl(sbx, url)
        assert code != 0, status
        # Refused credentials: the connection fails, no direct fallback.
        sbx.update_network({"egress_proxy": {**proxy, "password": "wrong"}})
        code, status, _ = curl(sbx, url)
        assert code != 0, status
        # The proxy down: fails closed.
        sbx.update_network({"egress_proxy": proxy})
        assert curl(sbx, url)[:2] == (0, "200")
        proc.kill()
        proc.wait()
        code, status, _ = curl(sbx, url)
        assert code != 0, status
        # Without egressProxy (replace semantics) the sandbox goes direct again.
        sbx.update_network({})
        assert curl(sbx, url)[:2] == (0, "200")
        assert "egress_proxy" not in sbx.get_info().network
    finally:
        sbx.kill()


def test_rules_and_egress_proxy_survive_a_restart(srv, secnet):
    """Last in the module: the server restarts (kill -9) on a new port."""
    ca, ns, d = secnet
    log = os.path.join(d, "socks-restart.log")
    pw = "pw-" + "r" * 8
    ns.spawn(sys.executable, "-c", SOCKS, SOCKS_ADDR, "kiln", pw, log, "1082")
    import time
    deadline = time.time() + 20
    while sh("ip", "netns", "exec", NS, "python3", "-c",
             f"import socket; socket.create_connection(('{SOCKS_ADDR}', 1082), timeout=1)",
             check=False).returncode != 0:
        assert time.time() < deadline, "the SOCKS5 server did not come up"
        time.sleep(0.2)
    opts = srv.opts()
    value = f"sk-{uuid.uuid4().hex}"
    name = f"restart-{uuid.uuid4().hex[:8]}"
    Secret.create(name, value, **opts)
    rules = {"api.sec.test": [{"transform": {"headers": {"Authorization": "Bearer " + Secret.fill(name)}}}]}
    proxy = {"address": f"{SOCKS_ADDR}:1082", "username": "kiln", "password": pw}
    sbx = Sandbox.create(timeout=300, **opts, network={"rules": rules, "egress_proxy": proxy})
    # Paused across the restart: its rules come back when it resumes.
    held = Sandbox.create(timeout=300, **opts, network={"rules": rules})
    try:
        code, status, body = curl(sbx, "https://api.sec.test/before")
        assert (code, status) == (0, "200") and f"Bearer {value}" in body, body
        tunnels = open(log).read().count("CONNECT")
        assert tunnels >= 1
        assert f"Bearer {value}" in curl(held, "https://api.sec.test/held")[2]
        held.pause()

        srv.kill9()
        srv.start()  # on a new port; recovery adopts the sandbox, then its rules come back
        opts = srv.opts()
        sbx = Sandbox.connect(sbx.sandbox_id, **opts)
        deadline = time.time() + 30
        while True:
            code, status, body = curl(sbx, "https://api.sec.test/after")
            if (code, status) == (0, "200") and f"Bearer {value}" in body:
                break
            assert time.time() < deadline, (code, status, body, srv.log()[-3000:])
            time.sleep(0.5)
        assert open(log).read().count("CONNECT") > tunnels, "egress no longer goes through the proxy"
        info = sbx.get_info().network
        assert info["egress_proxy"] == {"address": f"{SOCKS_ADDR}:1082", "username": "kiln"}, info
        assert "api.sec.test" in info["rules"], info

        held = Sandbox.connect(held.sandbox_id, **opts)
        deadline = time.time() + 30
        while True:
            code, status, body = curl(held, "https://api.sec.test/resumed")
            if (code, status) == (0, "200") and f"Bearer {value}" in body:
                break
            assert time.time() < deadline, (code, status, body, srv.log()[-3000:])
            time.sleep(0.5)
        assert "api.sec.test" in held.get_info().network["rules"]
    finally:
        sbx.kill()
        held.kill()
    assert value not in srv.log() and pw not in srv.log()
