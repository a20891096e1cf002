"""Small test "internets" for the SDK tests, built on this machine: a network namespace joined to
the host by a veth pair, hosts on documentation addresses (198.51.100.0/24 only) and a tiny
authoritative DNS server. Nothing here sends traffic anywhere else. Needs root."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

from framework.skip import need

# An authoritative DNS server: argv = bind address, JSON {name: ipv4} ("*.d" also answers every
# name under d), TTL. A records for known names, an empty NOERROR for their other types, NXDOMAIN
# for the rest.
DNS_SERVER = textwrap.dedent("""
    import json, socket, struct, sys
    names, ttl = json.loads(sys.argv[2]), int(sys.argv[3])
    def lookup(name):
        if name in names:
            return names[name]
        parts = name.split(".")
        for i in range(1, len(parts)):
            ip = names.get("*." + ".".join(parts[i:]))
            if ip:
                return ip
        return None
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((sys.argv[1], 53))
    while True:
        q, peer = s.recvfrom(512)
        i, labels = 12, []
        while q[i]:
            labels.append(q[i + 1:i + 1 + q[i]].decode().lower())
            i += 1 + q[i]
        question = q[12:i + 5]
        qtype = struct.unpack("!H", q[i + 1:i + 3])[0]
        ip = lookup(".".join(labels))
        if ip and qtype == 1:
            answer = b"\\xc0\\x0c" + struct.pack("!HHIH", 1, 1, ttl, 4) + socket.inet_aton(ip)
            head = q[:2] + b"\\x81\\x80" + struct.pack("!HHHH", 1, 1, 0, 0)
        else:
            answer = b""
            rcode = b"\\x81\\x80" if ip else b"\\x81\\x83"
            head = q[:2] + rcode + struct.pack("!HHHH", 1, 0, 0, 0)
        s.sendto(head + question + answer, peer)
""")


def sh(*args, check=True):
    return subprocess.run(list(args), capture_output=True, text=True, check=check)


# Fails the test when its condition is false, or skips it under KILN_ALLOW_SKIPS=1.
require = need


class NetNs:
    """A namespace `name` whose `eth0` pairs with the host's `host_dev`. `host_cidr` goes on the
    host side, each of `addrs` (CIDRs) inside; `default_via` routes the namespace's traffic back
    through the host. Processes started with `spawn` run inside and die with `down`."""

    def __init__(self, name: str, host_dev: str, host_cidr: str, addrs: list, default_via: str = None):
        self.name, self.host_dev, self.host_cidr = name, host_dev, host_cidr
        self.addrs, self.default_via = addrs, default_via
        self.procs = []

    def up(self):
        self.down()
        sh("ip", "netns", "add", self.name)
        sh("ip", "link", "add", self.host_dev, "type", "veth", "peer", "name", "eth0", "netns", self.name)
        sh("ip", "addr", "add", self.host_cidr, "dev", self.host_dev)
        sh("ip", "link", "set", self.host_dev, "up")
        for a in self.addrs:
            sh("ip", "-n", self.name, "addr", "add", a, "dev", "eth0")
        sh("ip", "-n", self.name, "link", "set", "eth0", "up")
        sh("ip", "-n", self.name, "link", "set", "lo", "up")
        if self.default_via:
            sh("ip", "-n", self.name, "route", "add", "default", "via", self.default_via)
        return self

    def resolver(self, nameserver: str):
        """Makes `ip netns exec` commands use `nameserver` (it binds /etc/netns/<name>/*)."""
        os.makedirs(f"/etc/netns/{self.name}", exist_ok=True)
        with open(f"/etc/netns/{self.name}/resolv.conf", "w") as f:
            f.write(f"nameserver {nameserver}\n")
        with open(f"/etc/netns/{self.name}/hosts", "w") as f:
            f.write("127.0.0.1 localhost\n")

    def spawn(self, *args, cwd=None) -> subprocess.Popen:
        p = subprocess.Popen(["ip", "netns", "exec", self.name, *args], cwd=cwd,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(p)
        return p

    def dns(self, bind: str, names: dict, ttl: int = 60) -> subprocess.Popen:
        return self.spawn(sys.executable, "-c", DNS_SERVER, bind, json.dumps(names), str(ttl))

    def down(self):
        for p in self.procs:
            p.kill()
            p.wait()
        self.procs = []
        sh("ip", "netns", "del", self.name, check=False)
        sh("ip", "link", "del", self.host_dev, check=False)
        shutil.rmtree(f"/etc/netns/{self.name}", ignore_errors=True)
