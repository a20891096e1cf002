"""Secrets, `network.rules` and `egressProxy` on a kiln cluster (docs/cluster.md, "Secrets and
network rules"): a one-member etcd, two `kiln node` processes with sandbox networking (each its
own range, resolving through the test internet's DNS and trusting its CA) and two `kiln
control` replicas, beside the test internet of test_server_egress_rules.py (namespace `ktsec`,
198.51.100.0/24, its echo hosts and a SOCKS5 server). Through the pinned e2b SDK:

- a secret made through one replica is listed, read, updated and deleted through the other,
  and etcd never holds its value in clear;
- a sandbox created through either replica, on either node, gets the secret injected by its
  node's egress proxy; an update made through the other replica applies to the next request
  on both nodes; the rules read back through the other replica as placeholders; replaced by
  `update_network`; kept by a fork's child;
- an egress proxy given through a replica carries the sandbox's connections on its node, and
  its password never comes back;
- workload identity tokens (`iam.tokens`) minted by the nodes for sandboxes on either node
  verify against either replica's JWKS (one cluster key), with the cluster's issuer.
- creates from a snapshot of a sandbox with rules and a deny list inherit both, beside the
  snapshot and on the other node (its own drained);
- a paused sandbox with rules and an egress proxy resumed on the other node (its own
  drained) keeps both, and its trust store takes the other node's leaves: every node holds the
  cluster's one interception CA.
Nothing here sends traffic off this machine.
Needs KILN_BIN, the base template, runsc, root, etcd (Debian's etcd-server, or KILN_ETCD) and
moto (the nodes keep paused sandboxes' checkpoints in its bucket).
"""

import base64
import json
import os
import sys
import tempfile
import urllib.request
import uuid

import pytest
from e2b import Sandbox, Secret

from .internet import remove_slots_in_range, run
from .test_server_cluster import Cluster, finish, kiln_node
from .test_server_cluster_objects import ACCESS, Moto, environ, kill_quietly
from .test_server_egress_rules import DNS_ADDR, SOCKS, SOCKS_ADDR, secnet, wait_socks  # noqa: F401

RANGES = {"n1": "10.169.0.0/24", "n2": "10.169.1.0/24"}
# Where verifiers reach the cluster: every node and replica names it as the tokens' issuer.
ISSUER = ["--identity-issuer", "http://kiln-cluster.test"]
AUD = "https://sts.sec.test"


class NetCluster(Cluster):
    def start_node(self, name: str, extra=()) -> object:
        net = ["--net-range", RANGES[name], "--net-pool", "1", "--dns-upstream", DNS_ADDR]
        with environ(**ACCESS, KILN_S3_ENDPOINT=self.moto.url, KILN_S3_BUCKET="kiln-ckpt"):
            return super().start_node(name, [*net, *ISSUER, *extra])

    def start_control(self, name: str, extra=()) -> object:
        return super().start_control(name, [*ISSUER, *extra])


@pytest.fixture(scope="module")
def cluster(secnet):  # noqa: F811
    ca = secnet[0]
    base = tempfile.mkdtemp(prefix="kiln-cluster-sec-")
    saved = os.environ.get("KILN_EGRESS_TRUST")
    os.environ["KILN_EGRESS_TRUST"] = ca
    c, moto = None, None
    try:
        moto = Moto(base)
        c = NetCluster(base)
        c.moto = moto
        c.start_node("n1")
        c.start_node("n2")
        c.start_control("c1")
        c.start_control("c2")
        yield c
    finally:
        if saved is None:
            os.environ.pop("KILN_EGRESS_TRUST", None)
        else:
            os.environ["KILN_EGRESS_TRUST"] = saved
        finish(c, base, *[lambda r=r: remove_slots_in_range(r.rsplit(".", 1)[0] + ".")
                          for r in RANGES.values()], *([moto.stop] if moto else []))


def curl(sbx, args):
    """(exit code, HTTP status, body) of a curl in the sandbox."""
    code, out = run(sbx, f"curl -s -m 10 -w '\\n%{{http_code}}' {args}")
    body, _, status = out.rpartition("\n")
    return code, status.strip(), body


def etcd_values(c) -> str:
    """Every value under the cluster's prefix, decoded, through etcd's JSON gateway."""
    key = base64.b64encode(c.prefix.encode()).decode()
    end = base64.b64encode(c.prefix[:-1].encode() + bytes([ord(c.prefix[-1]) + 1])).decode()
    req = urllib.request.Request(c.etcd_url + "/v3/kv/range", method="POST",
                                 data=json.dumps({"key": key, "range_end": end}).encode())
    got = json.loads(urllib.request.urlopen(req, timeout=10).read())
    return "\n".join(base64.b64decode(kv.get("value", "")).decode("utf-8", "replace")
                     for kv in got.get("kvs", []))


def test_a_secret_made_at_one_replica_is_the_clusters(cluster):
    a, b = cluster.opts("c1"), cluster.opts("c2")
    tag = uuid.uuid4().hex[:8]
    value = f"sk-{uuid.uuid4().hex}"
    made = Secret.create(f"Svc-{tag}", value, metadata={"owner": "test"}, **a)
    assert made.name == f"svc-{tag}"
    listed = {s.name: s for s in Secret.list(limit=1000, **b).next_items()}
    assert f"svc-{tag}" in listed and listed[f"svc-{tag}"].metadata == {"owner": "test"}
    # A name is the team's once, whichever replica is asked.
    with pytest.raises(Exception) as e:
        Secret.create(f"svc-{tag}", "other", **b)
    assert "409" in str(e.value) or "exists" in str(e.value), e.value
    status, one = cluster.request("c2", "GET", f"/secrets/{made.secret_id}")
    assert status == 200 and one["name"] == f"svc-{tag}" and value not in json.dumps(one), one
    Secret.update(f"svc-{tag}", value + "-2", **b)
    status, one = cluster.request("c1", "GET", f"/secrets/svc-{tag}")
    assert status == 200 and one["currentVersion"] == 2, one
    stored = etcd_values(cluster)
    assert f"svc-{tag}" in stored, "the record is in etcd"
    assert value not in stored and base64.b64encode(value.encode()).decode() not in stored
    Secret.destroy(made.secret_id, **b)
    status, _ = cluster.request("c1", "GET", f"/secrets/svc-{tag}")
    assert status == 404
    for p in cluster.procs:
        assert value not in p.log(), p.name


def sandboxes_on_both_nodes(cluster, rules):
    """Sandboxes made through alternating replicas until each node runs one: {node: sandbox}."""
    on, made = {}, []
    try:
        for i in range(12):
            sbx = Sandbox.create(timeout=300, network={"rules": rules},
                                 **cluster.opts("c1" if i % 2 == 0 else "c2"))
            node = cluster.node_of(sbx.sandbox_id)
            if node in on:
                made.append(sbx)
            else:
                on[node] = sbx
            if len(on) == 2:
                return on
        pytest.fail(f"twelve creates did not reach both nodes: {sorted(on)}")
    finally:
        for s in made:
            s.kill()


def test_rules_inject_a_secret_on_either_node_and_follow_updates(cluster, secnet):  # noqa: F811
    ca = secnet[0]
    a, b = cluster.opts("c1"), cluster.opts("c2")
    tag = uuid.uuid4().hex[:8]
    value = f"sk-{uuid.uuid4().hex}"
    name = f"svc-{tag}"
    Secret.create(name, value, **a)
    rules = {"api.sec.test": [{"transform": {"headers": {
        "Authorization": "Bearer " + Secret.fill(name)}}}]}
    # An unknown secret fails the create at the replica, naming it.
    with pytest.raises(Exception) as e:
        Sandbox.create(timeout=60, **b, network={"rules": {
            "api.sec.test": [{"transform": {"headers": {"A": Secret.fill(f"nope-{tag}")}}}]}})
    assert f"nope-{tag}" in str(e.value) and "400" in str(e.value), e.value

    on = sandboxes_on_both_nodes(cluster, rules)
    try:
        for node, sbx in on.items():
            code, status, body = curl(sbx, "-H 'Authorization: mine' https://api.sec.test/a")
            assert (code, status) == (0, "200"), (node, body)
            assert json.loads(body)["headers"]["authorization"] == f"Bearer {value}", (node, body)
            env = run(sbx, "env")[1]
            assert "SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt" in env, (node, env)
            # Read back through the other replica: the placeholders, never the value.
            info = Sandbox.get_info(sbx.sandbox_id, **b)
            header = info.network["rules"]["api.sec.test"][0]["transform"]["headers"]
            assert header["authorization"] == "Bearer " + Secret.fill(name), info.network
            status, detail = cluster.request("c2", "GET", f"/sandboxes/{sbx.sandbox_id}")
            assert status == 200 and value not in json.dumps(detail)

        # An update through the other replica: the next request on each node carries it.
        Secret.update(name, value + "-v2", **b)
        for node, sbx in on.items():
            code, status, body = curl(sbx, "https://api.sec.test/b")
            assert f"Bearer {value}-v2" in body, (node, body)

        # Replaced through a replica: no rules, the host's own TLS (pinned to its CA) again.
        sbx = on["n1"]
        sbx.files.write("/tmp/testca.pem", open(ca).read())
        Sandbox.connect(sbx.sandbox_id, **b).update_network({})
        code, status, body = curl(sbx, "--cacert /tmp/testca.pem https://api.sec.test/c")
        assert (code, status) == (0, "200") and "authorization" not in json.loads(body)["headers"]
        assert "rules" not in (Sandbox.get_info(sbx.sandbox_id, **a).network or {})
        sbx.update_network({"rules": rules})
        code, status, body = curl(sbx, "https://api.sec.test/d")
        assert f"Bearer {value}-v2" in body, body

        # A fork through the other replica: its child, beside its parent, keeps the rules.
        req = urllib.request.Request(
            cluster.controls["c2"].url + f"/sandboxes/{sbx.sandbox_id}/fork", method="POST",
            data=json.dumps({"count": 1}).encode(),
            headers={"X-API-Key": cluster.api_key, "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            child_id = json.loads(r.read())[0]["sandbox"]["sandboxID"]
        child = Sandbox.connect(child_id, **a)
        try:
            code, status, body = curl(child, "https://api.sec.test/fork")
            assert f"Bearer {value}-v2" in body, body
        finally:
            child.kill()
    finally:
        for s in on.values():
            s.kill()
    for p in cluster.procs:
        assert value not in p.log(), p.name


def test_an_egress_proxy_given_through_a_replica_carries_the_sandboxs_traffic(cluster, secnet):  # noqa: F811
    ca, ns, d = secnet
    log = os.path.join(d, "socks-cluster.log")
    password = "pw-" + uuid.uuid4().hex[:10]
    proc = ns.spawn(sys.executable, "-c", SOCKS, SOCKS_ADDR, "kiln", password, log, "1082")
    wait_socks(1082)
    proxy = {"address": f"{SOCKS_ADDR}:1082", "username": "kiln", "password": password}
    sbx = Sandbox.create(timeout=120, network={"egress_proxy": proxy}, **cluster.opts("c2"))
    try:
        sbx.files.write("/tmp/testca.pem", open(ca).read())
        url = "--cacert /tmp/testca.pem https://other.sec.test/through"
        code, status, body = curl(sbx, url)
        assert (code, status) == (0, "200"), body
        assert "CONNECT 198.51.100.21:443" in open(log).read()
        shown = Sandbox.get_info(sbx.sandbox_id, **cluster.opts("c1")).network["egress_proxy"]
        assert shown == {"address": f"{SOCKS_ADDR}:1082", "username": "kiln"}, shown
        status, detail = cluster.request("c1", "GET", f"/sandboxes/{sbx.sandbox_id}")
        assert status == 200 and password not in json.dumps(detail)
        # Fails closed when the proxy is down; direct again once it is removed.
        proc.kill()
        proc.wait()
        assert curl(sbx, url)[0] != 0
        Sandbox.connect(sbx.sandbox_id, **cluster.opts("c1")).update_network({})
        assert curl(sbx, url)[:2] == (0, "200")
        assert "egress_proxy" not in (sbx.get_info().network or {})
    finally:
        sbx.kill()
    for p in cluster.procs:
        assert password not in p.log(), p.name


def test_a_paused_sandbox_resumed_on_the_other_node_keeps_its_rules_and_egress_proxy(cluster, secnet):  # noqa: F811
    # Its rules, egress proxy (password included) and trust move with its checkpoint: the
    # other node injects the secret through the same proxy, and the sandbox's trust store,
    # made on the first node, takes the leaves of the second (one interception CA).
    ca, ns, d = secnet
    certs = {n: open(os.path.join(p.state_dir, "egress-ca.pem")).read() for n, p in cluster.nodes.items()}
    assert len(set(certs.values())) == 1, "every node holds the cluster's interception CA"
    tag = uuid.uuid4().hex[:8]
    value = f"sk-{uuid.uuid4().hex}"
    name = f"mv-{tag}"
    Secret.create(name, value, **cluster.opts("c1"))
    log = os.path.join(d, "socks-moved.log")
    password = "pw-" + uuid.uuid4().hex[:10]
    proc = ns.spawn(sys.executable, "-c", SOCKS, SOCKS_ADDR, "kiln", password, log, "1083")
    wait_socks(1083)
    network = {"rules": {"api.sec.test": [{"transform": {"headers": {
                   "Authorization": "Bearer " + Secret.fill(name)}}}]},
               "egress_proxy": {"address": f"{SOCKS_ADDR}:1083", "username": "kiln", "password": password}}
    sbx = Sandbox.create(timeout=300, network=network, **cluster.opts("c1"))
    sid, home = sbx.sandbox_id, cluster.node_of(sbx.sandbox_id)
    other = "n2" if home == "n1" else "n1"
    try:
        code, status, body = curl(sbx, "https://api.sec.test/before")
        assert (code, status) == (0, "200"), body
        assert json.loads(body)["headers"]["authorization"] == f"Bearer {value}", body
        through = open(log).read().count("CONNECT ")
        assert through >= 1, "the first request went through the egress proxy"
        assert Sandbox.pause(sid, **cluster.opts("c1")) is True
        kiln_node(cluster, "drain", home)
        try:
            again = Sandbox.connect(sid, timeout=300, **cluster.opts("c2"))
            assert cluster.node_of(sid) == other, "the resume landed off the draining node"
            code, status, body = curl(again, "https://api.sec.test/after")
            assert (code, status) == (0, "200"), body
            assert json.loads(body)["headers"]["authorization"] == f"Bearer {value}", body
            assert open(log).read().count("CONNECT ") > through, "the proxy moved with it"
            info = Sandbox.get_info(sid, **cluster.opts("c1")).network
            assert info["egress_proxy"] == {"address": f"{SOCKS_ADDR}:1083", "username": "kiln"}, info
            header = info["rules"]["api.sec.test"][0]["transform"]["headers"]
            assert header["authorization"] == "Bearer " + Secret.fill(name), info
            # Fails closed on its new node when the proxy is down: the interceptor answers 502
            # saying why, and nothing goes direct.
            proc.kill()
            proc.wait()
            code, status, body = curl(again, "https://api.sec.test/down")
            assert (code, status) == (0, "502") and "kiln egress" in body, (code, status, body)
        finally:
            kiln_node(cluster, "undrain", home)
    finally:
        if proc.poll() is None:
            proc.kill()
        kill_quietly(cluster, sid, "c1")
    for p in cluster.procs:
        assert value not in p.log() and password not in p.log(), p.name
    assert password not in etcd_values(cluster) and value not in etcd_values(cluster)


def test_creates_from_a_snapshot_inherit_its_sources_network_on_either_node(cluster, secnet):  # noqa: F811
    # A snapshot records its source's settings (lists, rules) where it is taken; a create from
    # it naming no network of its own, through either replica, gets them: beside the snapshot
    # on its node, and on the other node (the snapshot's node draining, its files borrowed).
    tag = uuid.uuid4().hex[:8]
    value = f"sk-{uuid.uuid4().hex}"
    name = f"snap-{tag}"
    Secret.create(name, value, **cluster.opts("c2"))
    network = {"rules": {"api.sec.test": [{"transform": {"headers": {
                   "Authorization": "Bearer " + Secret.fill(name)}}}]},
               "deny_out": ["198.51.100.21"]}
    src = Sandbox.create(timeout=300, network=network, **cluster.opts("c1"))
    home = cluster.node_of(src.sandbox_id)
    made, snap = [], None
    try:
        snap = src.create_snapshot()
        children = {}
        for control in ("c2", "c1"):
            if children:
                kiln_node(cluster, "drain", home)
            child = Sandbox.create(template=snap.snapshot_id, timeout=120, **cluster.opts(control))
            made.append(child)
            children[cluster.node_of(child.sandbox_id)] = child
        assert set(children) == {"n1", "n2"}, f"the children ran on {sorted(children)}"
        for node, child in children.items():
            code, status, body = curl(child, "https://api.sec.test/from-snapshot")
            assert (code, status) == (0, "200"), (node, body)
            assert json.loads(body)["headers"]["authorization"] == f"Bearer {value}", (node, body)
            assert curl(child, "https://other.sec.test/")[0] != 0, f"{node}: denyOut went with it"
            info = Sandbox.get_info(child.sandbox_id, **cluster.opts("c2")).network
            assert info["deny_out"] == ["198.51.100.21"], (node, info)
            header = info["rules"]["api.sec.test"][0]["transform"]["headers"]
            assert header["authorization"] == "Bearer " + Secret.fill(name), (node, info)
    finally:
        kiln_node(cluster, "undrain", home)
        for s in made:
            kill_quietly(cluster, s.sandbox_id, "c1")
        kill_quietly(cluster, src.sandbox_id, "c1")
        if snap is not None:
            Sandbox.delete_snapshot(snap.snapshot_id, **cluster.opts("c1"))
    assert value not in etcd_values(cluster)


def test_identity_tokens_of_either_node_verify_against_either_replicas_jwks(cluster):
    import jwt

    keys = {}
    for c in ("c1", "c2"):
        with urllib.request.urlopen(cluster.controls[c].url + "/.well-known/jwks.json",
                                    timeout=10) as r:
            keys[c] = json.loads(r.read())
        status, disc = cluster.request(c, "GET", "/.well-known/openid-configuration")
        assert status == 200 and disc["issuer"] == "http://kiln-cluster.test", disc
    assert keys["c1"] == keys["c2"] and len(keys["c1"]["keys"]) == 1, keys
    rules = {"api.sec.test": [{"transform": lambda ctx: {"headers": {
        "Authorization": f"Bearer {ctx.iam.tokens['svc']}"}}}]}
    iam = {"tokens": {"svc": Secret.iam_token(audience=AUD, token_type="JWT-SVID")}}
    on = {}
    try:
        for i in range(12):
            s = Sandbox.create(timeout=120, iam=iam, network={"rules": rules},
                               **cluster.opts("c1" if i % 2 else "c2"))
            node = cluster.node_of(s.sandbox_id)
            if node in on:
                s.kill()
            else:
                on[node] = s
            if len(on) == 2:
                break
        assert len(on) == 2, sorted(on)
        for node, s in on.items():
            code, status, body = curl(s, "https://api.sec.test/token")
            assert (code, status) == (0, "200"), (node, body)
            token = json.loads(body)["headers"]["authorization"][len("Bearer "):]
            header = jwt.get_unverified_header(token)
            for c in ("c1", "c2"):
                key = next(k for k in keys[c]["keys"] if k["kid"] == header["kid"])
                claims = jwt.decode(token, jwt.PyJWK(key).key, algorithms=["ES256"],
                                    audience=AUD, issuer="http://kiln-cluster.test")
                assert claims["sub"].endswith(f"/sandbox/{s.sandbox_id}"), (node, claims)
        # The rules replaced through the other replica (an update carries no iam: the
        # sandbox keeps the tokens it was created with, checked by its node).
        s = on["n1"]
        Sandbox.connect(s.sandbox_id, **cluster.opts("c1")).update_network({"rules": rules})
        code, status, body = curl(s, "https://api.sec.test/again")
        token = json.loads(body)["headers"]["authorization"][len("Bearer "):]
        key = next(k for k in keys["c2"]["keys"] if k["kid"] == jwt.get_unverified_header(token)["kid"])
        jwt.decode(token, jwt.PyJWK(key).key, algorithms=["ES256"], audience=AUD,
                   issuer="http://kiln-cluster.test")
        bad = {"api.sec.test": [{"transform": {"headers": {
            "A": "${e2b.identity.tokens.nope}"}}}]}
        with pytest.raises(Exception) as e:
            Sandbox.connect(s.sandbox_id, **cluster.opts("c2")).update_network({"rules": bad})
        assert "nope" in str(e.value), e.value
    finally:
        for s in on.values():
            s.kill()
