"""Trust and egress policy that reach every sandbox, through the pinned `e2b` SDK against a
networked `kiln serve` and a test internet of our own (namespace `kttrust`, 198.51.100.232/29,
its own DNS). The server's `--host-ca-dir` is a temporary directory with two CAs: the test
hosts' certificates are signed by the second one, which exists nowhere else (never the host's
real /usr/local/share/ca-certificates). The server trusts that CA upstream too
(KILN_EGRESS_TRUST), for its rule host.

- A Template API build's RUN step verifies TLS to the test host (curl, Python).
- Node trusts every extra CA through its one `NODE_EXTRA_CA_CERTS` file: the host's second
  CA, and kiln's interception CA for a rule given at create and for one added later by
  `update_network`.
- Forks and creates from a snapshot keep their source's egress policy: a child of a sandbox
  without internet access reaches nothing, a child of a sandbox with a rule still gets its
  header injected, while a create from the snapshot with its own network settings gets those.
Nothing here sends traffic off this machine."""

import json
import os
import shutil
import sys
import tempfile
import time
import uuid

import pytest
from e2b import Sandbox, Secret

from .conftest import own_server
from .internet import remove_slots_in_range, require_root, run, wait_command
from .test_server_egress_rules import ECHO
from .testnet import NetNs, sh

RANGE = "10.183.0.0/24"
NS, HOST_SIDE, HTTPS_ADDR, API_ADDR, DNS_ADDR = (
    "kttrust", "198.51.100.233", "198.51.100.234", "198.51.100.235", "198.51.100.236")
HOSTS = {"tls.trust.test": HTTPS_ADDR, "api.trust.test": API_ADDR}

# `--use-bundled-ca`: Node's own roots plus NODE_EXTRA_CA_CERTS, as official Node builds (nvm,
# nodesource, the node images) trust; Debian's node reads the system bundle by default.
NODE_GET = ("node --use-bundled-ca -e \"require('https').get(process.argv[1], {headers: {'x-asked': 'node'}}, "
            "r => {let b=''; r.on('data', d => b += d); r.on('end', () => console.log(r.statusCode, b))})"
            ".on('error', e => {console.log('ERR', e.code || e.message); process.exit(3)})\" ")


def openssl(*args):
    sh("openssl", *args)


def make_ca(d, name, cn):
    key, cert = os.path.join(d, f"{name}.key"), os.path.join(d, f"{name}.crt")
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-keyout", key, "-out", cert, "-days", "2", "-subj", f"/CN={cn}",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    return key, cert


@pytest.fixture(scope="module")
def net():
    """The test internet and the host-CA directory: `a-first.crt` (a CA that signs nothing
    here) and `b-proxy.crt` (the CA of the test hosts)."""
    require_root()
    d = tempfile.mkdtemp(prefix="kiln-trustnet-")
    cas = os.path.join(d, "ca-certificates")
    os.makedirs(cas)
    ns = NetNs(NS, "kttrust0", f"{HOST_SIDE}/29",
               [f"{a}/29" for a in (HTTPS_ADDR, API_ADDR, DNS_ADDR)], HOST_SIDE)
    try:
        make_ca(cas, "a-first", "kiln trust test CA one")
        ca_key, ca = make_ca(cas, "b-proxy", "kiln trust test CA two")
        shutil.move(ca_key, os.path.join(d, "b-proxy.key"))
        ca_key = os.path.join(d, "b-proxy.key")
        os.remove(os.path.join(cas, "a-first.key"))
        ns.up()
        ns.dns(DNS_ADDR, HOSTS)
        for name, ip in HOSTS.items():
            key, csr, cert, ext = (os.path.join(d, f"{name}.{x}") for x in ("key", "csr", "pem", "ext"))
            with open(ext, "w") as f:
                f.write(f"subjectAltName=DNS:{name}\nbasicConstraints=CA:FALSE\n"
                        "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n"
                        "authorityKeyIdentifier=keyid\n")
            openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
                    "-nodes", "-keyout", key, "-out", csr, "-subj", f"/CN={name}")
            openssl("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
                    "-out", cert, "-days", "2", "-extfile", ext)
            ns.spawn(sys.executable, "-c", ECHO, ip, cert, key)
        for name, ip in HOSTS.items():
            args = ["curl", "-s", "-m", "2", "--cacert", ca, "--resolve", f"{name}:443:{ip}",
                    f"https://{name}/up"]
            wait_command(args, f"the test host {name}")
        yield {"dir": cas, "ca": ca}
    finally:
        ns.down()
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def srv(net):
    with own_server("kiln-trustnet-",
                    ["--net-range", RANGE, "--net-pool", "2", "--dns-upstream", DNS_ADDR,
                     "--host-ca-dir", net["dir"]],
                    env={"KILN_EGRESS_TRUST": net["ca"]},
                    after=lambda: remove_slots_in_range(RANGE.rsplit(".", 1)[0] + ".")) as s:
        yield s


def echo(out):
    """The echo service's answer (path and headers) in a command's output."""
    return json.loads(out[out.index("{"):])


def test_a_build_step_trusts_the_hosts_cas(srv):
    from e2b import Template

    name = f"trust-{uuid.uuid4().hex[:8]}"
    tpl = (Template().from_template("base")
           .run_cmd("curl -sS --fail -m 10 https://tls.trust.test/build > /home/user/curl.json")
           .run_cmd("python3 -c \"import urllib.request as u; "
                    "print(u.urlopen('https://tls.trust.test/py', timeout=10).read().decode())\" "
                    "> /home/user/py.json && echo \"$PIP_CERT\" > /home/user/pip_cert"))
    logs = []
    Template.build(tpl, name, on_build_logs=logs.append, api_key=srv.api_key, api_url=srv.url)
    sbx = Sandbox.create(name, timeout=120, **srv.opts())
    try:
        assert echo(sbx.files.read("/home/user/curl.json"))["path"] == "/build"
        assert echo(sbx.files.read("/home/user/py.json"))["path"] == "/py"
        assert sbx.files.read("/home/user/pip_cert").strip() == "/etc/ssl/certs/ca-certificates.crt"
    finally:
        sbx.kill()


def test_node_trusts_every_extra_ca(srv, net):
    opts = srv.opts()
    tag = uuid.uuid4().hex[:8]
    value = f"sk-{uuid.uuid4().hex}"
    Secret.create(f"node-{tag}", value, **opts)
    rule = {"api.trust.test": [{"transform": {"headers": {
        "Authorization": "Bearer " + Secret.fill(f"node-{tag}")}}}]}
    # A rule at create: the host's second CA and kiln's CA, both in Node's one file.
    sbx = Sandbox.create("code-interpreter-v1", timeout=120, **opts, network={"rules": rule})
    try:
        code, out = run(sbx, NODE_GET + "https://tls.trust.test/node")
        assert code == 0 and out.startswith("200") and echo(out)["path"] == "/node", out
        code, out = run(sbx, NODE_GET + "https://api.trust.test/node")
        assert code == 0 and echo(out)["headers"]["authorization"] == f"Bearer {value}", out
        env = run(sbx, "env")[1]
        assert "NODE_EXTRA_CA_CERTS=/usr/local/share/ca-certificates/kiln-extra-cas.crt" in env, env
        extra = sbx.files.read("/usr/local/share/ca-certificates/kiln-extra-cas.crt")
        assert extra.count("BEGIN CERTIFICATE") == 3, extra
    finally:
        sbx.kill()
    # No rule at create, one added later: a Node started afterwards trusts kiln's CA.
    sbx = Sandbox.create("code-interpreter-v1", timeout=120, **opts)
    try:
        code, out = run(sbx, NODE_GET + "https://api.trust.test/before")
        assert code == 0 and "authorization" not in echo(out)["headers"], out
        sbx.update_network({"rules": rule})
        code, out = run(sbx, NODE_GET + "https://api.trust.test/after")
        assert code == 0 and echo(out)["headers"]["authorization"] == f"Bearer {value}", out
    finally:
        sbx.kill()


def reaches(sbx, url="https://tls.trust.test/child"):
    code, out = run(sbx, f"curl -s -m 5 {url}")
    return code == 0 and "{" in out


def test_forks_and_snapshot_creates_keep_the_egress_policy(srv):
    opts = srv.opts()
    tag = uuid.uuid4().hex[:8]
    value = f"sk-{uuid.uuid4().hex}"
    Secret.create(f"fork-{tag}", value, **opts)
    made = []
    try:
        # Without internet access: neither a fork nor a create from its snapshot reaches out.
        closed = Sandbox.create(timeout=180, **opts, allow_internet_access=False)
        made.append(closed)
        assert not reaches(closed)
        child = closed.fork(timeout=120)[0]
        made.append(child)
        assert not reaches(child), "a fork escaped its parent's egress policy"
        assert child.get_info().allow_internet_access is False
        snap = closed.create_snapshot()
        restored = Sandbox.create(snap.snapshot_id, timeout=120, **opts)
        made.append(restored)
        assert not reaches(restored), "a create from a snapshot escaped its source's policy"
        # A create from the snapshot naming its own settings gets those.
        opened = Sandbox.create(snap.snapshot_id, timeout=120, **opts, allow_internet_access=True)
        made.append(opened)
        assert reaches(opened)

        # A deny list carries over too.
        listed = Sandbox.create(timeout=180, **opts, network={"deny_out": [f"{HTTPS_ADDR}/32"]})
        made.append(listed)
        assert not reaches(listed) and reaches(listed, "https://api.trust.test/other")
        child = listed.fork(timeout=120)[0]
        made.append(child)
        assert not reaches(child) and reaches(child, "https://api.trust.test/other")

        # A rule: the fork's and the snapshot's children still get the header injected.
        ruled = Sandbox.create(timeout=180, **opts, network={"rules": {"api.trust.test": [
            {"transform": {"headers": {"Authorization": "Bearer " + Secret.fill(f"fork-{tag}")}}}]}})
        made.append(ruled)
        child = ruled.fork(timeout=120)[0]
        made.append(child)
        snap = ruled.create_snapshot()
        restored = Sandbox.create(snap.snapshot_id, timeout=120, **opts)
        made.append(restored)
        for s in (ruled, child, restored):
            code, out = run(s, "curl -s -m 10 -H 'Authorization: mine' https://api.trust.test/r")
            assert code == 0 and echo(out)["headers"]["authorization"] == f"Bearer {value}", out
        status, info, _ = srv.request("GET", f"/sandboxes/{child.sandbox_id}")
        assert status == 200 and "api.trust.test" in info["network"]["rules"], info
    finally:
        for s in made:
            try:
                s.kill()
            except Exception:
                pass
