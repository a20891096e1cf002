"""Fixtures of the abuse tests: a real `kiln serve` (gVisor, base template) with small limits,
so that attacks hit them in seconds, and the real e2b SDK. The server and its clean-up come from
tests/framework (shared with the SDK tests), as do the hooks that keep a failed test's server log.
"""

import os
import shutil
import tempfile

import pytest

from framework.server import (  # noqa: F401  (hooks)
    KilnServer,
    cleanup_state,
    pytest_runtest_makereport,
    pytest_runtest_setup,
)

# Small on purpose: a fork bomb reaches the pids limit and a memory hog the memory size fast.
PIDS_LIMIT = 200
MEMORY_MB = 320
# A disk fill reaches the quota in seconds; /tmp is a tmpfs of half the memory.
DISK_MB = 256


@pytest.fixture(scope="session")
def server():
    base = tempfile.mkdtemp(prefix="kiln-abuse-")
    srv = KilnServer(
        os.path.join(base, "state"),
        ["--pids-limit", str(PIDS_LIMIT), "--memory-mb", str(MEMORY_MB),
         "--disk-mb", str(DISK_MB)],
    )
    try:
        srv.start()
        os.environ["E2B_API_URL"] = srv.url
        os.environ["E2B_SANDBOX_URL"] = srv.url
        os.environ["E2B_API_KEY"] = srv.api_key
        os.environ.pop("E2B_DEBUG", None)
        yield srv
    finally:
        srv.kill_all_sandboxes()
        srv.stop()
        log = srv.log()
        print("---- kiln serve log (tail) ----\n" + log[-8000:])
        cleanup_state(srv.state_dir)
        shutil.rmtree(base, ignore_errors=True)
        assert "panicked" not in log, f"the server panicked:\n{log}"


def _new(server):
    from e2b import Sandbox

    return Sandbox.create(timeout=120)


@pytest.fixture
def sandbox(server):
    sbx = _new(server)
    try:
        yield sbx
    finally:
        try:
            sbx.kill()
        except Exception:
            pass


@pytest.fixture
def bystander(server):
    """A second sandbox that must be unaffected by what the first one does."""
    sbx = _new(server)
    sbx.commands.run("echo before > /home/user/bystander.txt")
    try:
        yield sbx
    finally:
        try:
            sbx.kill()
        except Exception:
            pass


def assert_unharmed(bystander):
    r = bystander.commands.run("cat /home/user/bystander.txt; echo alive")
    assert r.stdout == "before\nalive\n"


def wait_gone(path: str, timeout: float = 30) -> bool:
    """A kill answers before its teardown ends (the runtime, mounts and files go in the
    background): waits until `path` is gone. Returns whether it went."""
    import time

    deadline = time.time() + timeout
    while os.path.exists(path) and time.time() < deadline:
        time.sleep(0.1)
    return not os.path.exists(path)
