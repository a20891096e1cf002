"""`kiln mcp` driven by the official MCP Python SDK client (PyPI `mcp`), over stdio (the client
spawns `kiln mcp`) and streamable HTTP (`kiln mcp --http`), against a real `kiln serve`.

The code-interpreter and desktop tools are tested once each, on a networked server of their own
(their services are sandbox ports reached through kiln's routing)."""

import asyncio
import base64
import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request

import httpx2
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from .conftest import kiln_bin
from .rich_support import ensure_template, need, png_size, start_net_server, stop_net_server

TOOLS = {"create_sandbox", "list_sandboxes", "kill_sandbox", "pause_sandbox", "resume_sandbox",
         "fork_sandbox", "run_command", "read_file", "write_file", "list_files", "upload_file",
         "download_file", "run_code", "desktop_screenshot", "desktop_click", "desktop_type",
         "desktop_key", "desktop_scroll"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class McpHttp:
    """A `kiln mcp --http` process in front of one kiln server."""

    def __init__(self, server):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        # No key of its own: every HTTP client brings one.
        env = {k: v for k, v in os.environ.items() if k not in ("KILN_API_KEY", "E2B_API_KEY")}
        env.update({"KILN_URL": server.url, "KILN_LOG": "warn"})
        self.proc = subprocess.Popen([kiln_bin(), "mcp", "--http", f"127.0.0.1:{self.port}"],
                                     env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
        deadline = time.time() + 30
        while time.time() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"kiln mcp --http exited: {self.proc.stderr.read().decode()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.05)
        pytest.fail("kiln mcp --http did not listen within 30 s")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        err = self.proc.stderr.read().decode()
        assert "panicked" not in err, err


def connect(server, transport: str, http: "McpHttp" = None, key: str = None,
            mode: str = "auto") -> Client:
    """A client of `kiln mcp`; mode "auto" settles on the current protocol (2026-07-28, no
    initialize), "legacy" on the initialize handshake (2025-11-25, with HTTP sessions)."""
    key = key or server.api_key
    if transport == "stdio":
        return Client(StdioServerParameters(
            command=kiln_bin(), args=["mcp"],
            env={"KILN_URL": server.url, "KILN_API_KEY": key, "KILN_LOG": "warn"}), mode=mode)
    client = httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"},
                                timeout=httpx2.Timeout(30, read=300))
    return Client(streamable_http_client(http.url, http_client=client), mode=mode)


@pytest.fixture(scope="module")
def mcp_http(server):
    h = McpHttp(server)
    try:
        yield h
    finally:
        h.stop()


def text_of(result) -> str:
    return "\n".join(c.text for c in result.content if getattr(c, "type", "") == "text")


async def call_ok(c: Client, tool: str, args: dict, **kw):
    r = await c.call_tool(tool, args, **kw)
    assert not r.is_error, f"{tool}: {text_of(r)}"
    return r


async def sandbox_round(server, transport, http, mode, version):
    async with connect(server, transport, http, mode=mode) as c:
        assert c.session.protocol_version == version
        listed = await c.list_tools()
        assert TOOLS <= {t.name for t in listed.tools}
        create = next(t for t in listed.tools if t.name == "create_sandbox")
        assert {"template", "timeout_secs", "allow_out", "deny_out"} <= set(create.input_schema["properties"])

        r = await call_ok(c, "create_sandbox", {"template": "base", "timeout_secs": 120,
                                                "metadata": {"via": f"mcp-{transport}"}})
        sid = r.structured_content["sandbox_id"]
        try:
            progress = []

            async def on_progress(p, total, message):
                progress.append(message or "")

            r = await call_ok(c, "run_command", {
                "sandbox_id": sid, "command": "echo hello-mcp; echo oops >&2; exit 3"},
                progress_callback=on_progress)
            s = r.structured_content
            assert (s["exit_code"], s["stdout"], s["stderr"]) == (3, "hello-mcp\n", "oops\n")
            assert "exit code 3" in text_of(r)
            assert any("hello-mcp" in m for m in progress), progress

            await call_ok(c, "write_file", {"sandbox_id": sid, "path": "/home/user/notes/a.txt",
                                            "content": "written over MCP\n"})
            r = await call_ok(c, "read_file", {"sandbox_id": sid, "path": "/home/user/notes/a.txt"})
            assert text_of(r) == "written over MCP\n"
            r = await call_ok(c, "list_files", {"sandbox_id": sid, "path": "/home/user/notes"})
            entries = r.structured_content["entries"]
            assert [(e["name"], e["type"]) for e in entries] == [("a.txt", "file")], entries

            res = await c.read_resource(f"kiln://sandbox/{sid}/file/home/user/notes/a.txt")
            assert res.contents[0].text == "written over MCP\n"
            res = await c.read_resource(f"kiln://sandbox/{sid}/file/home/user/notes")
            assert json.loads(res.contents[0].text)["entries"][0]["name"] == "a.txt"
            templates = await c.list_resource_templates()
            assert any("kiln://sandbox/" in t.uri_template for t in templates.resource_templates)
            resources = await c.list_resources()
            assert any(sid in r.uri for r in resources.resources)

            blob = bytes(range(256)) * 4
            await call_ok(c, "upload_file", {"sandbox_id": sid, "path": "/tmp/blob.bin",
                                             "content_base64": base64.b64encode(blob).decode()})
            r = await call_ok(c, "download_file", {"sandbox_id": sid, "path": "/tmp/blob.bin"})
            assert base64.b64decode(r.structured_content["content_base64"]) == blob

            # Bad arguments: a tool error naming the argument.
            r = await c.call_tool("run_command", {"sandbox_id": sid})
            assert r.is_error and "`command`" in text_of(r), text_of(r)
            assert r.structured_content["error"]["argument"] == "command"
            r = await c.call_tool("run_command", {"sandbox_id": sid, "command": "true",
                                                  "timeout_secs": "soon"})
            assert r.is_error and "`timeout_secs`" in text_of(r), text_of(r)
            r = await c.call_tool("read_file", {"sandbox_id": sid, "path": "relative.txt"})
            assert r.is_error and "`path`" in text_of(r), text_of(r)
            r = await c.call_tool("create_sandbox", {"template": "base", "colour": "red"})
            assert r.is_error and "`colour`" in text_of(r), text_of(r)
            with pytest.raises(MCPError):
                await c.call_tool("no_such_tool", {})

            r = await call_ok(c, "list_sandboxes", {})
            assert sid in [x["sandbox_id"] for x in r.structured_content["sandboxes"]]
            if transport == "stdio":
                await lifecycle_round(c, sid)
        finally:
            r = await c.call_tool("kill_sandbox", {"sandbox_id": sid})
        assert not r.is_error, text_of(r)
        r = await call_ok(c, "list_sandboxes", {})
        assert sid not in [x["sandbox_id"] for x in r.structured_content["sandboxes"]]
        r = await c.call_tool("run_command", {"sandbox_id": sid, "command": "true"})
        assert r.is_error and "404" in text_of(r), text_of(r)


async def lifecycle_round(c: Client, sid: str):
    """Pause, resume and fork keep the sandbox's files (and the fork has its own copy)."""
    await call_ok(c, "pause_sandbox", {"sandbox_id": sid})
    r = await call_ok(c, "list_sandboxes", {"state": "paused"})
    assert sid in [x["sandbox_id"] for x in r.structured_content["sandboxes"]]
    await call_ok(c, "resume_sandbox", {"sandbox_id": sid, "timeout_secs": 120})
    r = await call_ok(c, "read_file", {"sandbox_id": sid, "path": "/home/user/notes/a.txt"})
    assert text_of(r) == "written over MCP\n"
    r = await call_ok(c, "fork_sandbox", {"sandbox_id": sid, "timeout_secs": 120})
    (child,) = r.structured_content["children"]
    try:
        await call_ok(c, "write_file", {"sandbox_id": child, "path": "/home/user/notes/a.txt",
                                        "content": "the fork's own\n"})
        r = await call_ok(c, "read_file", {"sandbox_id": sid, "path": "/home/user/notes/a.txt"})
        assert text_of(r) == "written over MCP\n"
    finally:
        await c.call_tool("kill_sandbox", {"sandbox_id": child})
    r = await c.call_tool("fork_sandbox", {"sandbox_id": sid, "count": 0})
    assert r.is_error and "`count`" in text_of(r), text_of(r)


def test_mcp_over_stdio(server):
    asyncio.run(sandbox_round(server, "stdio", None, "auto", "2026-07-28"))


@pytest.mark.parametrize("mode,version", [("auto", "2026-07-28"), ("legacy", "2025-11-25")])
def test_mcp_over_streamable_http(server, mcp_http, mode, version):
    asyncio.run(sandbox_round(server, "http", mcp_http, mode, version))


def post(url: str, headers: dict):
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}).encode()
    req = urllib.request.Request(url, data=body, method="POST", headers={
        "Content-Type": "application/json", "Accept": "application/json, text/event-stream",
        **headers})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def test_mcp_http_refuses_requests_without_a_valid_key(server, mcp_http):
    status, headers, body = post(mcp_http.url, {})
    assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer"), body
    status, _, body = post(mcp_http.url, {"Authorization": "Bearer e2b_not_a_key"})
    assert status == 401 and b"refused" in body, body
    status, _, body = post(mcp_http.url, {"X-API-Key": "e2b_not_a_key"})
    assert status == 401, body

    async def wrong_key():
        async with connect(server, "http", mcp_http, key="e2b_not_a_key") as c:
            await c.list_tools()

    with pytest.raises(Exception):
        asyncio.run(wrong_key())


# ---- the code interpreter and the desktop (a networked server of their own) ----

@pytest.fixture(scope="module")
def net_server():
    srv, base = start_net_server("kiln-mcp-srv-", "10.171.0.0/24")
    try:
        yield srv
    finally:
        stop_net_server(srv, base)


def template_cached(name: str) -> bool:
    r = subprocess.run([kiln_bin(), "template", "ls", "--json"], capture_output=True, timeout=60)
    return r.returncode == 0 and any(t["name"] == name for t in json.loads(r.stdout))


def test_mcp_run_code_returns_text_and_images(net_server):
    need(template_cached("code-interpreter-v1"), "the code-interpreter-v1 template is not built")
    ensure_template(net_server, "code-interpreter-v1")

    async def go():
        async with connect(net_server, "stdio") as c:
            r = await call_ok(c, "create_sandbox", {"template": "code-interpreter-v1",
                                                    "timeout_secs": 300})
            sid = r.structured_content["sandbox_id"]
            try:
                code = ("import matplotlib.pyplot as plt\nprint('from python')\n"
                        "plt.plot([1, 2, 3], [1, 4, 9])\nplt.show()\n6 * 7")
                r = await call_ok(c, "run_code", {"sandbox_id": sid, "code": code})
                texts = [x.text for x in r.content if x.type == "text"]
                images = [x for x in r.content if x.type == "image"]
                assert any("from python" in t for t in texts), texts
                assert "42" in texts, texts
                assert len(images) == 1 and images[0].mime_type == "image/png"
                w, h = png_size(base64.b64decode(images[0].data))
                assert w > 100 and h > 100
                r = await c.call_tool("run_code", {"sandbox_id": sid, "code": "1/0"})
                assert r.is_error and "ZeroDivisionError" in text_of(r), text_of(r)
                r = await c.call_tool("run_code", {"sandbox_id": sid, "code": "1",
                                                   "language": "cobol"})
                assert r.is_error and "`language`" in text_of(r), text_of(r)
            finally:
                await c.call_tool("kill_sandbox", {"sandbox_id": sid})

    asyncio.run(go())


def test_mcp_desktop_screenshot_click_type_scroll(net_server):
    need(template_cached("desktop"), "the desktop template is not built")
    ensure_template(net_server, "desktop")

    async def go():
        async with connect(net_server, "stdio") as c:
            r = await call_ok(c, "create_sandbox", {"template": "desktop", "timeout_secs": 300,
                                                    "resolution": [800, 600]})
            sid = r.structured_content["sandbox_id"]
            try:
                r = await call_ok(c, "desktop_screenshot", {"sandbox_id": sid})
                img = r.content[0]
                assert img.type == "image" and img.mime_type == "image/png"
                assert png_size(base64.b64decode(img.data)) == (800, 600)
                r = await call_ok(c, "desktop_click", {"sandbox_id": sid, "x": 400, "y": 300})
                assert r.structured_content["cursor"] == {"x": 400, "y": 300}
                r = await call_ok(c, "desktop_scroll", {"sandbox_id": sid, "direction": "down",
                                                        "x": 100, "y": 120, "screenshot": True})
                assert r.structured_content["cursor"] == {"x": 100, "y": 120}
                assert [x.type for x in r.content] == ["text", "image"]
                await call_ok(c, "desktop_type", {"sandbox_id": sid, "text": "hi"})
                await call_ok(c, "desktop_key", {"sandbox_id": sid, "keys": "ctrl+a"})
                r = await c.call_tool("desktop_scroll", {"sandbox_id": sid, "direction": "sideways"})
                assert r.is_error and "`direction`" in text_of(r), text_of(r)
            finally:
                await c.call_tool("kill_sandbox", {"sandbox_id": sid})

    asyncio.run(go())


def test_mcp_create_sandbox_passes_the_network_policy(server):
    async def go():
        async with connect(server, "stdio") as c:
            r = await c.call_tool("create_sandbox", {"deny_out": ["not a network!"]})
            assert r.is_error and "not a network!" in text_of(r), text_of(r)
            r = await call_ok(c, "create_sandbox", {
                "timeout_secs": 60, "allow_out": ["198.51.100.0/24"], "deny_out": ["0.0.0.0/0"]})
            sid = r.structured_content["sandbox_id"]
            try:
                status, info, _ = server.request("GET", f"/sandboxes/{sid}")
                assert status == 200, info
                assert info["network"]["allowOut"] == ["198.51.100.0/24"], info
                assert info["network"]["denyOut"] == ["0.0.0.0/0"], info
            finally:
                await c.call_tool("kill_sandbox", {"sandbox_id": sid})
            r = await call_ok(c, "create_sandbox", {"timeout_secs": 60, "allow_internet": False})
            sid = r.structured_content["sandbox_id"]
            try:
                status, info, _ = server.request("GET", f"/sandboxes/{sid}")
                assert status == 200 and info["allowInternetAccess"] is False, info
            finally:
                await c.call_tool("kill_sandbox", {"sandbox_id": sid})

    asyncio.run(go())
