"""schemathesis against the server's own openapi.json: generated requests (valid and invalid)
on every documented route must never get a 5xx, and the server must not crash.

Runs against a server of its own (so a crash is seen here and nowhere else) with at most two
sandboxes, its time bounded by SCHEMATHESIS_MAX_EXAMPLES per operation (default 15; raise it
by hand for a longer run).
"""

import os
import subprocess
import sys
import tempfile

import pytest

from .conftest import KilnServer, cleanup_state

MAX_EXAMPLES = int(os.environ.get("SCHEMATHESIS_MAX_EXAMPLES", "15"))


def schemathesis_bin() -> str:
    exe = os.path.join(os.path.dirname(sys.executable), "schemathesis")
    if not os.path.exists(exe):
        pytest.fail(
            f"schemathesis is not installed beside {sys.executable}: "
            "pip install -r tests/sdk/requirements.txt"
        )
    return exe


@pytest.fixture()
def fuzzed_server():
    base = tempfile.mkdtemp(prefix="kiln-st-")
    srv = KilnServer(os.path.join(base, "state"), ["--max-sandboxes", "2", "--default-timeout", "30"])
    try:
        yield srv.start()
    finally:
        srv.kill_all_sandboxes()
        srv.stop()
        cleanup_state(srv.state_dir)


def test_no_server_errors_on_generated_requests(fuzzed_server):
    srv = fuzzed_server
    report = os.path.join(os.path.dirname(srv.state_dir), "report")
    cmd = [
        schemathesis_bin(), "run", f"{srv.url}/openapi.json",
        "--checks", "not_a_server_error",
        "--max-examples", str(MAX_EXAMPLES),
        "--header", f"X-API-Key: {srv.api_key}",
        "--workers", "2",
        "--request-timeout", "60",
        "--seed", os.environ.get("SCHEMATHESIS_SEED", "1"),
        "--phases", "examples,coverage,fuzzing",
        "--suppress-health-check", "all",
        "--report", "junit", "--report-dir", report,
    ]
    env = {**os.environ, "NO_COLOR": "1", "SCHEMATHESIS_TELEMETRY": "false"}
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"schemathesis did not finish within 600 s:\n{e.stdout}")
    out = r.stdout + r.stderr
    # The server is still up and answering.
    assert srv.proc.poll() is None, f"kiln serve died during the run:\n{srv.log()[-4000:]}"
    status, _, _ = srv.request("GET", "/health")
    assert status == 200
    assert "panicked" not in srv.log(), srv.log()[-4000:]
    assert r.returncode == 0, f"schemathesis found failures:\n{out[-12000:]}"
    # It really tested something.
    assert "passed" in out, out[-4000:]
