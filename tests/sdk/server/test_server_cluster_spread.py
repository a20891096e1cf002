"""Thirty sandboxes over three nodes, each node in a network namespace of its own (issue 28's
test bed): every node joined to the host by a veth pair of its own /30 on 172.30.78.0/24 (links
inside this machine), etcd serving clients on the host side of each pair, two control replicas
on 127.0.0.1 reaching the nodes over the links. Through the pinned e2b SDK: thirty creates,
alternating replicas, spread over all three nodes; each sandbox runs a command and has a file
written through one replica and read through the other; and on each node a sandbox's own port
(an HTTP server inside it) answers through the gateway, in header mode and by host name: the
ingress path from the replica over the link into the node's namespace and on into the
sandbox's. A sandbox made through one replica is known at once to the other (by id, listed,
through the gateway), though each learns of it from its own etcd watch. Nothing here leaves
this machine.

Needs KILN_BIN, the base template, runsc, etcd and root (network namespaces).
"""

import tempfile
import threading
import time
import urllib.error
import urllib.request

import pytest

from .conftest import kill_all
from .test_server_cluster import finish
from .test_server_cluster_linkcut import Link, LinkCluster

NODES = ("na", "nb", "nc")
SANDBOXES = 30


@pytest.fixture(scope="module")
def spread():
    base = tempfile.mkdtemp(prefix="kiln-cluster-spread-")
    links, c = [], None
    try:
        for i in range(len(NODES)):
            links.append(Link(f"172.30.78.{4 * i + 1}", f"172.30.78.{4 * i + 2}"))
        c = LinkCluster(base, extra_etcd_hosts=[l.host_ip for l in links])
        # The default lease (thirty sandboxes starting on two cores load the host; nothing
        # here is about losing a node).
        for link, name in zip(links, NODES):
            c.start_node_in(link, name, lease_ttl=5)
        c.start_control("c1")
        c.start_control("c2")
        assert c.api_key, "the first control replica of an empty cluster makes the first API key"
        yield c
    finally:
        finish(c, base, *[l.remove for l in links])


def fetch(url: str, headers: dict) -> str:
    """`url`'s body, retried while the server in the sandbox starts."""
    req = urllib.request.Request(url, headers=headers)
    last = None
    for _ in range(50):
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.read().decode()
        except (urllib.error.URLError, ConnectionError) as e:
            last = e
            time.sleep(0.2)
    raise AssertionError(f"{url} {headers}: {last}")


def test_thirty_sandboxes_spread_over_three_namespaced_nodes_and_answer_through_the_gateway(spread):
    from e2b import Sandbox

    c = spread
    sbxs, errors = [], []
    lock = threading.Lock()

    def make(i: int):
        try:
            s = Sandbox.create(timeout=180, **c.opts("c1" if i % 2 else "c2"))
            with lock:
                sbxs.append(s)
        except Exception as e:  # reported below, with the others
            errors.append(e)

    try:
        # Three creates at a time: thirty in a bounded time on two cores.
        for start in range(0, SANDBOXES, 3):
            workers = [threading.Thread(target=make, args=(i,)) for i in range(start, start + 3)]
            for w in workers:
                w.start()
            for w in workers:
                w.join(timeout=120)
        assert not errors, errors
        assert len(sbxs) == SANDBOXES
        homes = {s.sandbox_id: c.node_of(s.sandbox_id) for s in sbxs}
        per_node = {n: sum(1 for h in homes.values() if h == n) for n in NODES}
        assert None not in homes.values(), homes
        assert all(k >= 3 for k in per_node.values()), per_node
        status, listed = c.request("c2", "GET", "/sandboxes")
        assert status == 200 and {s.sandbox_id for s in sbxs} <= {x["sandboxID"] for x in listed}

        for s in sbxs:
            r = s.commands.run(f"echo hello from {s.sandbox_id}")
            assert r.exit_code == 0 and r.stdout.strip() == f"hello from {s.sandbox_id}", r
            s.files.write("/tmp/spread.txt", f"data of {s.sandbox_id}")
            other = Sandbox.connect(s.sandbox_id, **c.opts("c2"))
            assert other.files.read("/tmp/spread.txt") == f"data of {s.sandbox_id}"

        # One sandbox per node serves its own port, reached through either replica.
        for node in NODES:
            s = next(x for x in sbxs if homes[x.sandbox_id] == node)
            s.commands.run("python3 -m http.server 8000 --directory /tmp >/dev/null 2>&1",
                           background=True)
            body = fetch(c.controls["c1"].url + "/spread.txt",
                         {"E2b-Sandbox-Id": s.sandbox_id, "E2b-Sandbox-Port": "8000"})
            assert body == f"data of {s.sandbox_id}", (node, body)
            body = fetch(c.controls["c2"].url + "/spread.txt", {"Host": s.get_host(8000)})
            assert body == f"data of {s.sandbox_id}", (node, body)
    finally:
        kill_all(sbxs)


def status_of(url: str, headers: dict) -> int:
    """`url`'s status, asked once (no retry: a miss must show)."""
    req = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_a_sandbox_made_through_one_replica_is_at_once_known_to_the_other(spread):
    """The replicas learn of a sandbox from their etcd watch, which lags the call that changed
    it by a moment: a client whose next request goes to the other replica (a load balancer)
    still finds a sandbox just made, by id, in the list, and through the gateway, and no longer
    finds one just killed — each asked once."""
    from e2b import Sandbox

    c = spread
    made = []
    try:
        for i in range(8):
            here, there = ("c1", "c2") if i % 2 else ("c2", "c1")
            s = Sandbox.create(timeout=120, **c.opts(here))
            made.append(s)
            sid, url = s.sandbox_id, c.controls[there].url
            envd = {"E2B-Sandbox-Id": sid, "E2B-Sandbox-Port": "49983",
                    "X-Access-Token": s._envd_access_token}
            # Its envd through the other replica's gateway first, then its REST routes.
            assert status_of(url + "/health", envd) < 300, (i, there, sid)
            status, d = c.request(there, "GET", f"/sandboxes/{sid}")
            assert status == 200 and d["state"] == "running", (i, there, d)
            s2 = Sandbox.create(timeout=120, **c.opts(here))
            made.append(s2)
            status, listed = c.request(there, "GET", "/v2/sandboxes")
            assert status == 200 and s2.sandbox_id in {x["sandboxID"] for x in listed}, (i, there)
            other = Sandbox.connect(s2.sandbox_id, **c.opts(there))
            assert other.commands.run("echo seen").stdout.strip() == "seen"
            # Killed through one replica: at once gone from the other.
            assert Sandbox.kill(sid, **c.opts(here)) is True
            assert c.request(there, "GET", f"/sandboxes/{sid}")[0] == 404, (i, there, sid)
            status, listed = c.request(there, "GET", "/v2/sandboxes")
            assert status == 200 and sid not in {x["sandboxID"] for x in listed}, (i, there)
        # A replica started a moment ago (its watch may not be established yet).
        for name in ("c3", "c4"):
            fresh = c.start_control(name)
            try:
                s = Sandbox.create(timeout=120, **c.opts("c1"))
                made.append(s)
                other = Sandbox.connect(s.sandbox_id, **c.opts(name))
                assert other.commands.run("echo fresh").stdout.strip() == "fresh", name
            finally:
                fresh.stop()
                del c.controls[name]
    finally:
        kill_all(made)
