"""What a `kill -9`ed kiln server leaves on the host (network namespaces `kXXXX-*`, host veths,
the nftables table `kiln_kXXXX`, its claim in /run/kiln-net) is removed by the next kiln server
that starts, whatever its state directory and range — except the slot of a sandbox that
outlived the server (its own next start adopts it) or whose files are still there (a paused
sandbox restores into its slot), until that sandbox is gone too.

Real `kiln serve`, real runsc, real namespaces and nftables. Needs root."""

import os
import shutil
import signal
import subprocess
import tempfile
import time

import pytest
from e2b import Sandbox
from framework.skip import need_root

from .conftest import KilnServer, cleanup_state, mounts_under, net_prefix

RANGE_A = "10.162.0.0/24"
RANGE_B = "10.163.0.0/24"


def sh(*args, check=False):
    return subprocess.run(list(args), capture_output=True, text=True, check=check)


def leftovers(prefix: str) -> dict:
    """Everything of the server with `prefix` still on the host."""
    return {
        "netns": sorted(n for n in os.listdir("/run/netns") if n.startswith(prefix + "-")),
        "veths": sorted(d for d in os.listdir("/sys/class/net") if d.startswith(prefix + "h")),
        "table": sh("nft", "list", "table", "ip", f"kiln_{prefix}").returncode == 0,
        "claim": os.path.exists(f"/run/kiln-net/{prefix}.range"),
    }


SWEPT = "removed network slots that killed kiln servers left behind"


def swept_since(srv: KilnServer, offset: int, prefix: str) -> bool:
    """Whether the server's log, past `offset`, says it swept `prefix`."""
    lines = srv.log()[offset:].splitlines()
    return any(SWEPT in line and f'"{prefix}"' in line for line in lines)


def restart_and_wait_for_sweep(srv: KilnServer, prefix: str):
    srv.stop()
    offset = len(srv.log())
    srv.start()
    wait_for(lambda: swept_since(srv, offset, prefix), "the restarted server's sweep")


def wait_for(cond, what: str, timeout: float = 60):
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.fixture
def dirs():
    need_root("network namespaces and nftables")
    base = tempfile.mkdtemp(prefix="kiln-sweep-")
    a, b = os.path.join(base, "a"), os.path.join(base, "b")
    servers = []
    try:
        yield a, b, servers
    finally:
        for s in servers:
            s.kill_all_sandboxes()
            s.stop()
        for s in servers:
            print(f"---- {s.state_dir} log (tail) ----\n" + s.log()[-3000:])
        cleanup_state(a)
        cleanup_state(b)
        shutil.rmtree(base, ignore_errors=True)


def test_a_killed_servers_slots_are_swept_by_the_next_server(dirs):
    a, b, servers = dirs
    pa = net_prefix(a)
    # --pool-off: this test counts network slots; a warm pool's sandbox holds one.
    srv_a = KilnServer(a, ["--net-range", RANGE_A, "--net-pool", "2", "--pool-off"]).start()
    servers.append(srv_a)
    sbx = Sandbox.create(timeout=300, **srv_a.opts())
    # One slot leased to the sandbox, two kept ready.
    wait_for(lambda: len(leftovers(pa)["veths"]) == 3, "server A's three slots")
    srv_a.kill9()
    before = leftovers(pa)
    assert before["table"] and before["claim"] and len(before["netns"]) == 6, before
    sandbox_ns = [n for n in before["netns"] if n.endswith("s") and sh("ip", "netns", "pids", n).stdout.split()]
    assert len(sandbox_ns) == 1, f"the sandbox's namespace: {before}"
    kept = sandbox_ns[0][: -1]

    # Another server (other state, other range) sweeps A's idle slots, keeps the sandbox's.
    # (The pool starts, and sweeps, in the background of a listening server.)
    srv_b = KilnServer(b, ["--net-range", RANGE_B, "--net-pool", "1", "--pool-off"]).start()
    servers.append(srv_b)
    wait_for(lambda: swept_since(srv_b, 0, pa), "server B's sweep")
    after = leftovers(pa)
    assert after["netns"] == [kept + "r", kept + "s"], after
    assert len(after["veths"]) == 1 and after["table"], after

    # The sandbox's processes end but its files stay (as a paused sandbox's do, whose restore
    # needs its slot): the next sweep still keeps the slot.
    for pid in sh("ip", "netns", "pids", kept + "s").stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait_for(lambda: not sh("ip", "netns", "pids", kept + "s").stdout.split(), "the sandbox's processes to exit")
    restart_and_wait_for_sweep(srv_b, pa)
    assert leftovers(pa)["netns"] == [kept + "r", kept + "s"], leftovers(pa)

    # Its files gone too: the next start removes the rest.
    for mp in sorted(mounts_under(a), reverse=True):
        sh("umount", "-l", mp)
    shutil.rmtree(os.path.join(a, "gvisor", "sandboxes"))
    restart_and_wait_for_sweep(srv_b, pa)
    wait_for(lambda: not leftovers(pa)["claim"], "the end of server B's sweep")
    assert leftovers(pa) == {"netns": [], "veths": [], "table": False, "claim": False}
    assert not os.path.exists(f"/run/kiln-net/{pa}.lock")
    assert not os.path.exists(f"/run/kiln-net/{pa}.leases")
    del sbx
