"""Failures of a kiln cluster on this machine (docs/cluster.md), each with its own etcd, nodes
and control replicas on 127.0.0.1, bounded in time:

- a three-member etcd cluster, the node and the replica given all three members: the etcd
  leader killed with SIGKILL, creating, running a command and killing a sandbox through the
  pinned e2b SDK still work (and a sandbox made before keeps working);
- a control replica killed with SIGKILL while a create with an `Idempotency-Key` is in flight
  on its node: the same create retried at the other replica yields exactly one sandbox for
  that key (listed through the other replica, and one runsc container on the node);
- a node stopped with SIGTERM (an upgrade) and started again on its state directory within its
  restart grace: its running sandbox was held by the cluster meanwhile (running, no `died`
  event, calls a 503 saying the node is restarting) and runs on with its files and
  processes; a node not back within its grace has its sandbox ended `node-lost`, and stops its
  copy when it is back;
- a cluster without nodes yet: alerts and audit reads are empty pages, the Template API
  answers 501 naming the flag that makes a build node, a volume 503 (no node to keep it).

Needs KILN_BIN, the base template, runsc, and etcd (Debian's etcd-server, or KILN_ETCD).
"""

import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request

import pytest

from .conftest import kiln_bin
from .test_server_cluster import Cluster, etcd_binary, finish, free_port



@pytest.fixture(autouse=True)
def three_minutes():
    """Each test ends within three minutes (its cluster is torn down on the way out)."""
    def over(signum, frame):
        raise TimeoutError("the test ran over its bound of three minutes")

    old = signal.signal(signal.SIGALRM, over)
    signal.alarm(180)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def post(url: str, path: str, body: dict, headers: dict, timeout: float = 120):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def runsc_containers(state_dir: str) -> list:
    """The ids of the runsc containers of a node's state dir."""
    root = os.path.join(state_dir, "gvisor", "runsc")
    if not os.path.isdir(root):
        return []
    runsc = shutil.which("runsc") or "/usr/bin/runsc"
    out = subprocess.run([runsc, f"--root={root}", "list", "--format=json"],
                         capture_output=True, text=True, timeout=30).stdout
    return [c["id"] for c in json.loads(out or "[]") or []]


class EtcdTrio(Cluster):
    """A cluster whose etcd has three members (m0, m1, m2) on 127.0.0.1."""

    def __init__(self, base: str):
        self.base = base
        self.procs = []
        self.secret = secrets.token_hex(16)
        self.prefix = "/kiln-test-" + secrets.token_hex(4)
        ports = [(free_port(), free_port()) for _ in range(3)]
        self.member_urls = [f"http://127.0.0.1:{c}" for c, _ in ports]
        initial = ",".join(f"m{i}=http://127.0.0.1:{p}" for i, (_, p) in enumerate(ports))
        token = "kiln-" + secrets.token_hex(4)
        # The members' data in memory, as the one-member cluster's (Cluster.__init__).
        self.etcd_dir = tempfile.mkdtemp(prefix="kiln-etcd-", dir="/dev/shm")
        self.members = []
        for i, (c, p) in enumerate(ports):
            url, peer = f"http://127.0.0.1:{c}", f"http://127.0.0.1:{p}"
            self.members.append(self.spawn(f"etcd{i}", [
                etcd_binary(), "--name", f"m{i}", "--data-dir", os.path.join(self.etcd_dir, f"etcd{i}"),
                "--listen-client-urls", url, "--advertise-client-urls", url,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", initial, "--initial-cluster-token", token,
                "--initial-cluster-state", "new",
                "--heartbeat-interval", "100", "--election-timeout", "1000",
            ]))
        for m in self.members:
            m.wait_for(r"ready to serve client requests|serving client traffic", 60)
        # Every kiln process is given all three members.
        self.etcd_url = ",".join(self.member_urls)
        self.nodes = {}
        self.controls = {}
        self.api_key = None

    def status(self, i: int) -> dict:
        return post(self.member_urls[i], "/v3/maintenance/status", {}, {}, timeout=5)[1]

    def leader(self) -> int:
        """The index of the member that leads now."""
        deadline = time.time() + 30
        while time.time() < deadline:
            for i, m in enumerate(self.members):
                if m.proc.poll() is not None:
                    continue
                try:
                    s = self.status(i)
                except OSError:
                    continue
                if s.get("leader") and s["leader"] == s["header"]["member_id"]:
                    return i
            time.sleep(0.2)
        pytest.fail("the etcd members elected no leader")


def start_node(c: Cluster, name: str, *extra):
    """A node as the issue's cluster runs it (default lease TTL)."""
    state = os.path.join(c.base, name, "state")
    p = c.spawn(name, [kiln_bin(), "node", *c.join(), "--name", name,
                       "--no-prepare", "--listen", "127.0.0.1:0", "--state-dir", state, *extra])
    p.state_dir = state
    p.wait_for(r"node \S+ listening on http://")
    c.nodes[name] = p
    return p


def run_cluster(make, body):
    base = tempfile.mkdtemp(prefix="kiln-clfail-")
    c = None
    try:
        c = make(base)
        body(c)
    finally:
        finish(c, base)


def test_service_continues_when_an_etcd_member_dies():
    from e2b import Sandbox

    def body(c: EtcdTrio):
        node = start_node(c, "n1")
        c.start_control("c1")
        before = Sandbox.create(timeout=120, **c.opts("c1"))
        assert before.commands.run("echo before").stdout.strip() == "before"
        victim = c.leader()
        c.members[victim].kill9()
        left = [i for i in range(3) if i != victim]
        # The two members left elect a leader among themselves.
        assert c.leader() in left
        s = Sandbox.create(timeout=120, **c.opts("c1"))
        r = s.commands.run(f"echo after {s.sandbox_id}")
        assert r.exit_code == 0 and r.stdout.strip() == f"after {s.sandbox_id}"
        assert before.commands.run("echo still").stdout.strip() == "still"
        ids = {x["sandboxID"] for x in c.request("c1", "GET", "/sandboxes")[1]}
        assert {s.sandbox_id, before.sandbox_id} <= ids
        s.kill()
        before.kill()
        ids = {x["sandboxID"] for x in c.request("c1", "GET", "/sandboxes")[1]}
        assert not ids & {s.sandbox_id, before.sandbox_id}
        assert c.gone(node.state_dir, [s.sandbox_id, before.sandbox_id])
        # The node never lost its lease over the failover (it would have fenced itself).
        assert node.proc.poll() is None, node.log()[-4000:]

    run_cluster(EtcdTrio, body)


def test_a_node_restarted_within_its_grace_keeps_its_sandboxes():
    from e2b import Sandbox

    from .test_server_cluster_snapshots import on_node

    def make(base):
        c = Cluster(base)
        c.start_node("n1", ["--restart-grace", "60"])
        c.start_node("n2", ["--restart-grace", "1"])
        c.start_control("c1")
        return c

    def body(c: Cluster):
        made = []
        kept = on_node(c, "n1", "c1", made)
        lost = on_node(c, "n2", "c1", made)
        kept.files.write("/home/user/notes.txt", "before the restart")
        kept.commands.run("sleep 600", background=True)
        # n1 stopped (SIGTERM) as an upgrade stops it: its sandbox keeps running, held by the
        # cluster well past the node's lease (3 s) and the leader's sweep.
        c.nodes["n1"].stop()
        assert "holds this node's running sandboxes" in c.nodes["n1"].log(), c.nodes["n1"].log()[-3000:]
        time.sleep(6)
        status, d = c.request("c1", "GET", f"/sandboxes/{kept.sandbox_id}")
        assert status == 200 and d["state"] == "running", d
        status, ev = c.request("c1", "GET", f"/events?sandboxId={kept.sandbox_id}&type=died")
        assert status == 200 and ev["events"] == [], ev
        # Meanwhile calls to it answer 503 saying why.
        status, err = post(c.controls["c1"].url, f"/sandboxes/{kept.sandbox_id}/timeout",
                           {"timeout": 300}, {"X-API-Key": c.api_key})
        assert status == 503 and "restarting" in err["message"], (status, err)
        # Its envd through the gateway (header mode) too.
        req = urllib.request.Request(c.controls["c1"].url + "/health", headers={
            "E2B-Sandbox-Id": kept.sandbox_id, "E2B-Sandbox-Port": "49983"})
        try:
            urllib.request.urlopen(req, timeout=30)
            raise AssertionError("envd answered through a restarting node")
        except urllib.error.HTTPError as e:
            status, err = e.code, json.loads(e.read())
        assert status == 503 and "restarting" in err["message"], (status, err)
        # Back on its state directory: the same sandbox, its files and its processes.
        c.start_node("n1", ["--restart-grace", "60"])
        assert c.nodes["n1"].wait_for("back within the restart grace")
        deadline, r = time.time() + 30, None
        while time.time() < deadline:
            try:
                r = Sandbox.connect(kept.sandbox_id, **c.opts("c1")).commands.run(
                    "cat /home/user/notes.txt; echo; pgrep -f 'sleep 600' >/dev/null && echo running")
                break
            except Exception:
                time.sleep(0.5)
        assert r is not None and r.stdout.split() == ["before", "the", "restart", "running"], r
        assert c.node_of(kept.sandbox_id) == "n1"
        # n2 stopped and not back within its grace of a second: its sandbox ends node-lost,
        # and n2 back later stops its copy.
        c.nodes["n2"].stop()
        deadline = time.time() + 30
        while time.time() < deadline:
            status, d = c.request("c1", "GET", f"/sandboxes/{lost.sandbox_id}")
            if status == 404:
                break
            time.sleep(0.3)
        assert status == 404, d
        status, ev = c.request("c1", "GET", f"/events?sandboxId={lost.sandbox_id}&type=died")
        assert status == 200 and "node-lost" in ev["events"][0]["detail"], ev
        back = c.start_node("n2", ["--restart-grace", "1"])
        assert c.gone(back.state_dir, [lost.sandbox_id])

    run_cluster(make, body)


def test_a_replica_killed_mid_create_leaves_one_sandbox_for_the_key():
    def make(base):
        c = Cluster(base)
        # No warm pool: every runsc container of the node is a create's.
        start_node(c, "n1", "--pool-off")
        c.start_control("a")
        c.start_control("b")
        return c

    def body(c: Cluster):
        node = c.nodes["n1"]
        key = "kill-mid-create-" + secrets.token_hex(4)
        create = {"templateID": "base", "timeout": 120, "metadata": {"idem": key}}
        headers = {"X-API-Key": c.api_key, "Idempotency-Key": key}
        first = {}

        def send():
            try:
                first["answer"] = post(c.controls["a"].url, "/sandboxes", create, headers)
            except OSError as e:
                first["error"] = e

        t = threading.Thread(target=send, daemon=True)
        t.start()
        # The create is in flight on the node once a runsc process of it exists: replica a
        # dies then, after forwarding and before answering.
        deadline = time.time() + 60
        while time.time() < deadline and not runsc_containers(node.state_dir):
            time.sleep(0.02)
        assert runsc_containers(node.state_dir), "the create never reached the node"
        c.controls["a"].kill9()
        t.join(timeout=30)
        assert "answer" not in first, f"replica a answered before it was killed: {first}"
        status, sbx = post(c.controls["b"].url, "/sandboxes", create, headers)
        assert status == 201, (status, sbx)
        # Whatever the node was doing for replica a is over once its sandboxes settle.
        time.sleep(5)
        status, lst = c.request("b", "GET", "/sandboxes")
        assert status == 200, lst
        mine = [x["sandboxID"] for x in lst if (x.get("metadata") or {}).get("idem") == key]
        assert mine == [sbx["sandboxID"]], (mine, sbx)
        assert runsc_containers(node.state_dir) == [sbx["sandboxID"]], runsc_containers(node.state_dir)
        assert node.log().count('event="created"') == 1, node.log()[-4000:]
        # The retry again: the same sandbox, replayed.
        status, again = post(c.controls["b"].url, "/sandboxes", create, headers)
        assert status == 201 and again["sandboxID"] == sbx["sandboxID"], again

    run_cluster(make, body)


def test_a_feature_a_cluster_lacks_says_so():
    def make(base):
        c = Cluster(base)
        c.start_control("c1")
        return c

    def body(c: Cluster):
        # Alerts and the audit log are read from the nodes: none yet, nothing to read.
        for path, key in (("/alerts", "alerts"), ("/audit", "records")):
            req = urllib.request.Request(c.controls["c1"].url + path, headers={"X-API-Key": c.api_key})
            with urllib.request.urlopen(req, timeout=30) as r:
                answer = json.loads(r.read())
            assert answer[key] == [] and answer["nextCursor"], answer
        # The Template API needs a node that runs the cluster's builds: none is in it yet.
        status, answer = post(c.controls["c1"].url, "/v3/templates", {"name": "t"},
                              {"X-API-Key": c.api_key})
        assert status == 501 and "--template-builds" in answer["message"], answer
        # A volume needs a node to keep it: none is in the cluster yet.
        status, answer = post(c.controls["c1"].url, "/volumes", {"name": "v"},
                              {"X-API-Key": c.api_key})
        assert status == 503 and "no node" in answer["message"], answer

    run_cluster(make, body)
