"""Paused sandboxes' checkpoints in object storage (docs/cluster.md, "Checkpoints in object
storage"): a one-member etcd, a moto S3 server (PyPI `moto[server]`, pinned in
tests/sdk/requirements.txt), two `kiln node` processes with the bucket configured, one without,
and two `kiln control` replicas, all on 127.0.0.1. Through the pinned e2b SDK: a sandbox with a
file and a counting process is paused (its checkpoint uploaded before the pause answers), its
node is killed with SIGKILL, and traffic through a replica's gateway (autoResume) resumes it on
the other node with its file and its process still counting from where it was (memory
restored); the killed node, back on its state dir, drops its copy. A paused sandbox of a draining node
resumes on another node, its audit chain continued there (one chain, 1..n, kept in two parts by
the two nodes, read and verified through either replica), and the drained node drops its copy. A filesystem-only auto-pause (at
the end of the timeout) is uploaded too, and boots on its disk on another node after its node
is killed. A paused sandbox of a lost node without an object store answers 409 naming its
node. A sandbox's egress policy is read and replaced through either replica, and its console read
from its node. Bounded: about half a minute.

Needs KILN_BIN, the base template, runsc, etcd (Debian's etcd-server, or KILN_ETCD) and moto.
"""

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

import pytest

from .conftest import kiln_bin, read_count, runsc_processes_for
from .test_server_cluster_audit import node_rows
from .test_server_cluster import Cluster, Proc, finish, free_port, kiln_node

ACCESS = {"KILN_S3_ACCESS_KEY_ID": "kiln-test", "KILN_S3_SECRET_ACCESS_KEY": "kiln-test-secret"}
COUNTER = "i=0; while true; do echo $i > /home/user/count; i=$((i+1)); sleep 0.1; done"


class Moto:
    """moto's S3 server on a free 127.0.0.1 port, with one bucket."""

    def __init__(self, base: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(os.path.join(base, "moto.log"), "a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=base,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": base},
        )
        deadline = time.time() + 60
        while True:
            try:
                urllib.request.urlopen(self.url + "/", timeout=2).read()
                break
            except Exception:
                assert self.proc.poll() is None, "moto exited"
                assert time.time() < deadline, "moto did not answer"
                time.sleep(0.2)
        req = urllib.request.Request(self.url + "/kiln-ckpt", method="PUT")
        assert urllib.request.urlopen(req, timeout=10).status == 200

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class ObjectCluster(Cluster):
    def start_node(self, name: str, s3: bool = True, extra=()) -> Proc:
        if not s3:
            return super().start_node(name, extra)
        with environ(**ACCESS, KILN_S3_ENDPOINT=self.moto.url, KILN_S3_BUCKET="kiln-ckpt"):
            return super().start_node(name, extra)


@contextlib.contextmanager
def environ(**changes):
    """This process's environment with `changes`, for the processes started meanwhile."""
    saved = dict(os.environ)
    os.environ.update(changes)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="module")
def cluster():
    base = tempfile.mkdtemp(prefix="kiln-cluster-obj-")
    c, moto = None, None
    try:
        moto = Moto(base)
        c = ObjectCluster(base)
        c.moto = moto
        c.start_node("n1")
        c.start_node("n2")
        c.start_control("c1")
        c.start_control("c2")
        assert c.api_key, "the first control replica of an empty cluster makes the first API key"
        yield c
    finally:
        finish(c, base, *([moto.stop] if moto else []))


def kill_quietly(cluster, sid: str, control: str):
    """Kills the sandbox on the way out of a test, whatever state the test left it in."""
    from e2b import Sandbox

    try:
        Sandbox.kill(sid, **cluster.opts(control))
    except Exception:
        pass


def sandbox_dir(node: Proc, sid: str) -> str:
    return os.path.join(node.state_dir, "gvisor", "sandboxes", sid)


def count(s) -> int:
    """The counter's number (read again when caught between the counter's truncate and write)."""
    return read_count(s, 20, 0.05)


def start_counting(s) -> int:
    s.commands.run(COUNTER, background=True)
    deadline = time.time() + 10
    while time.time() < deadline:
        r = s.commands.run("cat /home/user/count 2>/dev/null || echo -1")
        if int(r.stdout.strip()) >= 5:
            return int(r.stdout.strip())
        time.sleep(0.2)
    pytest.fail("the counter did not start")


def connect_when_moved(cluster, sid: str, control: str, timeout: float = 40):
    """Connects once the replica counts the old node gone (a connect before that reaches the
    dead node and answers 503, which is retried)."""
    from e2b import Sandbox

    deadline, last = time.time() + timeout, None
    while time.time() < deadline:
        try:
            return Sandbox.connect(sid, timeout=120, **cluster.opts(control))
        except Exception as e:  # the dead node's 503 until its lease expires
            last = e
            time.sleep(0.5)
    pytest.fail(f"no connect within {timeout}s: {last}")


def post_json(cluster, control: str, path: str, body: dict, method: str = "POST"):
    req = urllib.request.Request(
        cluster.controls[control].url + path, method=method, data=json.dumps(body).encode(),
        headers={"X-API-Key": cluster.api_key, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, payload = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, payload = e.code, e.read()
    return status, (json.loads(payload) if payload else None)


def checkpoint_events(cluster, sid: str) -> list:
    status, page = cluster.request("c1", "GET", "/events?type=checkpoint&limit=1000")
    assert status == 200, page
    return [e["detail"] for e in page["events"] if e["sandboxID"] == sid]


def test_a_paused_sandbox_of_a_killed_node_resumes_on_another_with_its_memory(cluster):
    from e2b import Sandbox

    s = Sandbox.create(timeout=300, lifecycle={"on_timeout": "pause", "auto_resume": True},
                       **cluster.opts("c1"))
    sid = s.sandbox_id
    try:
        home = cluster.node_of(sid)
        other = "n2" if home == "n1" else "n1"
        s.files.write("/home/user/notes.txt", "written on " + home)
        start_counting(s)
        before = secrets.token_hex(6)
        assert s.commands.run(f"echo {before}").exit_code == 0
        t = time.time()
        assert Sandbox.pause(sid, **cluster.opts("c1")) is True
        print(f"pause with upload: {time.time() - t:.2f} s")
        # The pause answered after the upload: the checkpoint is recorded with its rate.
        stored = checkpoint_events(cluster, sid)
        assert stored and "checkpoint in object storage" in stored[0] and "MB/s" in stored[0], stored
        print(stored[0])
        cluster.nodes[home].kill9()
        # Traffic through the gateway (autoResume) resumes it on the node left, once the
        # replica counts its node gone.
        t, got = time.time(), None
        while got is None:
            try:
                got = s.files.read("/home/user/notes.txt", request_timeout=60)
            except Exception as e:
                assert time.time() < t + 40, f"never auto-resumed elsewhere: {e}"
                time.sleep(0.5)
        print(f"auto-resume on another node (after the lease ran out): {time.time() - t:.2f} s")
        assert got == "written on " + home
        assert cluster.node_of(sid) == other, "resumed on the node left"
        again = Sandbox.connect(sid, timeout=120, **cluster.opts("c2"))
        first = count(again)
        assert first >= 5, f"the counter continued from where it was, not from 0 ({first})"
        time.sleep(1)
        assert count(again) > first, "the counting process runs on (its memory was restored)"
        fetched = [d for d in checkpoint_events(cluster, sid) if "fetched" in d]
        assert fetched and "MB/s" in fetched[0], fetched
        print(fetched[0])
        for c in ("c1", "c2"):
            status, detail = cluster.request(c, "GET", f"/sandboxes/{sid}")
            assert status == 200 and detail["state"] == "running", (c, detail)
        # The killed node back on its state dir drops its copy instead of publishing it.
        back = cluster.start_node(home)
        deadline = time.time() + 60
        while os.path.exists(sandbox_dir(back, sid)) and time.time() < deadline:
            time.sleep(0.3)
        assert not os.path.exists(sandbox_dir(back, sid)), "the old node dropped its copy"
        assert again.commands.run("echo still here").stdout.strip() == "still here"
        assert cluster.node_of(sid) == other
        # Its audit chain went on from where the killed node's part ends.
        after = secrets.token_hex(6)
        assert again.commands.run(f"echo {after}").exit_code == 0
        chain_moved(cluster, sid, home, other, before, after)
    finally:
        kill_quietly(cluster, sid, "c2")


def net_file(node: Proc, sid: str) -> dict:
    """The egress policy the node's driver holds for the sandbox's network slot."""
    with open(os.path.join(sandbox_dir(node, sid), "net.json")) as f:
        return json.load(f)


def test_a_paused_sandbox_of_a_draining_node_resumes_elsewhere_under_its_policy(cluster):
    from e2b import Sandbox

    policy = {"allow_out": ["198.51.100.7"], "deny_out": ["0.0.0.0/0"]}
    s = Sandbox.create(timeout=300, network=policy, **cluster.opts("c2"))
    sid = s.sandbox_id
    home = cluster.node_of(sid)
    other = "n2" if home == "n1" else "n1"
    try:
        held = net_file(cluster.nodes[home], sid)
        assert (held["allowOut"], held["denyOut"]) == (["198.51.100.7"], ["0.0.0.0/0"]), held
        s.files.write("/home/user/notes.txt", "drained")
        before = secrets.token_hex(6)
        assert s.commands.run(f"echo {before}").exit_code == 0
        assert Sandbox.pause(sid, **cluster.opts("c2")) is True
        out = kiln_node(cluster, "drain", home)
        assert sid in out.split("paused sandbox(es)")[1], out
        again = Sandbox.connect(sid, timeout=120, **cluster.opts("c1"))
        assert cluster.node_of(sid) == other, "the next resume lands off the draining node"
        assert again.files.read("/home/user/notes.txt") == "drained"
        after = secrets.token_hex(6)
        assert again.commands.run(f"echo {after}").exit_code == 0
        # One audit chain: begun on its first node, continued on the second.
        chain_moved(cluster, sid, home, other, before, after)
        # Its network on the new node is under the policy it was made with.
        moved = net_file(cluster.nodes[other], sid)
        for k in ("allowInternetAccess", "allowOut", "denyOut", "dnsServers"):
            assert moved[k] == held[k], (k, moved, held)
        deadline = time.time() + 30
        while os.path.exists(sandbox_dir(cluster.nodes[home], sid)) and time.time() < deadline:
            time.sleep(0.3)
        assert not os.path.exists(sandbox_dir(cluster.nodes[home], sid)), "the drained node dropped its copy"
        # Paused again on its new node and resumed there (a node left alone keeps it).
        assert Sandbox.pause(sid, **cluster.opts("c1")) is True
        kiln_node(cluster, "undrain", home)
        again = Sandbox.connect(sid, timeout=120, **cluster.opts("c2"))
        assert cluster.node_of(sid) == other
        assert again.files.read("/home/user/notes.txt") == "drained"
    finally:
        kiln_node(cluster, "undrain", home)
        kill_quietly(cluster, sid, "c1")


def chain_moved(cluster, sid: str, first: str, second: str, before: str, after: str):
    """`sid`'s audit chain read through either replica is one chain, 1..n without a gap, with
    `before` (run on node `first`) kept there and `after` (run on `second`) kept there, and
    it verifies through a replica."""
    deadline, recs = time.time() + 30, []
    while time.time() < deadline:
        status, page = cluster.request("c2", "GET", f"/sandboxes/{sid}/audit?limit=1000")
        assert status == 200, page
        recs = page["records"]
        if all(any(m in json.dumps(r["body"]) for r in recs) for m in (before, after)):
            break
        time.sleep(0.3)
    assert [r["seq"] for r in recs] == list(range(1, len(recs) + 1)), [(r["seq"], r["kind"]) for r in recs]
    for node, mark, absent in ((first, before, after), (second, after, before)):
        rows = node_rows(cluster, node, sid)
        assert any(k == "process" and mark in b for k, b in rows), (node, rows)
        assert not any(absent in b for _, b in rows), (node, "keeps only its own part")
    # Paged through the other replica with the cluster's cursor: the same chain.
    paged, cursor = [], None
    while True:
        q = "?limit=4" + (f"&cursor={cursor}" if cursor else "")
        status, page = cluster.request("c1", "GET", f"/sandboxes/{sid}/audit{q}")
        assert status == 200, page
        if not page["records"]:
            break
        paged.extend(page["records"])
        cursor = page["nextCursor"]
    assert sorted(r["hash"] for r in paged[:len(recs)]) == sorted(r["hash"] for r in recs)
    status, v = cluster.request("c1", "GET", f"/audit/verify?sandboxID={sid}")
    assert status == 200 and v["ok"], v
    assert v["chains"][0]["records"] >= len(recs) and v["chains"][0]["pruned"] == 0, v


def test_a_sandboxs_network_is_read_and_replaced_through_either_replica(cluster):
    """get_info through a replica shows the policy the sandbox's node holds; the SDK's
    update_network through the other replica replaces it on that node; rules naming a secret
    the team lacks are refused (400) at the replica and change nothing."""
    from e2b import Sandbox

    s = Sandbox.create(timeout=120, network={"allow_out": ["198.51.100.7"], "deny_out": ["0.0.0.0/0"]},
                       **cluster.opts("c1"))
    sid = s.sandbox_id
    node = cluster.nodes[cluster.node_of(sid)]
    try:
        status, info = cluster.request("c2", "GET", f"/sandboxes/{sid}")
        assert status == 200, info
        assert (info["network"]["allowOut"], info["network"]["denyOut"]) == \
            (["198.51.100.7"], ["0.0.0.0/0"]), info
        s2 = Sandbox.connect(sid, **cluster.opts("c2"))
        s2.update_network({"allow_out": ["198.51.100.9", "198.51.100.10"], "deny_out": ["0.0.0.0/0"]})
        held = net_file(node, sid)
        assert (held["allowOut"], held["denyOut"]) == (["198.51.100.9", "198.51.100.10"], ["0.0.0.0/0"]), held
        status, info = cluster.request("c1", "GET", f"/sandboxes/{sid}")
        assert info["network"]["allowOut"] == ["198.51.100.9", "198.51.100.10"], info
        status, err = post_json(cluster, "c1", f"/sandboxes/{sid}/network",
                                {"rules": {"198.51.100.9": [{"transform": {"headers": {
                                    "A": "${e2b.secrets.not-made}"}}}]}}, "PUT")
        assert status == 400 and "not-made" in err["message"], err
        status, err = post_json(cluster, "c1", f"/sandboxes/{sid}/network", {"allowOut": ["not an address!"]}, "PUT")
        assert status == 400, err
        assert net_file(node, sid)["allowOut"] == ["198.51.100.9", "198.51.100.10"], "refused updates change nothing"
        assert s.commands.run("echo reachable").stdout.strip() == "reachable"
    finally:
        kill_quietly(cluster, sid, "c1")


def test_a_sandboxs_console_is_read_from_its_node(cluster):
    """A sandbox's logs through a replica: its events from etcd and, while it runs, its
    console output from its node."""
    from e2b import Sandbox

    s = Sandbox.create(timeout=60, **cluster.opts("c1"))
    try:
        status, logs = cluster.request("c2", "GET", f"/v2/sandboxes/{s.sandbox_id}/logs")
        assert status == 200, logs
        sources = {e["fields"].get("source") for e in logs["logs"]}
        events = {e["fields"].get("event") for e in logs["logs"]}
        assert "agent" in sources and "created" in events, logs
    finally:
        kill_quietly(cluster, s.sandbox_id, "c1")


def test_a_drained_nodes_paused_sandboxes_move_off_it_by_themselves(cluster):
    from e2b import Sandbox

    s = Sandbox.create(timeout=300, **cluster.opts("c1"))
    sid = s.sandbox_id
    home = cluster.node_of(sid)
    other = "n2" if home == "n1" else "n1"
    try:
        s.files.write("/home/user/notes.txt", "moved while paused")
        assert Sandbox.pause(sid, **cluster.opts("c1")) is True
        kiln_node(cluster, "drain", home)
        # The leading replica moves it, still paused, to the node left: no client resumes it.
        deadline = time.time() + 40
        while time.time() < deadline and (os.path.exists(sandbox_dir(cluster.nodes[home], sid))
                                          or not os.path.exists(sandbox_dir(cluster.nodes[other], sid))):
            time.sleep(0.3)
        assert os.path.exists(sandbox_dir(cluster.nodes[other], sid)), "taken over by the other node"
        assert not os.path.exists(sandbox_dir(cluster.nodes[home], sid)), "the drained node dropped its copy"
        for c in ("c1", "c2"):
            status, detail = cluster.request(c, "GET", f"/sandboxes/{sid}")
            assert status == 200 and detail["state"] == "paused", (c, detail)
        assert cluster.node_of(sid) is None, "moved, not resumed"
        moved = [d for d in checkpoint_events(cluster, sid) if "fetched" in d]
        assert moved, checkpoint_events(cluster, sid)
        # Undrained, its old node stays empty: the sandbox resumes where it moved.
        kiln_node(cluster, "undrain", home)
        again = Sandbox.connect(sid, timeout=120, **cluster.opts("c2"))
        assert cluster.node_of(sid) == other
        assert again.files.read("/home/user/notes.txt") == "moved while paused"
    finally:
        kiln_node(cluster, "undrain", home)
        kill_quietly(cluster, sid, "c1")


def test_an_auto_paused_filesystem_only_sandbox_outlives_its_node(cluster):
    from e2b import Sandbox, SandboxState

    s = Sandbox.create(timeout=3, lifecycle={"on_timeout": {"action": "pause", "mode": "filesystem"}},
                       **cluster.opts("c1"))
    sid = s.sandbox_id
    home = cluster.node_of(sid)
    other = "n2" if home == "n1" else "n1"
    try:
        s.files.write("/home/user/on-disk", "kept")
        deadline = time.time() + 30
        while Sandbox.get_info(sid, **cluster.opts("c2")).state != SandboxState.PAUSED:
            assert time.time() < deadline, "never auto-paused"
            time.sleep(0.2)
        # The node uploads an auto-pause's checkpoint after its `paused` event.
        while not checkpoint_events(cluster, sid):
            assert time.time() < deadline, "the auto-pause's checkpoint was not stored"
            time.sleep(0.2)
        status, detail = cluster.request("c1", "GET", f"/sandboxes/{sid}")
        assert status == 200 and detail["pauseMode"] == "filesystem", detail
        cluster.nodes[home].kill9()
        # Both replicas resume it at once: one sandbox comes of it.
        got = {}
        threads = [threading.Thread(target=lambda c=c: got.__setitem__(c, connect_when_moved(cluster, sid, c)))
                   for c in ("c1", "c2")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=90)
        assert set(got) == {"c1", "c2"}, got
        again = got["c2"]
        assert cluster.node_of(sid) == other, "booted on its disk on the node left"
        assert sum(1 for c in runsc_processes_for(cluster.nodes[other].state_dir) if sid in c) >= 1
        assert again.files.read("/home/user/on-disk") == "kept"
        assert got["c1"].files.read("/home/user/on-disk") == "kept"
        assert again.commands.run("echo booted").stdout.strip() == "booted"
        cluster.start_node(home)
    finally:
        kill_quietly(cluster, sid, "c1")


def test_a_node_refuses_to_start_on_a_bucket_it_cannot_use(cluster):
    assert f"checkpoints go to bucket kiln-ckpt at {cluster.moto.url}" in cluster.nodes["n2"].log()
    assert "checkpoints go to" not in cluster.start_node("n3", s3=False).log()
    base = [kiln_bin(), "node", *cluster.join(), "--name", "nx", "--no-prepare",
            "--listen", "127.0.0.1:0", "--state-dir", os.path.join(cluster.base, "nx"),
            "--s3-endpoint", cluster.moto.url]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_S3_")}
    r = subprocess.run(base, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "KILN_S3_ACCESS_KEY_ID is not" in r.stderr, r.stderr
    r = subprocess.run([*base, "--s3-bucket", "no-such-bucket"], env={**env, **ACCESS},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "reaching the object store's bucket" in r.stderr, r.stderr
    assert "kiln-test-secret" not in r.stderr + r.stdout, "no secret in the output"


def test_without_an_object_store_a_lost_nodes_paused_sandbox_answers_409(cluster):
    from e2b import Sandbox

    n3 = cluster.nodes.get("n3") or cluster.start_node("n3", s3=False)
    for n in ("n1", "n2"):
        kiln_node(cluster, "drain", n)
    try:
        s = Sandbox.create(timeout=300, **cluster.opts("c1"))
        sid = s.sandbox_id
    finally:
        for n in ("n1", "n2"):
            kiln_node(cluster, "undrain", n)
    assert cluster.node_of(sid) == "n3"
    try:
        assert Sandbox.pause(sid, **cluster.opts("c1")) is True
        assert checkpoint_events(cluster, sid) == [], "no object store: nothing uploaded"
        n3.kill9()
        deadline = time.time() + 30
        while True:
            status, body = post_json(cluster, "c2", f"/sandboxes/{sid}/connect", {"timeout": 60})
            if status != 503 or time.time() > deadline:
                break
            time.sleep(0.5)
        assert status == 409, (status, body)
        assert "node n3" in body["message"] and "no object store" in body["message"], body
        assert "/" not in body["message"], "no host path in the message"
    finally:
        kill_quietly(cluster, sid, "c1")
