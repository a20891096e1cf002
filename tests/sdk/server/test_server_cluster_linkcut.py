"""A kiln node whose network link is cut (docs/cluster.md, issue 28): the node runs in a network
namespace of its own, joined to the host by a veth pair on 172.30.77.0/30 (a link inside this
machine); etcd serves clients on the host side of the pair as well as on 127.0.0.1, and the
control replica reaches the node at its side of the pair. Setting the host side of the link down
cuts the node off from etcd and from the replica: its lease expires, its running sandboxes end
`died: node-lost`, it fences itself (stops its sandboxes, exits 3), and once the link is back
nothing of it runs and the cluster does not bring its sandboxes back. A second node on 127.0.0.1
takes the creates meanwhile. Nothing here leaves this machine.

Needs KILN_BIN, the base template, runsc, etcd and root (network namespaces).
"""

import os
import secrets
import subprocess
import tempfile
import time

import pytest

from .conftest import kiln_bin, runsc_processes_for
from .test_server_cluster import Cluster, Proc, finish

HOST_IP, NODE_IP = "172.30.77.1", "172.30.77.2"


def ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class Link:
    """A network namespace joined to the host by a veth pair (host side `host_dev` at
    `host_ip`, the namespace's side at `node_ip`, one /30)."""

    def __init__(self, host_ip: str = HOST_IP, node_ip: str = NODE_IP):
        tag = secrets.token_hex(3)
        self.ns, self.host_dev = f"kiln-cut-{tag}", f"kcut{tag}"
        self.host_ip, self.node_ip = host_ip, node_ip
        ip("netns", "add", self.ns)
        ip("link", "add", self.host_dev, "type", "veth", "peer", "name", "uplink", "netns", self.ns)
        ip("addr", "add", f"{host_ip}/30", "dev", self.host_dev)
        ip("link", "set", self.host_dev, "up")
        ip("-n", self.ns, "addr", "add", f"{node_ip}/30", "dev", "uplink")
        ip("-n", self.ns, "link", "set", "uplink", "up")
        ip("-n", self.ns, "link", "set", "lo", "up")

    def set(self, up: bool):
        ip("link", "set", self.host_dev, "up" if up else "down")

    def remove(self):
        subprocess.run(["ip", "link", "del", self.host_dev], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)


class LinkCluster(Cluster):
    def start_node_in(self, link: Link, name: str, lease_ttl: int = 3) -> Proc:
        """`kiln node` inside `link`'s network namespace, reaching etcd over the link. Only
        the network namespace changes (`nsenter --net`): `ip netns exec` would also give it a
        mount namespace with a fresh /sys, hiding the cgroup file systems runsc needs."""
        state = os.path.join(self.base, name, "state")
        etcd = f"http://{link.host_ip}:{self.etcd_port}"
        p = self.spawn(name, ["nsenter", f"--net=/run/netns/{link.ns}", "--", kiln_bin(), "node",
                              "--etcd", etcd, "--etcd-prefix", self.prefix,
                              "--cluster-secret", self.secret, "--name", name, "--lease-ttl", str(lease_ttl),
                              "--no-prepare", "--listen", f"{link.node_ip}:0", "--state-dir", state])
        p.state_dir = state
        p.wait_for(r"node \S+ listening on http://")
        self.nodes[name] = p
        return p


@pytest.fixture
def cut_cluster():
    base = tempfile.mkdtemp(prefix="kiln-cluster-cut-")
    link, c = None, None
    try:
        link = Link()
        c = LinkCluster(base, extra_etcd_hosts=[HOST_IP])
        c.link = link
        c.start_node_in(link, "far")
        c.start_control("c1")
        assert c.api_key, "the first control replica of an empty cluster makes the first API key"
        yield c
    finally:
        finish(c, base, *([link.remove] if link else []))


def test_a_node_cut_off_fences_itself_and_its_sandboxes_never_run_twice(cut_cluster):
    from e2b import Sandbox

    c = cut_cluster
    far = c.nodes["far"]
    sbxs = []
    try:
        # Only the far node is up: the sandbox lands there and answers through the gateway
        # (the replica reaching the node over the link).
        s = Sandbox.create(timeout=120, **c.opts("c1"))
        sbxs.append(s)
        assert c.node_of(s.sandbox_id) == "far"
        assert s.commands.run("echo over-the-link").stdout.strip() == "over-the-link"
        near = c.start_node("near")

        c.link.set(False)
        # Its lease (3 s) is gone: the cluster ends its running sandbox node-lost...
        deadline = time.time() + 45
        while True:
            status, page = c.request("c1", "GET", f"/events?type=died&sandboxID={s.sandbox_id}")
            assert status == 200, page
            if any("node-lost" in e["detail"] for e in page["events"]):
                break
            assert time.time() < deadline, f"no node-lost event for {s.sandbox_id}"
            time.sleep(0.3)
        assert c.request("c1", "GET", f"/sandboxes/{s.sandbox_id}")[0] == 404
        # ...and the node, cut off from etcd, fences itself: its sandbox stops, it exits 3.
        far.proc.wait(timeout=60)
        assert far.proc.returncode == 3, far.log()[-3000:]
        assert c.gone(far.state_dir, [s.sandbox_id])
        assert not runsc_processes_for(far.state_dir), runsc_processes_for(far.state_dir)

        # New sandboxes go to the node left, meanwhile and after the link is back.
        fresh = Sandbox.create(timeout=60, **c.opts("c1"))
        sbxs.append(fresh)
        assert c.node_of(fresh.sandbox_id) == "near"
        c.link.set(True)
        time.sleep(4)
        assert c.request("c1", "GET", f"/sandboxes/{s.sandbox_id}")[0] == 404
        listed = {x["sandboxID"] for x in c.request("c1", "GET", "/sandboxes")[1]}
        assert listed == {fresh.sandbox_id}, listed
        assert not runsc_processes_for(far.state_dir)
        assert fresh.commands.run("echo near").stdout.strip() == "near"
        assert near.proc.poll() is None
    finally:
        for x in sbxs:
            try:
                x.kill()
            except Exception:
                pass
