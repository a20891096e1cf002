"""schemathesis against the server's own openapi.json: generated requests (valid and invalid)
on every documented route must never get a 5xx, and the server must not crash.

The one 5xx allowed is 501, kiln's deliberate answer for an E2B feature it does not implement
(e.g. network options on a server without sandbox networking, `GET /sandboxes/metrics`).

Runs against a server of its own (so a crash is seen here and nowhere else) whose template
cache is empty: every generated create is answered without starting a sandbox, so the run
exercises the API's input handling, auth and routing, deterministically and in about a minute
(SCHEMATHESIS_MAX_EXAMPLES per operation, default 30; raise it by hand for a longer run). Real
sandboxes under the same routes are the lifecycle and tenancy tests' job.
"""

import os
import subprocess
import sys
import tempfile

import pytest

from .conftest import KilnServer, cleanup_state

MAX_EXAMPLES = int(os.environ.get("SCHEMATHESIS_MAX_EXAMPLES", "30"))


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
    saved = os.environ.get("KILN_CACHE_DIR")
    os.environ["KILN_CACHE_DIR"] = os.path.join(base, "empty-cache")
    try:
        srv.start()
        if saved is None:
            os.environ.pop("KILN_CACHE_DIR", None)
        else:
            os.environ["KILN_CACHE_DIR"] = saved
        status, templates, _ = srv.request("GET", "/templates")
        assert (status, templates) == (200, []), templates
        yield srv
    finally:
        if saved is None:
            os.environ.pop("KILN_CACHE_DIR", None)
        else:
            os.environ["KILN_CACHE_DIR"] = saved
        srv.kill_all_sandboxes()
        srv.stop()
        cleanup_state(srv.state_dir)


def test_no_server_errors_on_generated_requests(fuzzed_server):
    srv = fuzzed_server
    report = os.path.join(os.path.dirname(srv.state_dir), "report")
    config = os.path.join(os.path.dirname(srv.state_dir), "schemathesis.toml")
    with open(config, "w") as f:
        f.write('[checks.not_a_server_error]\nexpected-statuses = ["1XX", "2XX", "3XX", "4XX", "501"]\n')
    cmd = [
        schemathesis_bin(), "--config-file", config, "run", f"{srv.url}/openapi.json",
        "--checks", "not_a_server_error",
        "--max-examples", str(MAX_EXAMPLES),
        "--header", f"X-API-Key: {srv.api_key}",
        "--workers", "2",
        "--request-timeout", "60",
        "--seed", os.environ.get("SCHEMATHESIS_SEED", "1"),
        "--phases", "examples,coverage,fuzzing",
        "--suppress-health-check", "all",
        # `follow=true` streams audit records until the client leaves (by design): a
        # generic fuzzer waits for the end of the body. test_server_audit covers these routes.
        "--exclude-path-regex", r"^/audit$|^/sandboxes/\{sandboxID\}/audit$",
        "--report", "junit", "--report-dir", report,
    ]
    env = {**os.environ, "NO_COLOR": "1", "SCHEMATHESIS_TELEMETRY": "false"}
    try:
        # Its own working directory: schemathesis keeps a crash cache in `.schemathesis/`.
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env,
                           cwd=os.path.dirname(srv.state_dir))
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
