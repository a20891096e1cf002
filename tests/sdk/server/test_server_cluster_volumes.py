"""Volumes on a kiln cluster (docs/cluster.md, "Volumes"): a one-member etcd, two `kiln node`
processes and two `kiln control` replicas on 127.0.0.1. Through the pinned e2b SDK's `Volume`
and `Sandbox` against either replica: a volume made through one replica is listed, read and
written (its content API) through the other and its files live on one node only; sandboxes
mounting it run on that node, whichever replica they are made through, and see its files and
each other's writes; a delete while it is mounted is refused naming the sandbox, and after
the kill it goes from etcd and from its node; the team's volume cap holds across replicas; two
volumes of different nodes cannot be mounted together; a volume of a draining node cannot be
mounted, and one of a stopped node answers 503 until the node is back.
Needs KILN_BIN, the base template, runsc, root and etcd (Debian's etcd-server, or KILN_ETCD).
"""

import contextlib
import json
import os
import tempfile
import time
import urllib.error
import urllib.request
import uuid

import pytest
from e2b import Sandbox
from e2b.volume.volume_sync import Volume

from .test_server_cluster import Cluster, finish, kiln_node

CONTROL = ["--volume-mb", "64", "--team-max-volumes", "4"]


@pytest.fixture(scope="module")
def cluster():
    base = tempfile.mkdtemp(prefix="kiln-cluster-vol-")
    c = None
    saved = os.environ.get("E2B_VOLUME_API_URL")
    try:
        c = Cluster(base)
        c.start_node("n1")
        c.start_node("n2")
        c.start_control("c1", CONTROL)
        c.start_control("c2", CONTROL)
        yield c
    finally:
        if saved is None:
            os.environ.pop("E2B_VOLUME_API_URL", None)
        else:
            os.environ["E2B_VOLUME_API_URL"] = saved
        finish(c, base)


@contextlib.contextmanager
def content_through(cluster, control: str):
    """The SDK's volume-content calls sent to `control` (E2B_VOLUME_API_URL) meanwhile."""
    saved = os.environ.get("E2B_VOLUME_API_URL")
    os.environ["E2B_VOLUME_API_URL"] = cluster.controls[control].url
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("E2B_VOLUME_API_URL", None)
        else:
            os.environ["E2B_VOLUME_API_URL"] = saved


def call(cluster, control: str, method: str, path: str, body=None, token=None):
    """(status, parsed body) of a raw request to `control` (the API key, or a volume token)."""
    auth = {"Authorization": f"Bearer {token}"} if token else {"X-API-Key": cluster.api_key}
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(cluster.controls[control].url + path, method=method, data=data,
                                 headers={**auth, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, payload = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, payload = e.code, e.read()
    try:
        return status, json.loads(payload) if payload else None
    except ValueError:
        return status, payload


def keepers(cluster, volume_id: str) -> list:
    """The nodes whose state directory holds the volume's image."""
    return [name for name, n in cluster.nodes.items()
            if os.path.exists(os.path.join(n.state_dir, "gvisor", "volumes", f"{volume_id}.img"))]


def test_a_volume_is_the_clusters_and_its_sandboxes_run_where_it_lives(cluster):
    a, b = cluster.opts("c1"), cluster.opts("c2")
    name = f"data-{uuid.uuid4().hex[:6]}"
    vol = Volume.create(name, **a)
    home = keepers(cluster, vol.volume_id)
    assert len(home) == 1, home
    home = home[0]
    assert name in [v.name for v in Volume.list(**b)]
    assert Volume.get_info(name, **b).token == vol.token
    status, err = call(cluster, "c2", "POST", "/volumes", {"name": name})
    assert status == 409, err
    status, err = call(cluster, "c1", "POST", "/volumes", {"name": "bad name"})
    assert status == 400, err

    # Its content through either replica: written through one, read through the other.
    with content_through(cluster, "c2"):
        v = Volume.connect(vol.volume_id, **b)
        v.make_dir("/in", force=True)
        v.write_file("/in/hello.txt", "from the api", uid=1000, gid=1000)
    with content_through(cluster, "c1"):
        v = Volume.connect(vol.volume_id, **a)
        assert v.read_file("/in/hello.txt") == "from the api"
        assert [e.path for e in v.list("/", depth=2)] == ["/in", "/in/hello.txt"]
    status, _ = call(cluster, "c1", "GET", f"/volumecontent/{vol.volume_id}/path?path=/in",
                     token="wrong")
    assert status == 401
    status, err = call(cluster, "c2", "GET", f"/volumecontent/{vol.volume_id}/path?path=/a/../..",
                       token=vol.token)
    assert status == 400, err

    # Sandboxes mounting it run on its node, made through either replica.
    sbxs = []
    try:
        for i in range(3):
            opts = a if i % 2 == 0 else b
            s = Sandbox.create(timeout=120, volume_mounts={"/mnt/data": vol}, **opts)
            sbxs.append(s)
            assert cluster.node_of(s.sandbox_id) == home
        first, second = sbxs[0], sbxs[1]
        assert first.commands.run("cat /mnt/data/in/hello.txt").stdout == "from the api"
        first.commands.run("echo from a sandbox > /mnt/data/out.txt")
        assert second.commands.run("cat /mnt/data/out.txt").stdout == "from a sandbox\n"
        with content_through(cluster, "c2"):
            assert Volume.connect(vol.volume_id, **b).read_file("/out.txt") == "from a sandbox\n"
        info = Sandbox.get_info(first.sandbox_id, **b)
        assert [(m["name"], m["path"]) for m in info.volume_mounts] == [(name, "/mnt/data")], info
        # Refused while mounted, naming the sandbox.
        status, err = call(cluster, "c2", "DELETE", f"/volumes/{vol.volume_id}")
        assert status == 409 and first.sandbox_id in err["message"], err
    finally:
        for s in sbxs:
            s.kill()
    assert Volume.destroy(vol.volume_id, **b) is True
    assert Volume.destroy(vol.volume_id, **a) is False
    assert name not in [v.name for v in Volume.list(**a)]
    assert keepers(cluster, vol.volume_id) == []
    status, _ = call(cluster, "c1", "GET", f"/volumecontent/{vol.volume_id}/path?path=/",
                     token=vol.token)
    assert status == 401


def test_the_teams_cap_holds_across_replicas(cluster):
    made = []
    try:
        for i in range(4):
            status, v = call(cluster, "c1" if i % 2 else "c2", "POST", "/volumes",
                             {"name": f"cap-{i}-{uuid.uuid4().hex[:4]}"})
            assert status == 201, v
            made.append(v["volumeID"])
        status, err = call(cluster, "c1", "POST", "/volumes", {"name": "cap-over"})
        assert status == 429 and "cap" in err["message"], err
        status, _ = call(cluster, "c2", "DELETE", f"/volumes/{made.pop()}")
        assert status == 204
        status, v = call(cluster, "c1", "POST", "/volumes", {"name": "cap-again"})
        assert status == 201, v
        made.append(v["volumeID"])
    finally:
        for vid in made:
            call(cluster, "c1", "DELETE", f"/volumes/{vid}")


def volume_on(cluster, node: str, prefix: str) -> dict:
    """A new volume kept by `node` (the other node drained meanwhile)."""
    other = "n2" if node == "n1" else "n1"
    kiln_node(cluster, "drain", other)
    try:
        status, v = call(cluster, "c1", "POST", "/volumes", {"name": f"{prefix}-{uuid.uuid4().hex[:4]}"})
        assert status == 201, v
    finally:
        kiln_node(cluster, "undrain", other)
    assert keepers(cluster, v["volumeID"]) == [node]
    return v


def test_volumes_of_other_nodes_draining_or_away(cluster):
    v1 = volume_on(cluster, "n1", "one")
    v2 = volume_on(cluster, "n2", "two")
    try:
        # Two volumes of two nodes: no sandbox can mount both.
        status, err = call(cluster, "c1", "POST", "/sandboxes", {
            "templateID": "base", "volumeMounts": [{"name": v1["name"], "path": "/mnt/a"},
                                                   {"name": v2["name"], "path": "/mnt/b"}]})
        assert status == 409 and "different nodes" in err["message"], err
        # A draining node takes no sandbox, not even one mounting its volume.
        kiln_node(cluster, "drain", "n1")
        try:
            status, err = call(cluster, "c2", "POST", "/sandboxes", {
                "templateID": "base", "volumeMounts": [{"name": v1["name"], "path": "/mnt/a"}]})
            assert status == 409 and "draining" in err["message"], err
        finally:
            kiln_node(cluster, "undrain", "n1")
        # Its node stopped: the volume answers 503 naming it, and again once it is back.
        cluster.nodes["n2"].stop()
        status, err = call(cluster, "c1", "GET", f"/volumecontent/{v2['volumeID']}/path?path=/",
                           token=v2["token"])
        assert status == 503 and "n2" in err["message"], err
        status, err = call(cluster, "c2", "POST", "/sandboxes", {
            "templateID": "base", "volumeMounts": [{"name": v2["name"], "path": "/mnt/b"}]})
        assert status == 503 and "n2" in err["message"], err
        cluster.start_node("n2")
        deadline = time.time() + 30
        while True:
            status, st = call(cluster, "c1", "GET", f"/volumecontent/{v2['volumeID']}/path?path=/",
                              token=v2["token"])
            if status == 200:
                break
            assert time.time() < deadline, (status, st)
            time.sleep(0.3)
        assert st["type"] == "directory", st
    finally:
        for v in (v1, v2):
            call(cluster, "c1", "DELETE", f"/volumes/{v['volumeID']}")


def test_a_sandboxs_own_port_keeps_the_paths_a_replica_forwards(cluster):
    # A sandbox's web server may serve /volumecontent/… or /v2/templates: traffic to its port
    # (header mode) reaches it, not the replica's volume or Template API forwarding.
    s = Sandbox.create(timeout=120, **cluster.opts("c1"))
    try:
        s.commands.run("mkdir -p /tmp/www/volumecontent/x /tmp/www/v2 && "
                       "echo sandbox-volume > /tmp/www/volumecontent/x/path && "
                       "echo sandbox-templates > /tmp/www/v2/templates")
        s.commands.run("python3 -m http.server 8000 --directory /tmp/www >/dev/null 2>&1",
                       background=True)
        for path, want in (("/volumecontent/x/path", "sandbox-volume"),
                           ("/v2/templates", "sandbox-templates")):
            req = urllib.request.Request(cluster.controls["c2"].url + path, headers={
                "E2b-Sandbox-Id": s.sandbox_id, "E2b-Sandbox-Port": "8000"})
            body = None
            for _ in range(50):
                try:
                    with urllib.request.urlopen(req, timeout=10) as r:
                        body = r.read().decode().strip()
                        break
                except (urllib.error.URLError, ConnectionError):
                    time.sleep(0.2)
            assert body == want, (path, body)
    finally:
        s.kill()
