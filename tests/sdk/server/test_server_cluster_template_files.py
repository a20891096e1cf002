"""Templates through object storage (docs/cluster.md, "Templates"): a one-member etcd, a moto
S3 server, nodes n1 and n2 with the bucket, replicas c1 and c2. n2 holds template `tiny` (a
small rootfs made here: the agent, bash and a few tools, and a marker file); n1 has a template
store of its own that holds only the base template. Through the pinned e2b SDK:

- while n2, the only node holding `tiny`, is drained, a create of `tiny` through a replica
  runs on n1: n2 stores the template in the bucket, n1 fetches it into its own store and starts
  the sandbox, which has the template's files and user; a second create finds it there;
- from then on both replicas list `tiny` once, and n1 reports it as its own;
- a template no node holds is still a 404 naming the cluster;
- a paused sandbox of a template only n2 holds (`tiny2`) resumes on n1 while n2 is drained, and
  a fork's child of a sandbox of `tiny3` on the drained n2 runs on n1: n1 fetches each template
  as the sandbox moves or the child borrows its parent's capture;
- once n2 stored `tiny4` in the bucket and stopped, no live node holds it, yet both replicas
  list and describe it and a create of it runs on n1, which fetches it (last: n2 stays down).

Needs KILN_BIN, the base template, runsc, etcd (Debian's etcd-server, or KILN_ETCD) and moto.
"""

import base64
import glob
import json
import os
import re
import secrets
import shutil
import subprocess
import tempfile
import time
import urllib.request

import pytest

from .conftest import kill_all
from .test_server_cluster import etcd_json, finish, kiln_node
from .test_server_cluster_objects import Moto, ObjectCluster, environ
from .test_server_cluster_templates import base_rootfs, listed

TOOLS = ["bash", "sh", "cat", "echo", "ls", "id", "sleep", "mkdir", "env", "head"]


def copy_with_libs(root: str, path: str):
    """`path` (a host file) and the shared libraries ldd names, at the same places under `root`."""
    wanted = {path}
    out = subprocess.run(["ldd", path], capture_output=True, text=True).stdout
    for line in out.splitlines():
        part = line.split("=>")[-1].split()
        if part and part[0].startswith("/"):
            wanted.update({part[0], os.path.realpath(part[0])})
    for p in wanted:
        dest = os.path.join(root, p.lstrip("/"))
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        if not os.path.exists(dest):
            shutil.copy2(p, dest)


def tiny_rootfs(root: str, marker: str):
    """A minimal template rootfs: kiln-agent from the base template, host tools, users."""
    for d in ["proc", "dev", "sys", "tmp", "run", "root", "etc", "home/user", "usr/bin"]:
        os.makedirs(os.path.join(root, d), exist_ok=True)
    os.symlink("usr/bin", os.path.join(root, "bin"))
    shutil.copy2(os.path.join(base_rootfs(), "usr/bin/kiln-agent"), os.path.join(root, "usr/bin"))
    for tool in TOOLS:
        found = shutil.which(tool)
        if found:
            copy_with_libs(root, os.path.realpath(found))
            dest = os.path.join(root, "usr/bin", tool)
            if not os.path.exists(dest):
                shutil.copy2(os.path.realpath(found), dest)
    with open(os.path.join(root, "etc/passwd"), "w") as f:
        f.write("root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000:user:/home/user:/bin/bash\n")
    with open(os.path.join(root, "etc/group"), "w") as f:
        f.write("root:x:0:\nuser:x:1000:\n")
    with open(os.path.join(root, "etc/tiny-marker"), "w") as f:
        f.write(marker)
    os.chown(os.path.join(root, "home/user"), 1000, 1000)
    os.chmod(os.path.join(root, "tmp"), 0o1777)


def runsc_path() -> str:
    if os.environ.get("KILN_RUNSC"):
        return os.environ["KILN_RUNSC"]
    cache = os.environ.get("KILN_CACHE_DIR", "/var/lib/kiln/cache")
    found = sorted(glob.glob(os.path.join(cache, "runsc", "*", "runsc")))
    assert found, "kiln's runsc is installed"
    return found[-1]


class TemplateCluster(ObjectCluster):
    def start_node_with_cache(self, name: str, cache: str):
        """Node `name` with its own cache (its own template store) at `cache`."""
        with environ(KILN_CACHE_DIR=cache, KILN_RUNSC=runsc_path()):
            return self.start_node(name)


@pytest.fixture(scope="module")
def cluster():
    base = tempfile.mkdtemp(prefix="kiln-cluster-tplobj-")
    c, moto = None, None
    try:
        marker = secrets.token_hex(8)
        tiny = os.path.join(base, "tiny-rootfs")
        tiny_rootfs(tiny, marker)
        n1_cache = os.path.join(base, "n1-cache")
        os.makedirs(os.path.join(n1_cache, "templates"))
        # n1's store holds the base template (its versions are the host's).
        os.symlink(os.path.dirname(os.path.dirname(base_rootfs())),
                   os.path.join(n1_cache, "templates", "base"))
        moto = Moto(base)
        c = TemplateCluster(base)
        c.moto, c.marker, c.n1_cache = moto, marker, n1_cache
        c.start_node_with_cache("n1", n1_cache)
        c.start_node("n2", extra=[f"--template-dir={t}={tiny}"
                                  for t in ("tiny", "tiny2", "tiny3", "tiny4")])
        c.start_control("c1")
        c.start_control("c2")
        yield c
    finally:
        finish(c, base, *([moto.stop] if moto else []))


def test_a_template_only_a_drained_node_holds_is_fetched_by_another(cluster):
    from e2b import Sandbox
    from e2b.exceptions import SandboxException

    deadline = time.time() + 10
    while not all("tiny" in listed(cluster, c) for c in ("c1", "c2")) and time.time() < deadline:
        time.sleep(0.2)
    assert "tiny" in listed(cluster, "c1")
    assert not os.path.exists(os.path.join(cluster.n1_cache, "templates", "tiny"))
    assert "node n2 is now draining" in kiln_node(cluster, "drain", "n2")
    made = []
    try:
        time.sleep(0.5)
        s = Sandbox.create(template="tiny", timeout=120, **cluster.opts("c1"))
        made.append(s)
        assert cluster.node_of(s.sandbox_id) == "n1"
        assert s.files.read("/etc/tiny-marker") == cluster.marker
        r = s.commands.run("id -un; echo $HOME")
        assert r.stdout.split() == ["user", "/home/user"], r.stdout
        # n1 adopted the template into its own store, from n2's copy in the bucket.
        kept = os.path.join(cluster.n1_cache, "templates", "tiny", "current", "rootfs",
                            "etc", "tiny-marker")
        assert open(kept).read() == cluster.marker
        assert "template stored in object storage" in cluster.nodes["n2"].log()
        assert cluster.nodes["n1"].log().count("template fetched from object storage") == 1
        # A second create through the other replica finds the template on n1.
        t = Sandbox.create(template="tiny", timeout=120, **cluster.opts("c2"))
        made.append(t)
        assert cluster.node_of(t.sandbox_id) == "n1"
        assert t.commands.run("cat /etc/tiny-marker").stdout == cluster.marker
        assert cluster.nodes["n1"].log().count("template fetched from object storage") == 1
        # Both nodes hold it now: listed once, with the one build.
        at_c2 = [name for name in listed(cluster, "c2") if name == "tiny"]
        assert at_c2 == ["tiny"]
        with pytest.raises(SandboxException) as e:
            Sandbox.create(template="nosuch", timeout=60, **cluster.opts("c2"))
        assert str(e.value).startswith("404: ") and "no node of the cluster" in str(e.value)
    finally:
        kill_all(made)
        assert "takes new sandboxes" in kiln_node(cluster, "undrain", "n2")


def fetches(cluster) -> int:
    return cluster.nodes["n1"].log().count("template fetched from object storage")


def test_a_moved_sandbox_and_a_forks_child_fetch_their_template(cluster):
    from e2b import Sandbox

    from .test_server_cluster_objects import post_json

    made = []
    try:
        paused = Sandbox.create(template="tiny2", timeout=300, **cluster.opts("c1"))
        parent = Sandbox.create(template="tiny3", timeout=300, **cluster.opts("c2"))
        made += [paused, parent]
        assert {cluster.node_of(s.sandbox_id) for s in made} == {"n2"}
        paused.files.write("/home/user/notes.txt", "paused on n2")
        parent.files.write("/home/user/notes.txt", "parent on n2")
        assert Sandbox.pause(paused.sandbox_id, **cluster.opts("c2")) is True
        before = fetches(cluster)
        assert "node n2 is now draining" in kiln_node(cluster, "drain", "n2")
        # The paused sandbox resumes off the draining node, on n1, which fetched `tiny2`.
        again = Sandbox.connect(paused.sandbox_id, timeout=120, **cluster.opts("c1"))
        assert cluster.node_of(paused.sandbox_id) == "n1"
        assert again.files.read("/home/user/notes.txt") == "paused on n2"
        assert again.commands.run("cat /etc/tiny-marker").stdout == cluster.marker
        assert fetches(cluster) == before + 1
        # A fork's child cannot run beside its parent on the draining node: it runs on n1,
        # which fetched `tiny3` to borrow the parent's capture.
        status, answers = post_json(cluster, "c2", f"/sandboxes/{parent.sandbox_id}/fork",
                                    {"count": 1})
        assert status == 201, answers
        cid = answers[0]["sandbox"]["sandboxID"]
        child = Sandbox.connect(cid, timeout=120, **cluster.opts("c1"))
        made.append(child)
        assert cluster.node_of(cid) == "n1"
        assert child.files.read("/home/user/notes.txt") == "parent on n2"
        assert fetches(cluster) == before + 2
        for t in ("tiny2", "tiny3"):
            assert os.path.isdir(os.path.join(cluster.n1_cache, "templates", t, "current", "rootfs"))
    finally:
        kill_all(made)
        assert "takes new sandboxes" in kiln_node(cluster, "undrain", "n2")


def node_url(cluster, name: str) -> str:
    return re.search(r"node \S+ listening on (http://[0-9.:]+)", cluster.nodes[name].log()).group(1)


def test_a_template_whose_only_holder_left_is_fetched_from_the_bucket(cluster):
    from e2b import Sandbox

    from .test_server_cluster_templates import get

    # n2 stores `tiny4` (what a replica asks of a holder), then leaves the cluster.
    req = urllib.request.Request(node_url(cluster, "n2") + "/internal/v1/templates/tiny4/share",
                                 method="POST", headers={"Authorization": f"Bearer {cluster.secret}"})
    with urllib.request.urlopen(req, timeout=120) as r:
        doc = json.loads(r.read())
    assert (r.status, doc["name"], doc["node"]) == (200, "tiny4", "n2"), doc
    cluster.nodes["n2"].stop()
    # Gone from the cluster once its lease is (3 s), and from the replicas' view a moment later.
    key = base64.b64encode(f"{cluster.prefix}/nodes/n2".encode()).decode()
    deadline = time.time() + 30
    while etcd_json(cluster, "/v3/kv/range", {"key": key}).get("kvs") and time.time() < deadline:
        time.sleep(0.2)
    assert not etcd_json(cluster, "/v3/kv/range", {"key": key}).get("kvs"), "n2 is still registered"
    time.sleep(1)
    made = []
    try:
        # Listed and described from the bucket's record by both replicas.
        for c in ("c1", "c2"):
            assert "tiny4" in listed(cluster, c), listed(cluster, c)
            status, body = get(cluster, c, "/templates/tiny4")
            assert status == 200 and body["buildID"] == doc["key"], body
        before = fetches(cluster)
        s = Sandbox.create(template="tiny4", timeout=120, **cluster.opts("c2"))
        made.append(s)
        assert cluster.node_of(s.sandbox_id) == "n1"
        assert s.commands.run("cat /etc/tiny-marker").stdout == cluster.marker
        assert fetches(cluster) == before + 1
    finally:
        kill_all(made)
