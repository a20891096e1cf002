"""Snapshots in object storage (docs/cluster.md, "Snapshots"), on the cluster of
test_server_cluster_objects.py (a moto S3 server, nodes n1 and n2 on its bucket, replicas c1
and c2), through the pinned e2b SDK:

- a snapshot taken on one node is stored in the bucket; while that node is draining, creates
  from it (through either replica) run on the other node, which borrows its files: the
  source's file and its counting process (memory) come back, twice, and the borrowed copy is
  dropped after each create; back from draining, its node takes the next create again;
- the sandboxes made from a borrowed snapshot keep running after the snapshot is deleted;
- a fork of a sandbox on a draining node: its children run on the other node with the
  parent's file and running process, the parent runs on, and the fork's capture is never
  listed and is gone from both nodes afterwards;
- a snapshot of a node killed with SIGKILL starts on the other node.

Needs KILN_BIN, the base template, runsc, etcd (Debian's etcd-server, or KILN_ETCD) and moto.
"""

import time

from .conftest import kill_all
from .test_server_cluster import kiln_node
from .test_server_cluster_objects import cluster, count  # noqa: F401  (the module's cluster fixture)
from .test_server_cluster_snapshots import api, create_until, on_node, snapshots_on

COUNTER = "i=0; while true; do echo $i > /home/user/count; i=$((i+1)); sleep 0.1; done"


def source_on(cluster, node: str, made: list):
    """A sandbox on `node` with a file and a counting process."""
    s = on_node(cluster, node, "c1", made)
    s.files.write("/home/user/notes.txt", f"written on {node}")
    s.commands.run(COUNTER, background=True)
    time.sleep(0.5)
    return s


def test_a_snapshot_of_a_draining_node_is_borrowed_by_another(cluster):
    from e2b import Sandbox

    made, snap = [], None
    try:
        src = source_on(cluster, "n1", made)
        snap = src.create_snapshot()
        sid = snap.snapshot_id.split(":")[0]
        status, files = cluster.request("c1", "GET", f"/snapshots?sandboxID={src.sandbox_id}")
        assert status == 200 and [s["snapshotID"] for s in files] == [snap.snapshot_id], files
        kiln_node(cluster, "drain", "n1")
        for control in ("c2", "c1"):
            before = snapshots_on(cluster, "n2")
            child = Sandbox.create(template=snap.snapshot_id, timeout=120, **cluster.opts(control))
            made.append(child)
            assert cluster.node_of(child.sandbox_id) == "n2"
            assert child.files.read("/home/user/notes.txt") == "written on n1"
            c = count(child)
            assert c > 0, "the counter's progress was in the snapshot's memory"
            time.sleep(0.5)
            assert count(child) > c, "the snapshot's process runs on the borrowing node"
            assert snapshots_on(cluster, "n2") == before, "the borrowed copy is dropped"
            assert sid in snapshots_on(cluster, "n1"), "its own node keeps it"
        kiln_node(cluster, "undrain", "n1")
        home = Sandbox.create(template=snap.snapshot_id, timeout=120, **cluster.opts("c2"))
        made.append(home)
        assert cluster.node_of(home.sandbox_id) == "n1", "a snapshot starts on its own node first"

        assert Sandbox.delete_snapshot(snap.snapshot_id, **cluster.opts("c2")) is True
        snap = None
        assert sid not in snapshots_on(cluster, "n1")
        for s in made[-3:-1]:
            assert s.commands.run("cat /home/user/notes.txt").stdout == "written on n1"
    finally:
        kiln_node(cluster, "undrain", "n1")
        kill_all(made)
        if snap is not None:
            Sandbox.delete_snapshot(snap.snapshot_id, **cluster.opts("c1"))


def test_a_fork_of_a_sandbox_on_a_draining_node_runs_on_another(cluster):
    from e2b import Sandbox

    made = []
    try:
        parent = source_on(cluster, "n1", made)
        before = {n: snapshots_on(cluster, n) for n in ("n1", "n2")}
        kiln_node(cluster, "drain", "n1")
        status, answers = api(cluster, "c2", f"/sandboxes/{parent.sandbox_id}/fork", {"count": 2})
        assert status == 201, answers
        ids = [a["sandbox"]["sandboxID"] for a in answers if a.get("sandbox")]
        assert len(ids) == 2, answers
        for cid in ids:
            child = Sandbox.connect(cid, **cluster.opts("c1"))
            made.append(child)
            assert cluster.node_of(cid) == "n2"
            assert child.files.read("/home/user/notes.txt") == "written on n1"
            c = count(child)
            time.sleep(0.5)
            assert count(child) > c, "the parent's process runs on in the child"
        c = count(parent)
        time.sleep(0.3)
        assert count(parent) > c and cluster.node_of(parent.sandbox_id) == "n1", "the parent runs on"
        status, listed = cluster.request("c1", "GET", f"/snapshots?sandboxID={parent.sandbox_id}")
        assert status == 200 and listed == [], listed
        assert {n: snapshots_on(cluster, n) for n in ("n1", "n2")} == before, "the capture is gone"
    finally:
        kiln_node(cluster, "undrain", "n1")
        kill_all(made)


def test_a_snapshot_of_a_killed_node_starts_on_another(cluster):
    """Last in the module: it kills n1 and starts it again."""
    from e2b import Sandbox

    made, snap = [], None
    try:
        src = source_on(cluster, "n1", made)
        snap = src.create_snapshot()
        cluster.nodes["n1"].kill9()
        made.remove(src)
        # Until the replica sees n1's lease gone, creates go to n1 and fail over.
        child = create_until(cluster, "c1", snap.snapshot_id, within=30)
        made.append(child)
        assert cluster.node_of(child.sandbox_id) == "n2"
        assert child.files.read("/home/user/notes.txt") == "written on n1"
        c = count(child)
        time.sleep(0.5)
        assert count(child) > c
    finally:
        kill_all(made)
        if cluster.nodes["n1"].proc.poll() is not None:
            cluster.start_node("n1")
        if snap is not None:
            try:
                Sandbox.delete_snapshot(snap.snapshot_id, **cluster.opts("c1"))
            except Exception:
                pass
