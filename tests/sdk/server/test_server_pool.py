"""The warm pool through `kiln serve` and the e2b SDK: on by default (once a template was used,
a booted sandbox of it waits, unlisted, and stops with the server), `--pool-off` keeps none,
and a burst of 20 concurrent creates (each with its first command) all succeed."""

import os
import shutil
import tempfile
import threading
import time

from e2b import Sandbox

from .conftest import KilnServer, cleanup_state, runsc_processes_for


def booted(state_dir: str) -> int:
    """Sandboxes the server's driver holds (listed, pooled, or being stopped)."""
    try:
        return len(os.listdir(os.path.join(state_dir, "gvisor", "sandboxes")))
    except FileNotFoundError:
        return 0


def wait_for(cond, what: str, timeout: float = 60):
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, what
        time.sleep(0.1)


def test_pool_is_on_by_default_and_a_burst_of_20_creates_all_succeed():
    base = tempfile.mkdtemp(prefix="kpool-")
    state = os.path.join(base, "state")
    srv = KilnServer(state, ["--pool-idle", "5"]).start()
    try:
        # A template never used has no pool.
        time.sleep(0.5)
        assert booted(state) == 0
        first = Sandbox.create(timeout=120, **srv.opts())
        first.kill()
        # Used once: one sandbox waits in its pool, and it is nobody's (not listed).
        # (A kill answers before its teardown ends: the killed sandbox's directory goes later.)
        gone = lambda: not os.path.exists(os.path.join(state, "gvisor", "sandboxes", first.sandbox_id))
        wait_for(lambda: gone() and booted(state) == 1, "the pool did not fill after the first create")
        status, listed, _ = srv.request("GET", "/sandboxes")
        assert status == 200 and listed == []

        n, out, errors = 20, {}, []

        def one(i):
            try:
                sbx = Sandbox.create(timeout=120, **srv.opts())
                out[i] = (sbx, sbx.commands.run(f"echo burst-{i}").stdout)
            except Exception as e:  # noqa: BLE001 - every failure is reported below
                errors.append(f"{i}: {type(e).__name__}: {e}")

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert sorted(o for _, o in out.values()) == sorted(f"burst-{i}\n" for i in range(n))
        ids = {s.sandbox_id for s, _ in out.values()}
        assert len(ids) == n
        status, listed, _ = srv.request("GET", "/sandboxes")
        assert {s["sandboxID"] for s in listed} == ids
        for s, _ in out.values():
            s.kill()
        assert "from the warm pool" in srv.log()
        srv.stop()
        assert runsc_processes_for(state) == [], "pooled sandboxes stop with the server"
    finally:
        srv.kill_all_sandboxes()
        srv.stop()
        cleanup_state(state)
        shutil.rmtree(base, ignore_errors=True)


def test_pool_off_keeps_no_sandbox_ready():
    base = tempfile.mkdtemp(prefix="kpool-")
    state = os.path.join(base, "state")
    srv = KilnServer(state, ["--pool-off"]).start()
    try:
        sbx = Sandbox.create(timeout=120, **srv.opts())
        assert sbx.commands.run("echo cold").stdout == "cold\n"
        sbx.kill()
        wait_for(lambda: booted(state) == 0 and not runsc_processes_for(state),
                 "a sandbox was left running", timeout=15)
        time.sleep(1.5)
        assert booted(state) == 0, "--pool-off booted a sandbox ahead"
        assert "warm pool" not in srv.log()
    finally:
        srv.kill_all_sandboxes()
        srv.stop()
        cleanup_state(state)
        shutil.rmtree(base, ignore_errors=True)


def cpu_weight(sandbox_id: str):
    """(weight, default) of a sandbox's host cpu cgroup (v1 `cpu.shares`, v2 `cpu.weight`)."""
    for path, default in ((f"/sys/fs/cgroup/cpu/kiln/{sandbox_id}/cpu.shares", 1024),
                          (f"/sys/fs/cgroup/kiln/{sandbox_id}/cpu.weight", 100),
                          (f"/sys/fs/cgroup/unified/kiln/{sandbox_id}/cpu.weight", 100)):
        try:
            with open(path) as f:
                return int(f.read()), default
        except FileNotFoundError:
            continue
    raise AssertionError(f"sandbox {sandbox_id} has no cpu cgroup")


def cpu_quota(sandbox_id: str) -> str:
    for path in (f"/sys/fs/cgroup/cpu/kiln/{sandbox_id}/cpu.cfs_quota_us",
                 f"/sys/fs/cgroup/kiln/{sandbox_id}/cpu.max"):
        if os.path.exists(path):
            with open(path) as f:
                return f.read().split()[0]
    raise AssertionError(f"sandbox {sandbox_id} has no cpu limit")


def pooled_ids(state: str, listed: set) -> list:
    return [i for i in os.listdir(os.path.join(state, "gvisor", "sandboxes")) if i not in listed]


def test_a_pooled_sandbox_waits_on_leftover_cpu_and_gets_the_full_weight_when_claimed(monkeypatch):
    # A pool boot runs at the smallest CPU weight (the sandboxes at work come first), unless a
    # create waits for it; the create that claims a pooled sandbox gives it the normal weight
    # before its first request. The CPU limit (the sandbox's size) is the same either way.
    monkeypatch.setenv("KILN_LOG", "info,kiln_server::manager::pool=debug")
    base = tempfile.mkdtemp(prefix="kpool-")
    state = os.path.join(base, "state")
    srv = KilnServer(state, ["--pool", "base=4"]).start()
    try:
        # More creates at once than the pool holds and the boot slots (one a core, at least
        # two) serve together: those that find no pooled sandbox and no free slot wait, and the
        # pool's boots under way then (its first, or the refills of the first claims) or begun
        # while they wait run at the normal weight.
        out, errors = [], []

        def one():
            try:
                s = Sandbox.create(timeout=120, **srv.opts())
                out.append((s, s.commands.run("echo hi").stdout))
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(f"{type(e).__name__}: {e}")

        n = 4 + max(os.cpu_count() or 2, 2) + 2
        threads = [threading.Thread(target=one) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert [o for _, o in out] == ["hi\n"] * n
        assert "a create waits: pool boots run at the normal CPU weight" in srv.log()
        claimed = {s.sandbox_id for s, _ in out}
        for sid in claimed:
            weight, default = cpu_weight(sid)
            assert weight == default, f"claimed sandbox {sid} runs at weight {weight}"

        def full():
            ids = pooled_ids(state, claimed)
            return len(ids) == 4 and all(os.path.exists(f"/sys/fs/cgroup/cpu/kiln/{i}")
                                         or os.path.exists(f"/sys/fs/cgroup/kiln/{i}") for i in ids)

        # Nobody waits now: with the pool full, a create takes a pooled sandbox at once and
        # the pool's refill boots in the background.
        wait_for(full, "the pool did not refill to 4")
        before = set(pooled_ids(state, claimed))
        claimed.add(Sandbox.create(timeout=120, **srv.opts()).sandbox_id)
        wait_for(full, "the pool did not refill to 4 after a claim")
        time.sleep(1)
        later = [i for i in pooled_ids(state, claimed) if i not in before]
        assert later, "no sandbox was booted into the pool after the creates"
        for sid in later:
            weight, default = cpu_weight(sid)
            assert weight < default / 10, f"pooled sandbox {sid} waits at weight {weight}"

        # Claimed: the normal weight, the same CPU limit, and it works.
        quota = cpu_quota(later[0])
        sbx = None
        for _ in range(4):
            s = Sandbox.create(timeout=120, **srv.opts())
            if s.sandbox_id in later:
                sbx = s
                break
            claimed.add(s.sandbox_id)
        assert sbx is not None, "a create did not claim a background pooled sandbox"
        weight, default = cpu_weight(sbx.sandbox_id)
        assert weight == default
        assert cpu_quota(sbx.sandbox_id) == quota and int(quota) > 0
        assert sbx.commands.run("echo claimed").stdout == "claimed\n"
        # Paused and resumed, it runs in a new container at the default weight too.
        sbx.pause()
        again = Sandbox.connect(sbx.sandbox_id, timeout=120, **srv.opts())
        assert again.commands.run("echo resumed").stdout == "resumed\n"
        weight, default = cpu_weight(f"g1-{sbx.sandbox_id}")
        assert weight == default, f"the resumed sandbox runs at weight {weight}"
    finally:
        srv.kill_all_sandboxes()
        srv.stop()
        cleanup_state(state)
        shutil.rmtree(base, ignore_errors=True)
