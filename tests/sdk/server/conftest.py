"""Fixtures for the kiln server end-to-end tests: a session-wide `kiln serve` on the base
template (`server`), fresh sandboxes (`sandbox`) and state dirs for a test's own servers
(`state_dir`). The server itself, its clean-up and the failed-test log hooks live in
tests/framework/server.py; they are imported here so that test modules keep importing them from
`.conftest` and pytest registers the hooks.

Needs KILN_BIN (the kiln binary) and the base template already built (scripts/test.sh does both).
"""

import os
import shutil
import tempfile
import time

import pytest

from framework.server import (  # noqa: F401  (re-exported to the test modules; hooks)
    KilnServer,
    cleanup_state,
    kiln_bin,
    mounts_under,
    net_prefix,
    own_server,
    pytest_runtest_makereport,
    pytest_runtest_setup,
    remove_net_slots,
    runsc_processes_for,
)


@pytest.fixture(scope="session")
def server():
    """A kiln server shared by the SDK tests (the e2b SDK reads E2B_* from the environment)."""
    base = tempfile.mkdtemp(prefix="kiln-sdk-")
    # KILN_SERVE_EXTRA_ARGS: extra `kiln serve` flags, e.g. `--template-dir base=/some/rootfs`
    # to run the suite against a hand-assembled rootfs.
    srv = KilnServer(os.path.join(base, "state"), os.environ.get("KILN_SERVE_EXTRA_ARGS", "").split())
    try:
        srv.start()
        status, templates, _ = srv.request("GET", "/templates")
        assert status == 200, templates
        if not any(t["templateID"] == "base" for t in templates):
            pytest.fail("the base template is not built: run `kiln template build base` first")
        saved = {k: os.environ.get(k) for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY", "E2B_DEBUG")}
        os.environ["E2B_API_URL"] = srv.url
        os.environ["E2B_SANDBOX_URL"] = srv.url
        os.environ["E2B_API_KEY"] = srv.api_key
        os.environ.pop("E2B_DEBUG", None)
        yield srv
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    finally:
        srv.kill_all_sandboxes()
        srv.stop()
        log = srv.log()
        print("---- kiln serve log (tail) ----\n" + log[-8000:])
        cleanup_state(srv.state_dir)
        shutil.rmtree(base, ignore_errors=True)
        assert "panicked" not in log, f"the server panicked:\n{log}"


@pytest.fixture
def state_dir():
    """A fresh state dir for a test's own `kiln serve` (one that restarts it, say); whatever the
    servers left in it is removed afterwards."""
    base = tempfile.mkdtemp(prefix="kiln-own-")
    state = os.path.join(base, "state")
    try:
        yield state
    finally:
        cleanup_state(state)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def sandbox(server):
    """A fresh sandbox from the base template, killed after the test."""
    from e2b import Sandbox

    sbx = Sandbox.create(timeout=120)
    try:
        yield sbx
    finally:
        try:
            sbx.kill()
        except Exception:
            pass


def kill_all(sandboxes):
    """Kills each of `sandboxes` on a test's way out, whatever state the test left it in."""
    for s in sandboxes:
        try:
            s.kill()
        except Exception:
            pass


def read_count(sbx, tries: int, pause: float, path: str = "/home/user/count") -> int:
    """The number a counter process in `sbx` keeps writing to `path` (`echo $i > path`), read
    again up to `tries` times `pause` seconds apart when caught between its truncate and its
    write."""
    for _ in range(tries):
        text = sbx.files.read(path).strip()
        if text.isdigit():
            return int(text)
        time.sleep(pause)
    pytest.fail(f"the counter file {path} never held a number")
