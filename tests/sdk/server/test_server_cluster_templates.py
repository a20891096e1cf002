"""Templates on a kiln cluster (docs/cluster.md, "Templates"): a one-member etcd, nodes n1 and
n2 where only n2 holds template `solo` (a second name for the base template's rootfs), replicas
c1 and c2; through the pinned e2b SDK and the REST API:

- `GET /templates` through either replica lists every template some node holds, `solo`
  included, with the same build; `GET /templates/{name}` describes one, counts the sandboxes
  every node started from it, and answers 404 for a name no node holds (400 for a bad name);
- a create of `solo` goes to n2 only, through either replica; while n2 is drained such a
  create is refused with a retry hint instead of landing on n1, which cannot run it;
- a create of a template no node holds is a 404 that says so, and starts nothing.

Needs KILN_BIN, the base template, runsc, and etcd (Debian's etcd-server, or KILN_ETCD).
"""

import json
import os
import tempfile
import time
import urllib.error
import urllib.request

import pytest

from .test_server_cluster import Cluster, finish, kiln_node


def base_rootfs() -> str:
    cache = os.environ.get("KILN_CACHE_DIR", "/var/lib/kiln/cache")
    return os.path.realpath(os.path.join(cache, "templates", "base", "current", "rootfs"))


@pytest.fixture(scope="module")
def cluster():
    base = tempfile.mkdtemp(prefix="kiln-cluster-tpl-")
    c = None
    try:
        c = Cluster(base)
        c.start_node("n1")
        c.start_node("n2", extra=["--template-dir", f"solo={base_rootfs()}"])
        c.start_control("c1")
        c.start_control("c2")
        yield c
    finally:
        finish(c, base)


def get(cluster, control: str, path: str):
    """GET `path` at replica `control`: (status, JSON answer)."""
    req = urllib.request.Request(cluster.controls[control].url + path,
                                 headers={"X-API-Key": cluster.api_key})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def listed(cluster, control: str) -> dict:
    status, body = get(cluster, control, "/templates")
    assert status == 200, body
    return {t["templateID"]: t for t in body}


def test_templates_are_listed_and_described_through_any_replica(cluster):
    assert os.path.isdir(base_rootfs()), "the base template is built"
    # The nodes report their templates every second: both replicas see n2's `solo`.
    deadline = time.time() + 10
    while not all("solo" in listed(cluster, c) for c in ("c1", "c2")) and time.time() < deadline:
        time.sleep(0.2)
    at_c1, at_c2 = listed(cluster, "c1"), listed(cluster, "c2")
    assert {"base", "solo"} <= set(at_c1), at_c1
    assert set(at_c1) == set(at_c2)
    for name in ("base", "solo"):
        assert at_c1[name]["buildID"] == at_c2[name]["buildID"] and at_c1[name]["buildID"]
        assert at_c1[name]["buildStatus"] == "ready" and at_c1[name]["memoryMB"] > 0
    status, one = get(cluster, "c2", "/templates/solo")
    assert status == 200 and one["templateID"] == "solo", one
    assert one["buildID"] == at_c1["solo"]["buildID"]
    status, body = get(cluster, "c1", "/templates/nosuch")
    assert status == 404 and "no node of the cluster" in body["message"], body
    status, body = get(cluster, "c1", "/templates/bad%20name")
    assert status == 400 and body["message"], body


def test_a_create_goes_only_to_a_node_holding_its_template(cluster):
    from e2b import Sandbox
    from e2b.exceptions import SandboxException

    made = []
    try:
        for c in ("c1", "c2", "c1", "c2"):
            s = Sandbox.create(template="solo", timeout=120, **cluster.opts(c))
            made.append(s)
            assert cluster.node_of(s.sandbox_id) == "n2"
            assert s.commands.run("echo solo").stdout.strip() == "solo"
        # Every node's starts of `solo` are counted, through the other replica.
        deadline = time.time() + 10
        while listed(cluster, "c2")["solo"]["spawnCount"] < 4 and time.time() < deadline:
            time.sleep(0.2)
        assert listed(cluster, "c2")["solo"]["spawnCount"] >= 4
        assert listed(cluster, "c2")["solo"]["lastSpawnedAt"]
        # A template no node holds: 404, and no sandbox anywhere.
        before = {s.sandbox_id for s in Sandbox.list(**cluster.opts("c1")).next_items()}
        with pytest.raises(SandboxException) as e:
            Sandbox.create(template="nosuch", timeout=60, **cluster.opts("c1"))
        assert str(e.value).startswith("404: ") and "no node of the cluster" in str(e.value)
        after = {s.sandbox_id for s in Sandbox.list(**cluster.opts("c1")).next_items()}
        assert after == before
    finally:
        for s in made:
            s.kill()


def test_a_create_waits_for_the_only_node_holding_its_template(cluster):
    from e2b import Sandbox

    assert "node n2 is now draining" in kiln_node(cluster, "drain", "n2")
    try:
        time.sleep(0.5)
        # n1 takes the base template as before; `solo` is refused, not sent to n1.
        s = Sandbox.create(timeout=60, **cluster.opts("c1"))
        try:
            assert cluster.node_of(s.sandbox_id) == "n1"
        finally:
            s.kill()
        req = urllib.request.Request(cluster.controls["c2"].url + "/sandboxes", method="POST",
                                     data=json.dumps({"templateID": "solo", "timeout": 60}).encode(),
                                     headers={"X-API-Key": cluster.api_key,
                                              "Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=60)
        assert e.value.code in (429, 503), e.value.code
        assert e.value.headers.get("Retry-After"), dict(e.value.headers)
        assert "no node of the cluster can take" in json.loads(e.value.read())["message"]
    finally:
        assert "takes new sandboxes" in kiln_node(cluster, "undrain", "n2")
    time.sleep(0.5)
    s = Sandbox.create(template="solo", timeout=60, **cluster.opts("c2"))
    try:
        assert cluster.node_of(s.sandbox_id) == "n2"
    finally:
        s.kill()
