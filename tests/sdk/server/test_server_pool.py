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
