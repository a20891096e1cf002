"""The web console served by a cluster's control replicas (docs/cluster.md, docs/console.md):
a one-member etcd, two `kiln node` processes and two `kiln control` replicas (the fixture of
test_server_cluster.py). A browser's sign-in at one replica makes a session every replica
knows (its sessions live in etcd); signing out at one ends it at the other; a wrong key gets the
sign-in page with an error; the console's terminal WebSocket opened at a replica runs a shell in
a sandbox on a node (through the gateway's tunnel) and reads a command's output; pages a
cluster does not serve yet answer a clear error. Driven as the browser does: the form post,
the cookie, the CSRF token of the page, the WebSocket frames (stdlib only).

Needs KILN_BIN, the base template, runsc, and etcd (Debian's etcd-server, or KILN_ETCD).
"""

import base64
import hashlib
import json
import os
import re
import socket
import struct
import time
import urllib.error
import urllib.parse
import urllib.request

from .test_server_cluster import cluster  # noqa: F401  (the module's cluster fixture)


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


OPENER = urllib.request.build_opener(NoRedirect)


def call(url: str, method: str = "GET", form: dict = None, headers: dict = None):
    """One request; (status, headers, body text). Redirects are not followed."""
    data = urllib.parse.urlencode(form).encode() if form is not None else None
    h = dict(headers or {})
    if data is not None:
        h["Content-Type"] = "application/x-www-form-urlencoded"
    req = urllib.request.Request(url, data=data, method=method, headers=h)
    try:
        with OPENER.open(req, timeout=60) as r:
            return r.status, r.headers, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read().decode()


def sign_in(url: str, key: str) -> str:
    """Posts the sign-in form; the session cookie's value."""
    status, headers, _ = call(url + "/console/login", "POST", {"key": key})
    assert status == 303, status
    set_cookie = headers["Set-Cookie"]
    assert "HttpOnly" in set_cookie and "SameSite=Strict" in set_cookie, set_cookie
    return re.match(r"kiln_console=([0-9a-f]+);", set_cookie).group(1)


def jar(session: str) -> dict:
    return {"Cookie": f"kiln_console={session}"}


def csrf_of_page(url: str, session: str) -> str:
    status, _, page = call(url + "/console", headers=jar(session))
    assert status == 200
    return re.search(r'<meta name="kiln-csrf" content="([0-9a-f]+)"', page).group(1)


def api(url: str, session: str, path: str):
    status, _, body = call(url + "/console/api" + path, headers=jar(session))
    return status, (json.loads(body) if body else None)


class WebSocket:
    """A client WebSocket (RFC 6455) over a plain socket: enough for the console's terminal."""

    def __init__(self, url: str, path: str, headers: dict):
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=60)
        key = base64.b64encode(os.urandom(16)).decode()
        lines = [f"GET {path} HTTP/1.1", f"Host: {host}:{port}", "Upgrade: websocket",
                 "Connection: Upgrade", f"Sec-WebSocket-Key: {key}", "Sec-WebSocket-Version: 13",
                 *(f"{k}: {v}" for k, v in headers.items())]
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(4096)
            assert chunk, head
            head += chunk
        head, self.buf = head.split(b"\r\n\r\n", 1)
        self.status = int(head.split(b" ")[1])
        self.head = head.decode(errors="replace")
        if self.status == 101:
            accept = base64.b64encode(hashlib.sha1((key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11")
                                                   .encode()).digest()).decode()
            assert accept in self.head, self.head

    def _exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise EOFError
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def send(self, payload: bytes, opcode: int = 2):
        mask = os.urandom(4)
        n = len(payload)
        if n < 126:
            head = struct.pack("!BB", 0x80 | opcode, 0x80 | n)
        else:
            head = struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, n)
        self.sock.sendall(head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))

    def recv(self):
        """(opcode, payload) of the next frame (the server's frames are whole and unmasked)."""
        b0, b1 = self._exact(2)
        n = b1 & 0x7F
        if n == 126:
            n = struct.unpack("!H", self._exact(2))[0]
        elif n == 127:
            n = struct.unpack("!Q", self._exact(8))[0]
        return b0 & 0x0F, self._exact(n)

    def close(self):
        self.sock.close()


def test_a_session_made_at_one_replica_works_at_the_other_until_signed_out(cluster):  # noqa: F811
    from e2b import Sandbox

    a, b = cluster.controls["c1"].url, cluster.controls["c2"].url
    s = Sandbox.create(timeout=120, **cluster.opts("c1"))
    try:
        session = sign_in(a, cluster.api_key)
        # Replica b knows the session: its app page, the sandbox list, a sandbox page's reads.
        status, _, page = call(b + "/console", headers=jar(session))
        assert status == 200 and 'name="kiln-csrf"' in page
        status, lst = api(b, session, "/v2/sandboxes?state=running,paused&limit=1000")
        assert status == 200 and s.sandbox_id in {x["sandboxID"] for x in lst}, lst
        status, one = api(b, session, f"/sandboxes/{s.sandbox_id}")
        assert status == 200 and one["state"] == "running", one
        status, ev = api(b, session, f"/sandboxes/{s.sandbox_id}/events?limit=1000")
        assert status == 200 and "created" in {e["type"] for e in ev["events"]}, ev
        # Reads a cluster does not serve yet answer a clear error the page shows, never a 500.
        for path in (f"/sandboxes/{s.sandbox_id}/metrics?start=0", "/templates",
                     f"/alerts?sandboxID={s.sandbox_id}"):
            status, body = api(b, session, path)
            assert status in (200, 404, 501), (path, status, body)
            if status == 501:
                assert body["message"] and "/var" not in body["message"], body
        status, _, body = call(b + "/console/builds/base", headers=jar(session))
        assert status in (404, 501) and json.loads(body)["message"], body
        # A state-changing call through b needs the page's token (the same at both replicas).
        csrf = csrf_of_page(b, session)
        assert csrf == csrf_of_page(a, session)
        status, _, _ = call(b + f"/console/api/sandboxes/{s.sandbox_id}/timeout", "POST",
                            headers={**jar(session), "Content-Type": "application/json"})
        assert status == 403, "no token: refused"
        req = urllib.request.Request(b + f"/console/api/sandboxes/{s.sandbox_id}/timeout", method="POST",
                                     data=json.dumps({"timeout": 200}).encode(),
                                     headers={**jar(session), "Content-Type": "application/json",
                                              "X-CSRF-Token": csrf})
        with OPENER.open(req, timeout=60) as r:
            assert r.status == 204
        # Signing out at b ends the session at a.
        status, headers, _ = call(b + "/console/logout", "POST", {"csrf": csrf}, jar(session))
        assert status == 303 and "Max-Age=0" in headers["Set-Cookie"]
        status, body = api(a, session, "/v2/sandboxes")
        assert status == 401, body
        status, _, page = call(a + "/console", headers=jar(session))
        assert status == 200 and 'id="key"' in page, "the sign-in page again"
    finally:
        s.kill()


def test_a_wrong_key_gets_the_sign_in_page_with_an_error(cluster):  # noqa: F811
    url = cluster.controls["c2"].url
    status, headers, page = call(url + "/console/login", "POST", {"key": "e2b_" + "0" * 40})
    assert status == 401 and "Set-Cookie" not in headers
    assert headers["Content-Type"].startswith("text/html")
    assert 'role="alert"' in page and "Sign-in failed" in page and "invalid API key" in page, page
    assert 'id="key"' in page, "the form is shown again"
    for leak in ("panicked", "Traceback", "/tmp/", "/var/lib", "etcd"):
        assert leak not in page, (leak, page)


def test_the_terminal_through_a_replica_runs_a_command_on_a_node(cluster):  # noqa: F811
    from e2b import Sandbox

    a, b = cluster.controls["c1"].url, cluster.controls["c2"].url
    s = Sandbox.create(timeout=120, **cluster.opts("c1"))
    try:
        node = cluster.node_of(s.sandbox_id)
        assert node in cluster.nodes, node
        session = sign_in(a, cluster.api_key)
        csrf = csrf_of_page(b, session)
        # Without the token, or for another sandbox, the upgrade is refused.
        ws = WebSocket(b, f"/console/terminal/{s.sandbox_id}?csrf={'0' * 64}", jar(session))
        assert ws.status == 403, ws.head
        ws.close()
        ws = WebSocket(b, f"/console/terminal/nosuchsandbox?csrf={csrf}", jar(session))
        assert ws.status == 404, ws.head
        ws.close()
        ws = WebSocket(b, f"/console/terminal/{s.sandbox_id}?csrf={csrf}&cols=90&rows=20", jar(session))
        assert ws.status == 101, ws.head
        try:
            ws.send(b"stty size; echo console-$((6*7))\n")
            out, deadline = b"", time.time() + 60
            while b"console-42" not in out:
                assert time.time() < deadline, out
                op, data = ws.recv()
                assert op == 2, (op, data)
                out += data
            assert b"20 90" in out, out
            # The shell runs on the sandbox's node: its file is the one the SDK reads.
            ws.send(b"echo written-by-the-terminal > /tmp/term.txt; exit 7\n")
            deadline = time.time() + 60
            while True:
                assert time.time() < deadline
                op, data = ws.recv()
                if op == 1:
                    assert json.loads(data) == {"exit": 7}, data
                    break
        finally:
            ws.close()
        assert s.files.read("/tmp/term.txt").strip() == "written-by-the-terminal"
    finally:
        s.kill()


def test_failed_sign_ins_are_limited_across_replicas(cluster):  # noqa: F811
    # Last in the module: it spends the loopback address's sign-in budget for a minute.
    # Failures spread over both replicas add up (etcd counts them): no replica gives a client
    # a fresh five.
    # (The wrong-key test above spent one already.) Counted per replica, alternating would
    # get five 401s at each replica, nine or ten in all, before the first 429.
    urls = [cluster.controls[c].url for c in ("c1", "c2")]
    statuses = []
    while 429 not in statuses and len(statuses) < 12:
        i = len(statuses)
        statuses.append(call(urls[i % 2] + "/console/login", "POST", {"key": f"e2b_{i:040d}"})[0])
    assert statuses[-1] == 429 and set(statuses[:-1]) == {401}, statuses
    assert 4 <= len(statuses) - 1 <= 5, f"{statuses}: failures at both replicas share one budget"
    for url in urls:
        status, headers, page = call(url + "/console/login", "POST", {"key": cluster.api_key})
        assert status == 429 and int(headers["Retry-After"]) > 0, "even the right key waits"
        assert 'role="alert"' in page and "Too many failed sign-ins" in page
