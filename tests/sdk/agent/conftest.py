"""Fixtures for driving a host-process kiln-agent with the real e2b SDK (debug mode, the SDK
pointed at the agent's URL). Each test gets its own agent on a random port and a temp dir;
the agent is always killed afterwards."""

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request

import pytest
from packaging.version import Version

from e2b import AsyncSandbox, Sandbox
from e2b.connection_config import ConnectionConfig

# Must match kiln_proto::envd::ENVD_VERSION (the version the kiln server reports).
ENVD_VERSION = "0.6.4"


def _agent_bin() -> str:
    path = os.environ.get("KILN_AGENT_BIN")
    if not path:
        pytest.fail(
            "KILN_AGENT_BIN is not set: point it at a built kiln-agent binary "
            "(e.g. tgt/<dir>/x86_64-unknown-linux-gnu/release/kiln-agent)"
        )
    if not os.access(path, os.X_OK):
        pytest.fail(f"KILN_AGENT_BIN={path} is not an executable file")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Agent:
    def __init__(self, proc, port, workdir):
        self.proc = proc
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.workdir = workdir

    def http(self, method, path, body=None, headers=None):
        req = urllib.request.Request(self.url + path, data=body, method=method, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def init(self, **body):
        status, data = self.http(
            "POST", "/init", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        assert status == 204, (status, data)

    def sandbox(self, token=None, cls=Sandbox):
        headers = {"X-Access-Token": token} if token else {}
        config = ConnectionConfig(
            debug=True, sandbox_url=self.url, api_key="unused", extra_sandbox_headers=headers
        )
        return cls(
            sandbox_id="kiln-agent-test",
            sandbox_domain=None,
            envd_version=Version(ENVD_VERSION),
            envd_access_token=token,
            connection_config=config,
        )

    def async_sandbox(self, token=None) -> AsyncSandbox:
        return self.sandbox(token, cls=AsyncSandbox)


@pytest.fixture
def agent():
    binary = _agent_bin()
    workdir = tempfile.mkdtemp(prefix="kiln-agent-test-")
    os.chmod(workdir, 0o755)
    port = _free_port()
    sock = os.path.join(workdir, "agent.sock")
    log = open(os.path.join(workdir, "agent.log"), "wb")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--listen-unix", sock],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "KILN_AGENT_LOG": "info"},
    )
    a = Agent(proc, port, workdir)
    try:
        deadline = time.time() + 10
        while True:
            try:
                if a.http("GET", "/health")[0] == 204:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                log.flush()
                raise RuntimeError(
                    "kiln-agent did not become healthy: "
                    + open(os.path.join(workdir, "agent.log")).read()
                )
            time.sleep(0.02)
        yield a
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def sbx(agent) -> Sandbox:
    return agent.sandbox()
