"""Snapshots on a kiln cluster (docs/cluster.md, "Snapshots"), on the cluster of
test_server_cluster.py (a one-member etcd, nodes n1 and n2, replicas c1 and c2), through the
pinned e2b SDK:

- a snapshot taken through one replica is listed through the other, and sandboxes created
  from it (by id and by name, through either replica) run on the node that keeps it, with the
  source's files, environment and running processes;
- names are unique cluster-wide: a sandbox on the other node cannot take the name;
- a snapshot is deleted through the other replica: gone from every list, its files gone from
  its node, and a create from it refused;
- a snapshot whose node is away: a create from it answers 503 saying so; deleted meanwhile,
  its files are removed when the node is back.

Needs KILN_BIN, the base template, runsc, and etcd (Debian's etcd-server, or KILN_ETCD).
"""

import os
import secrets
import sqlite3
import time

from .conftest import kill_all, read_count
from .test_server_cluster_failures import post
from .test_server_cluster import cluster  # noqa: F401  (the module's cluster fixture)

COUNTER = "i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 0.1; done"


def listed(cluster, control: str, **kw) -> list:
    from e2b import Sandbox

    pages = Sandbox.list_snapshots(**kw, **cluster.opts(control))
    out = []
    while pages.has_next:
        out.extend(pages.next_items())
    return out


def settings_rows(cluster, node: str, snapshot_id: str) -> int:
    """How many network settings rows `node`'s own database keeps for the snapshot."""
    path = os.path.join(cluster.nodes[node].state_dir, "kiln.db")
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
    try:
        row = "snapshot:" + snapshot_id.split(":")[0]  # the id without its tag
        return db.execute("SELECT count(*) FROM sandbox_network WHERE sandbox_id = ?", (row,)).fetchone()[0]
    finally:
        db.close()


def count(sbx) -> int:
    """The counter's number (read again when caught between the counter's truncate and write)."""
    return read_count(sbx, 20, 0.05, "/tmp/count")


def snapshot_dir(cluster, node: str, snap_id: str) -> str:
    """Where the gVisor driver of `node` keeps the files of snapshot `snap_id`."""
    return os.path.join(cluster.nodes[node].state_dir, "gvisor", "snapshots", snap_id.split(":")[0])


def snapshots_on(cluster, node: str) -> set:
    """The snapshots whose files are on `node`."""
    d = os.path.join(cluster.nodes[node].state_dir, "gvisor", "snapshots")
    return set(os.listdir(d)) if os.path.isdir(d) else set()


def api(cluster, control: str, path: str, body: dict):
    """POST `body` to `path` at replica `control`: (status, JSON answer)."""
    return post(cluster.controls[control].url, path, body, {"X-API-Key": cluster.api_key})


def on_node(cluster, node: str, control: str, made: list, **create):
    """A sandbox on `node` (created, with `create`'s settings, through `control` until one
    lands there)."""
    from e2b import Sandbox

    for _ in range(10):
        s = Sandbox.create(timeout=120, **create, **cluster.opts(control))
        made.append(s)
        if cluster.node_of(s.sandbox_id) == node:
            return s
    raise AssertionError(f"ten creates and none landed on {node}")


def create_until(cluster, control: str, template: str, within: float):
    """A sandbox of `template` through `control`, retried for `within` seconds (while the
    replicas' views catch up with a node that left or came back)."""
    from e2b import Sandbox

    deadline = time.time() + within
    while True:
        try:
            return Sandbox.create(template=template, timeout=120, **cluster.opts(control))
        except Exception:
            if time.time() > deadline:
                raise
            time.sleep(0.5)


def test_a_snapshot_is_listed_everywhere_and_restored_on_its_node(cluster):
    from e2b import Sandbox

    name = "cl-snap-" + secrets.token_hex(3)
    made, snap = [], None
    try:
        src = Sandbox.create(timeout=120, envs={"KEPT": "in-snapshot"}, **cluster.opts("c1"))
        made.append(src)
        home = cluster.node_of(src.sandbox_id)
        other = "n2" if home == "n1" else "n1"
        src.commands.run(COUNTER, background=True)
        src.files.write("/home/user/notes.txt", "captured")
        time.sleep(0.4)
        snap = src.create_snapshot(name=name)
        assert snap.names == [f"{name}:default"], snap.names
        assert os.path.isdir(snapshot_dir(cluster, home, snap.snapshot_id))
        assert not os.path.exists(snapshot_dir(cluster, other, snap.snapshot_id))

        # Listed through the other replica, by source and by name.
        for kw in ({"sandbox_id": src.sandbox_id}, {}):
            ids = [s.snapshot_id for s in listed(cluster, "c2", **kw)]
            assert snap.snapshot_id in ids, (kw, ids)
        status, raw = cluster.request("c2", "GET", f"/snapshots?name={name}")
        assert status == 200 and [s["snapshotID"] for s in raw] == [snap.snapshot_id], raw
        assert raw[0]["sizeBytes"] > 0

        # The name is the cluster's: a sandbox on the other node cannot take it.
        there = on_node(cluster, other, "c2", made)
        before = snapshots_on(cluster, other)
        status, body = api(cluster, "c2", f"/sandboxes/{there.sandbox_id}/snapshots", {"name": name})
        assert status == 409 and name in body["message"], (status, body)
        assert snapshots_on(cluster, other) == before, "a refused snapshot leaves no files"

        src.kill()
        # Restored through either replica, by id and by name: on the node that keeps it.
        for control, template in (("c2", snap.snapshot_id), ("c1", name)):
            sbx = Sandbox.create(template=template, timeout=120, **cluster.opts(control))
            made.append(sbx)
            assert cluster.node_of(sbx.sandbox_id) == home, (template, cluster.node_of(sbx.sandbox_id))
            assert sbx.files.read("/home/user/notes.txt") == "captured"
            assert sbx.commands.run("echo $KEPT").stdout == "in-snapshot\n"
            c = count(sbx)
            time.sleep(0.5)
            assert count(sbx) > c, "the snapshot's process does not run"

        # Deleted through the other replica than the one that took it.
        assert Sandbox.delete_snapshot(snap.snapshot_id, **cluster.opts("c2")) is True
        assert Sandbox.delete_snapshot(snap.snapshot_id, **cluster.opts("c1")) is False
        gone, snap = snap, None
        for control in ("c1", "c2"):
            assert gone.snapshot_id not in [s.snapshot_id for s in listed(cluster, control)]
        assert not os.path.exists(snapshot_dir(cluster, home, gone.snapshot_id))
        status, body = api(cluster, "c1", "/sandboxes", {"templateID": name, "timeout": 60})
        assert status in (400, 404), (status, body)
    finally:
        kill_all(made)
        if snap is not None:
            Sandbox.delete_snapshot(snap.snapshot_id, **cluster.opts("c1"))


def test_a_snapshot_of_a_node_that_is_away(cluster):
    """Last in the module: it stops a node and starts it again."""
    from e2b import Sandbox

    made, kept = [], []
    try:
        # With a deny list: its snapshots record network settings on n2.
        src = on_node(cluster, "n2", "c1", made, network={"deny_out": ["198.51.100.77"]})
        src.files.write("/home/user/f.txt", "on n2")
        kept = [src.create_snapshot(), src.create_snapshot()]
        for s in made:
            s.kill()
        made = []
        cluster.nodes["n2"].stop()
        # Gone from the cluster (it left its lease on the way out): a create from the snapshot
        # says where the snapshot is and to retry; the snapshot stays listed.
        deadline = time.time() + 20
        while True:
            status, body = api(cluster, "c2", "/sandboxes", {"templateID": kept[0].snapshot_id, "timeout": 60})
            if status == 503 or time.time() > deadline:
                break
            time.sleep(0.3)
        assert status == 503 and "n2" in body["message"], (status, body)
        assert kept[0].snapshot_id in [s.snapshot_id for s in listed(cluster, "c1")]
        # Deleted while n2 is away: unlisted at once; its files stay until n2 is back.
        assert Sandbox.delete_snapshot(kept[1].snapshot_id, **cluster.opts("c1")) is True
        assert kept[1].snapshot_id not in [s.snapshot_id for s in listed(cluster, "c2")]
        assert os.path.isdir(snapshot_dir(cluster, "n2", kept[1].snapshot_id))

        cluster.start_node("n2")
        deadline = time.time() + 30
        while os.path.exists(snapshot_dir(cluster, "n2", kept[1].snapshot_id)) and time.time() < deadline:
            time.sleep(0.2)
        assert not os.path.exists(snapshot_dir(cluster, "n2", kept[1].snapshot_id)), \
            "n2 removes the files of a snapshot deleted while it was away"
        assert os.path.isdir(snapshot_dir(cluster, "n2", kept[0].snapshot_id)), "the other stays"
        # Its network settings, recorded on n2 when it was taken, are forgotten with it.
        assert settings_rows(cluster, "n2", kept[0].snapshot_id) == 1, "recorded when taken"
        while settings_rows(cluster, "n2", kept[1].snapshot_id) and time.time() < deadline:
            time.sleep(0.2)
        assert settings_rows(cluster, "n2", kept[1].snapshot_id) == 0, "forgotten once n2 is back"
        # Back in the cluster: the kept snapshot restores there again.
        sbx = create_until(cluster, "c2", kept[0].snapshot_id, within=20)
        made.append(sbx)
        assert cluster.node_of(sbx.sandbox_id) == "n2"
        assert sbx.files.read("/home/user/f.txt") == "on n2"
    finally:
        kill_all(made)
        if "n2" in cluster.nodes and cluster.nodes["n2"].proc.poll() is not None:
            cluster.start_node("n2")
        for k in kept:
            try:
                Sandbox.delete_snapshot(k.snapshot_id, **cluster.opts("c1"))
            except Exception:
                pass
