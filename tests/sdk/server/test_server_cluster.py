"""A kiln cluster on this machine (docs/cluster.md): a one-member etcd, two `kiln node`
processes (own state dirs, sandbox network off) and two `kiln control` replicas, driven through
the pinned e2b SDK against a replica: creates land on both nodes, commands, files and metrics go
through the gateway to the owning node, the other replica sees and reaches the same sandboxes, a
node killed with SIGKILL has its running sandboxes end as `died: node-lost` while creates go to
the node left; a drained node (`kiln node drain`) takes no new sandboxes; creates racing through
two replicas never take a team past its quota. All on 127.0.0.1, stopped and removed after.

Needs KILN_BIN, the base template, runsc, and etcd (Debian's etcd-server, or KILN_ETCD).
"""

import http.server
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request

import pytest

from .conftest import cleanup_state, kiln_bin, runsc_processes_for

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def etcd_binary() -> str:
    b = os.environ.get("KILN_ETCD") or shutil.which("etcd")
    if not b:
        pytest.fail("no etcd binary (Debian's etcd-server; or set KILN_ETCD)")
    return b


class Proc:
    """One process of the cluster, its output in a log file."""

    def __init__(self, name: str, argv: list, log_dir: str):
        self.name = name
        self.log_path = os.path.join(log_dir, name + ".log")
        self.proc = subprocess.Popen(
            argv, stdout=open(self.log_path, "a"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "KILN_LOG": os.environ.get("KILN_LOG", "info"), "NO_COLOR": "1",
                 "KILN_TEMPLATE_GC_STORE": "off"},
        )

    def log(self) -> str:
        try:
            return open(self.log_path).read()
        except OSError:
            return ""

    def wait_for(self, pattern: str, timeout: float = 60) -> re.Match:
        deadline = time.time() + timeout
        while time.time() < deadline:
            m = re.search(pattern, self.log())
            if m:
                return m
            if self.proc.poll() is not None:
                pytest.fail(f"{self.name} exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            time.sleep(0.05)
        pytest.fail(f"{self.name}: no {pattern!r} within {timeout}s:\n{self.log()[-4000:]}")

    def kill9(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill9()


class Cluster:
    def __init__(self, base: str, extra_etcd_hosts=()):
        """`extra_etcd_hosts`: more local addresses etcd serves clients on (beside 127.0.0.1),
        for nodes in network namespaces of their own."""
        self.base = base
        self.procs = []
        self.secret = secrets.token_hex(16)
        self.prefix = "/kiln-test-" + secrets.token_hex(4)
        port, peer = free_port(), free_port()
        self.etcd_port = port
        self.etcd_url = f"http://127.0.0.1:{port}"
        listen = ",".join([self.etcd_url] + [f"http://{h}:{port}" for h in extra_etcd_hosts])
        # etcd's data in memory: on a host busy writing sandboxes' disks, its fsyncs stall for
        # seconds and leases it cannot renew in time fence nodes (docs/cluster.md, Running it).
        self.etcd_dir = tempfile.mkdtemp(prefix="kiln-etcd-", dir="/dev/shm")
        self.etcd = self.spawn("etcd", [
            etcd_binary(), "--name", "m0", "--data-dir", self.etcd_dir,
            "--listen-client-urls", listen, "--advertise-client-urls", self.etcd_url,
            "--listen-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", f"m0=http://127.0.0.1:{peer}",
            "--heartbeat-interval", "100", "--election-timeout", "1000",
        ])
        self.etcd.wait_for(r"ready to serve client requests|serving client traffic", 30)
        self.nodes = {}
        self.controls = {}
        self.api_key = None

    def join(self) -> list:
        return ["--etcd", self.etcd_url, "--etcd-prefix", self.prefix, "--cluster-secret", self.secret]

    def spawn(self, name: str, argv: list) -> Proc:
        p = Proc(name, argv, self.base)
        self.procs.append(p)
        return p

    def start_node(self, name: str, extra=()) -> Proc:
        state = os.path.join(self.base, name, "state")
        p = self.spawn(name, [kiln_bin(), "node", *self.join(), "--name", name, "--lease-ttl", "3",
                              "--no-prepare", "--listen", "127.0.0.1:0", "--state-dir", state,
                              *extra])
        p.state_dir = state
        p.wait_for(r"node \S+ listening on http://")
        self.nodes[name] = p
        return p

    def start_control(self, name: str, extra=()) -> Proc:
        p = self.spawn(name, [kiln_bin(), "control", *self.join(), "--replica", name,
                              "--listen", "127.0.0.1:0", "--leader-ttl", "3", "--webhook-allow-private",
                              *extra])
        p.wait_for(r"SDK settings")
        p.url = re.search(r"listening on (http://[0-9.:]+)", p.log()).group(1)
        k = re.search(r"first API key \(shown once, store it now\): (e2b_[0-9a-f]+)", p.log())
        if k:
            self.api_key = k.group(1)
        self.controls[name] = p
        return p

    def opts(self, control: str) -> dict:
        url = self.controls[control].url
        return {"api_key": self.api_key, "api_url": url, "sandbox_url": url}

    def request(self, control: str, method: str, path: str):
        req = urllib.request.Request(self.controls[control].url + path, method=method,
                                     headers={"X-API-Key": self.api_key})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                status, payload = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, payload = e.code, e.read()
        return status, (json.loads(payload) if payload else None)

    def node_of(self, sandbox_id: str) -> str:
        """The node whose runsc runs the sandbox (None: none)."""
        for name, n in self.nodes.items():
            if n.proc.poll() is None and any(sandbox_id in c for c in runsc_processes_for(n.state_dir)):
                return name
        return None

    def gone(self, state_dir: str, ids, timeout: float = 60) -> bool:
        """Whether no runsc process of `state_dir` names any of `ids` for a second on end
        (a detached kill's teardown runs a little after the answer)."""
        deadline, clear_since = time.time() + timeout, None
        while time.time() < deadline:
            if any(i in c for c in runsc_processes_for(state_dir) for i in ids):
                clear_since = None
            elif clear_since is None:
                clear_since = time.time()
            elif time.time() - clear_since >= 1:
                return True
            time.sleep(0.2)
        return False

    def teardown(self):
        for c in self.controls.values():
            if c.proc.poll() is None and self.api_key:
                try:
                    status, lst = self.request(c.name, "GET", "/sandboxes")
                    for s in lst if status == 200 else []:
                        self.request(c.name, "DELETE", f"/sandboxes/{s['sandboxID']}")
                except Exception as e:
                    print(f"cleanup: {e}")
                break
        for p in reversed(self.procs):
            p.stop()
        for name, p in self.nodes.items():
            print(f"---- {name} log (tail) ----\n" + p.log()[-4000:])
            cleanup_state(p.state_dir)
        for name, p in self.controls.items():
            print(f"---- {name} log (tail) ----\n" + p.log()[-4000:])
        shutil.rmtree(self.etcd_dir, ignore_errors=True)


def finish(c, base: str, *after):
    """Ends a test's cluster `c` (None when making it failed): its sandboxes killed and its
    processes stopped, then each of `after` called (what the test started beside it), then
    `base` removed; no kiln process of it may have panicked."""
    logs = ""
    if c:
        c.teardown()
        logs = "".join(p.log() for p in c.procs if not p.name.startswith("etcd"))
    for stop in after:
        stop()
    shutil.rmtree(base, ignore_errors=True)
    assert "panicked" not in logs, logs[-8000:]


@pytest.fixture(scope="module")
def cluster():
    base = tempfile.mkdtemp(prefix="kiln-cluster-")
    c = None
    try:
        c = Cluster(base)
        c.start_node("n1")
        c.start_node("n2")
        c.start_control("c1")
        c.start_control("c2")
        assert c.api_key, "the first control replica of an empty cluster makes the first API key"
        yield c
    finally:
        finish(c, base)


def test_creates_spread_over_nodes_and_run_through_the_gateway(cluster):
    from e2b import Sandbox

    sbxs = [Sandbox.create(timeout=120, **cluster.opts("c1")) for _ in range(4)]
    try:
        homes = {s.sandbox_id: cluster.node_of(s.sandbox_id) for s in sbxs}
        assert set(homes.values()) == {"n1", "n2"}, homes
        for s in sbxs:
            r = s.commands.run(f"echo hello from {s.sandbox_id}")
            assert r.exit_code == 0 and r.stdout.strip() == f"hello from {s.sandbox_id}"
            s.files.write("/tmp/cluster.txt", f"data of {s.sandbox_id}")
            assert s.files.read("/tmp/cluster.txt") == f"data of {s.sandbox_id}"
        # Port traffic in header mode reaches the sandbox's own port through its node.
        s = sbxs[0]
        s.commands.run("python3 -m http.server 8000 --directory /tmp >/dev/null 2>&1", background=True)
        host = s.get_host(8000)
        req = urllib.request.Request(cluster.controls["c1"].url + "/cluster.txt",
                                     headers={"E2b-Sandbox-Id": s.sandbox_id, "E2b-Sandbox-Port": "8000"})
        body = None
        for _ in range(50):
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    body = r.read().decode()
                    break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.2)
        assert body == f"data of {s.sandbox_id}", (host, body)
        # And by host name (`{port}-{id}.<domain>`), as `get_host` gives it.
        req = urllib.request.Request(cluster.controls["c1"].url + "/cluster.txt", headers={"Host": host})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.read().decode() == f"data of {s.sandbox_id}"
        # Killed through the API: gone from the list and from its node.
        victim = sbxs.pop()
        victim.kill()
        ids = {x["sandboxID"] for x in cluster.request("c1", "GET", "/sandboxes")[1]}
        assert victim.sandbox_id not in ids
        assert {s.sandbox_id for s in sbxs} <= ids
        assert all(cluster.gone(n.state_dir, [victim.sandbox_id]) for n in cluster.nodes.values())
    finally:
        for s in sbxs:
            s.kill()


def test_a_second_replica_sees_and_reaches_the_same_sandboxes(cluster):
    from e2b import Sandbox

    s = Sandbox.create(timeout=120, **cluster.opts("c1"))
    try:
        status, lst = cluster.request("c2", "GET", "/sandboxes")
        assert status == 200 and s.sandbox_id in {x["sandboxID"] for x in lst}
        other = Sandbox.connect(s.sandbox_id, **cluster.opts("c2"))
        s.files.write("/tmp/x", "written through c1")
        assert other.files.read("/tmp/x") == "written through c1"
        assert other.commands.run("cat /tmp/x").stdout == "written through c1"
        other.set_timeout(200)
        info = Sandbox.get_info(s.sandbox_id, **cluster.opts("c1"))
        assert info.sandbox_id == s.sandbox_id
        # Its metrics, sampled by its node, through either replica (one by id, one in bulk).
        deadline, samples = time.time() + 20, []
        while not samples and time.time() < deadline:
            samples = other.get_metrics()
            time.sleep(0.5)
        assert samples and samples[-1].mem_total > 0 and samples[-1].cpu_count >= 1, samples
        status, bulk = cluster.request("c1", "GET", f"/sandboxes/metrics?sandbox_ids={s.sandbox_id}")
        assert status == 200 and bulk["sandboxes"][s.sandbox_id]["memTotal"] > 0, bulk
    finally:
        s.kill()
    status, _ = cluster.request("c2", "GET", f"/sandboxes/{s.sandbox_id}")
    assert status == 404


def test_pause_and_connect_through_different_replicas(cluster):
    from e2b import Sandbox

    s = Sandbox.create(timeout=120, **cluster.opts("c1"))
    sid = s.sandbox_id
    try:
        home = cluster.node_of(sid)
        s.files.write("/home/user/notes.txt", "before the pause")
        assert Sandbox.pause(sid, **cluster.opts("c2")) is True
        assert Sandbox.pause(sid, **cluster.opts("c1")) is False, "a second pause is a 409 from the node"
        status, detail = cluster.request("c1", "GET", f"/sandboxes/{sid}")
        assert status == 200 and detail["state"] == "paused", detail
        status, lst = cluster.request("c2", "GET", "/v2/sandboxes?state=paused")
        assert status == 200 and sid in {x["sandboxID"] for x in lst}, lst
        again = Sandbox.connect(sid, timeout=120, **cluster.opts("c1"))
        assert cluster.request("c2", "GET", f"/sandboxes/{sid}")[1]["state"] == "running"
        assert again.files.read("/home/user/notes.txt") == "before the pause"
        assert again.commands.run("echo resumed").stdout.strip() == "resumed"
        assert cluster.node_of(sid) == home, "resumed on the node that holds its checkpoint"
    finally:
        Sandbox.kill(sid, **cluster.opts("c2"))


def test_fork_children_run_beside_their_parent(cluster):
    from e2b import Sandbox

    s = Sandbox.create(timeout=120, **cluster.opts("c1"))
    ids = [s.sandbox_id]
    try:
        s.files.write("/home/user/state.txt", "the parent's")
        req = urllib.request.Request(cluster.controls["c1"].url + f"/sandboxes/{s.sandbox_id}/fork",
                                     method="POST", data=json.dumps({"count": 2}).encode(),
                                     headers={"X-API-Key": cluster.api_key, "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            assert r.status == 201
            children = [c["sandbox"]["sandboxID"] for c in json.loads(r.read())]
        ids += children
        assert len(children) == 2
        listed = {x["sandboxID"] for x in cluster.request("c2", "GET", "/sandboxes")[1]}
        assert set(ids) <= listed
        for cid in children:
            assert cluster.node_of(cid) == cluster.node_of(s.sandbox_id)
            child = Sandbox.connect(cid, **cluster.opts("c2"))
            assert child.files.read("/home/user/state.txt") == "the parent's"
    finally:
        for i in ids:
            Sandbox.kill(i, **cluster.opts("c1"))


def kiln_node(cluster, *args) -> str:
    """`kiln node <args>` against the cluster's etcd; its output."""
    r = subprocess.run([kiln_bin(), "node", *args, "--etcd", cluster.etcd_url, "--etcd-prefix", cluster.prefix],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_a_drained_node_takes_no_new_sandboxes(cluster):
    from e2b import Sandbox

    sbxs = []
    try:
        on_n1 = []
        for _ in range(10):
            sbxs.append(Sandbox.create(timeout=120, **cluster.opts("c1")))
            on_n1 = [s for s in sbxs if cluster.node_of(s.sandbox_id) == "n1"]
            if len(on_n1) == 2:
                break
        assert len(on_n1) == 2, [cluster.node_of(s.sandbox_id) for s in sbxs]
        stay, paused = on_n1
        paused.files.write("/tmp/kept.txt", "kept on n1")
        assert Sandbox.pause(paused.sandbox_id, **cluster.opts("c2")) is True
        out = kiln_node(cluster, "drain", "n1")
        assert "node n1 is now draining" in out, out
        assert paused.sandbox_id in out.split("paused sandbox(es)")[1], out
        assert "the others stay and resume on it" in out, "no object store here: it resumes on n1"
        assert stay.sandbox_id in out.split("running sandbox(es)")[1].split("\n")[0], out
        # New sandboxes go to n2 only, through either replica.
        time.sleep(0.5)
        fresh = [Sandbox.create(timeout=60, **cluster.opts(c)) for c in ("c1", "c2", "c1", "c2")]
        sbxs += fresh
        assert {cluster.node_of(s.sandbox_id) for s in fresh} == {"n2"}
        # What runs on n1 keeps running; its paused sandbox resumes there with its files.
        assert stay.commands.run("echo still").stdout.strip() == "still"
        again = Sandbox.connect(paused.sandbox_id, timeout=120, **cluster.opts("c1"))
        assert again.files.read("/tmp/kept.txt") == "kept on n1"
        assert cluster.node_of(paused.sandbox_id) == "n1"
        # A fork's children would run on the draining node: refused.
        req = urllib.request.Request(cluster.controls["c2"].url + f"/sandboxes/{paused.sandbox_id}/fork",
                                     method="POST", data=json.dumps({"count": 1}).encode(),
                                     headers={"X-API-Key": cluster.api_key, "Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=60)
        assert e.value.code == 409 and b"draining" in e.value.read()
        assert "was already draining" in kiln_node(cluster, "drain", "n1")
        # Undrained, n1 takes sandboxes again (it runs fewer, so it is the better home).
        assert "node n1 takes new sandboxes" in kiln_node(cluster, "undrain", "n1")
        time.sleep(0.5)
        homes = []
        for _ in range(6):
            s = Sandbox.create(timeout=60, **cluster.opts("c2"))
            sbxs.append(s)
            homes.append(cluster.node_of(s.sandbox_id))
            if "n1" in homes:
                break
        assert "n1" in homes, homes
    finally:
        kiln_node(cluster, "undrain", "n1")
        for s in sbxs:
            try:
                s.kill()
            except Exception:
                pass


class Receiver(http.server.BaseHTTPRequestHandler):
    got = []  # (event type, sandboxID)
    lock = threading.Lock()

    def do_POST(self):
        payload = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
        with Receiver.lock:
            Receiver.got.append((payload["type"], payload.get("event", {}).get("sandboxID")))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_webhooks_hear_what_the_nodes_did(cluster):
    from e2b import Sandbox

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/hook"
        req = urllib.request.Request(cluster.controls["c2"].url + "/webhooks", method="POST",
                                     data=json.dumps({"url": url, "secret": "cluster-hook-secret-0123"}).encode(),
                                     headers={"X-API-Key": cluster.api_key, "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            hid = json.loads(r.read())["id"]
        s = Sandbox.create(timeout=60, **cluster.opts("c1"))
        s.kill()
        deadline = time.time() + 30
        while time.time() < deadline:
            with Receiver.lock:
                kinds = {t.removeprefix("sandbox.") for (t, sid) in Receiver.got if sid == s.sandbox_id}
            if {"created", "killed"} <= kinds:
                break
            time.sleep(0.2)
        assert {"created", "killed"} <= kinds, Receiver.got
        req = urllib.request.Request(cluster.controls["c1"].url + f"/webhooks/{hid}", method="DELETE",
                                     headers={"X-API-Key": cluster.api_key})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 204
    finally:
        httpd.shutdown()


def test_a_killed_node_loses_its_sandboxes_and_creates_go_elsewhere(cluster):
    from e2b import Sandbox

    sbxs = []
    for _ in range(8):
        sbxs.append(Sandbox.create(timeout=120, **cluster.opts("c2")))
        if {cluster.node_of(s.sandbox_id) for s in sbxs} == {"n1", "n2"}:
            break
    try:
        on_n1 = [s.sandbox_id for s in sbxs if cluster.node_of(s.sandbox_id) == "n1"]
        on_n2 = [s.sandbox_id for s in sbxs if cluster.node_of(s.sandbox_id) == "n2"]
        assert on_n1 and on_n2, (on_n1, on_n2)
        cluster.nodes["n1"].kill9()
        # Lease TTL 3 s, then the leader's sweep: the running sandboxes of n1 end node-lost.
        deadline = time.time() + 30
        lost = set()
        while time.time() < deadline and lost != set(on_n1):
            status, page = cluster.request("c1", "GET", "/events?type=died&limit=1000")
            assert status == 200, page
            lost = {e["sandboxID"] for e in page["events"] if "node-lost" in e["detail"]}
            time.sleep(0.3)
        assert lost == set(on_n1), lost
        for c in ("c1", "c2"):
            ids = {x["sandboxID"] for x in cluster.request(c, "GET", "/sandboxes")[1]}
            assert not ids & set(on_n1), (c, ids)
            assert set(on_n2) <= ids, (c, ids)
        status, _ = cluster.request("c1", "GET", f"/sandboxes/{on_n1[0]}")
        assert status == 404
        # The survivors still work, and every new sandbox lands on n2.
        s2 = next(s for s in sbxs if s.sandbox_id == on_n2[0])
        assert s2.commands.run("echo alive").stdout.strip() == "alive"
        fresh = [Sandbox.create(timeout=60, **cluster.opts("c1")) for _ in range(2)]
        sbxs += fresh
        assert {cluster.node_of(s.sandbox_id) for s in fresh} == {"n2"}
        # n1 comes back on its state dir: what it adopts, the cluster ended; it stops them
        # instead of bringing them back.
        n1 = cluster.start_node("n1")
        assert cluster.gone(n1.state_dir, on_n1)
        assert cluster.request("c2", "GET", f"/sandboxes/{on_n1[0]}")[0] == 404
    finally:
        for s in sbxs:
            try:
                s.kill()
            except Exception:
                pass


def test_a_team_quota_holds_across_replicas_even_when_creates_race(cluster):
    from e2b import Sandbox

    sbxs = [Sandbox.create(timeout=60, **cluster.opts("c1"))]
    live = len(cluster.request("c1", "GET", "/sandboxes")[1])
    quota = ["--team-max-sandboxes", str(live + 2)]
    c3, c4 = cluster.start_control("c3-quota", quota), cluster.start_control("c4-quota", quota)

    def create(url: str, out: list):
        req = urllib.request.Request(url + "/sandboxes", method="POST",
                                     data=json.dumps({"templateID": "base", "timeout": 60}).encode(),
                                     headers={"X-API-Key": cluster.api_key, "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                out.append((r.status, json.loads(r.read())))
        except urllib.error.HTTPError as e:
            out.append((e.code, e.read()))

    try:
        # Six creates at once, three through each quota replica; the team's sandboxes made
        # through c1 count too: two places are left, and two creates get them.
        answers = []
        racing = [threading.Thread(target=create, args=((c3, c4)[i % 2].url, answers)) for i in range(6)]
        for t in racing:
            t.start()
        for t in racing:
            t.join(timeout=150)
        made = [a for s, a in answers if s == 201]
        sbxs += [Sandbox.connect(a["sandboxID"], **cluster.opts("c1")) for a in made]
        refused = [a for s, a in answers if s == 429]
        assert (len(made), len(refused)) == (2, 4), answers
        assert all(b"quota" in a for a in refused), refused
        assert len(cluster.request("c2", "GET", "/sandboxes")[1]) == live + 2
        # One ends: its place is free again, through either replica.
        sbxs.pop().kill()
        s = Sandbox.create(timeout=60, **cluster.opts("c3-quota"))
        sbxs.append(s)
        assert s.commands.run("echo via c3").stdout.strip() == "via c3"
        out = []
        create(c4.url, out)
        assert out[0][0] == 429, out
    finally:
        for s in sbxs:
            s.kill()
        c3.stop()
        c4.stop()


def etcd_json(cluster, path: str, body: dict) -> dict:
    """A call to etcd's JSON gateway."""
    req = urllib.request.Request(cluster.etcd_url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def test_a_node_whose_lease_is_gone_fences_itself(cluster):
    import base64

    from e2b import Sandbox

    n3 = cluster.start_node("n3")
    sbxs, on_n3 = [], None
    try:
        for _ in range(10):
            s = Sandbox.create(timeout=120, **cluster.opts("c1"))
            sbxs.append(s)
            if cluster.node_of(s.sandbox_id) == "n3":
                on_n3 = s
                break
        assert on_n3, "no create landed on the new node"
        assert on_n3.commands.run("echo before").stdout.strip() == "before"
        key = base64.b64encode(f"{cluster.prefix}/nodes/n3".encode()).decode()
        kvs = etcd_json(cluster, "/v3/kv/range", {"key": key})["kvs"]
        etcd_json(cluster, "/v3/lease/revoke", {"ID": kvs[0]["lease"]})
        # The node hears its lease is gone, stops its sandboxes and exits with 3.
        n3.proc.wait(timeout=60)
        assert n3.proc.returncode == 3, n3.log()[-3000:]
        assert cluster.gone(n3.state_dir, [on_n3.sandbox_id])
        # Its warm pool went with it: nothing of n3 runs on the host.
        assert cluster.gone(n3.state_dir, [n3.state_dir]), runsc_processes_for(n3.state_dir)
        deadline = time.time() + 30
        while time.time() < deadline:
            status, page = cluster.request("c2", "GET", f"/events?type=died&sandboxID={on_n3.sandbox_id}")
            if any("node-lost" in e["detail"] for e in page["events"]):
                break
            time.sleep(0.3)
        else:
            pytest.fail(f"no node-lost event for {on_n3.sandbox_id}")
        assert cluster.request("c1", "GET", f"/sandboxes/{on_n3.sandbox_id}")[0] == 404
    finally:
        for s in sbxs:
            try:
                s.kill()
            except Exception:
                pass
