"""Support for the desktop and browser tests: a networked `kiln serve`, template builds, sandbox
port requests through kiln's routing, and a small PNG decoder (no imaging library needed)."""

import os
import shutil
import struct
import subprocess
import tempfile
import urllib.error
import urllib.request
import zlib

from framework.skip import need  # noqa: F401  (the desktop and browser tests' guard)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def start_net_server(prefix: str, net_range: str):
    """A `kiln serve` with sandbox networking on, in its own slot range. Returns (server, base)."""
    from .conftest import KilnServer

    base = tempfile.mkdtemp(prefix=prefix)
    env = {"KILN_NETWORK": "on", "KILN_NET_RANGE": net_range, "KILN_NET_POOL": "2"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        srv = KilnServer(os.path.join(base, "state"), []).start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return srv, base


def stop_net_server(srv, base):
    from .conftest import cleanup_state

    srv.kill_all_sandboxes()
    srv.stop()
    log = srv.log()
    cleanup_state(srv.state_dir)
    shutil.rmtree(base, ignore_errors=True)
    assert "panicked" not in log, f"the server panicked:\n{log}"


def ensure_template(server, name: str) -> str:
    """Builds the template (a cache hit once built) so the server can create sandboxes of it."""
    status, templates, _ = server.request("GET", "/templates")
    assert status == 200, templates
    if not any(t["templateID"] == name for t in templates):
        r = subprocess.run([os.environ["KILN_BIN"], "template", "build", name], cwd=REPO,
                           capture_output=True, text=True, timeout=3600)
        assert r.returncode == 0, r.stdout + r.stderr
    return name


def port_request(server, sandbox_id: str, port: int, method: str, path: str, body: bytes = None,
                 headers=None, timeout=120):
    """One HTTP request to a sandbox port through kiln's routing (E2b-Sandbox-* headers).
    Returns (status, body bytes, headers)."""
    h = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": str(port), **(headers or {})}
    req = urllib.request.Request(server.url + path, data=body, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read(), r.headers
    except urllib.error.HTTPError as e:
        return e.code, e.read(), e.headers


def png_size(data: bytes):
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:16]
    return struct.unpack(">II", data[16:24])


def png_pixels(data: bytes):
    """Decodes an 8-bit, non-interlaced RGB/RGBA/grey PNG into (width, height, channels, rows)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, hdr = 8, b"", None
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunk = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            hdr = struct.unpack(">IIBBBBB", chunk)
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + n
    w, h, depth, ctype, _, _, interlace = hdr
    assert depth == 8 and interlace == 0, hdr
    ch = {0: 1, 2: 3, 4: 2, 6: 4}[ctype]
    raw = zlib.decompress(idat)
    stride = w * ch
    rows, prev, i = [], bytearray(stride), 0
    for _ in range(h):
        f = raw[i]
        line = bytearray(raw[i + 1:i + 1 + stride])
        i += 1 + stride
        for x in range(stride):
            a = line[x - ch] if x >= ch else 0
            b = prev[x]
            c = prev[x - ch] if x >= ch else 0
            if f == 1:
                line[x] = (line[x] + a) & 0xFF
            elif f == 2:
                line[x] = (line[x] + b) & 0xFF
            elif f == 3:
                line[x] = (line[x] + ((a + b) >> 1)) & 0xFF
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                line[x] = (line[x] + pred) & 0xFF
        rows.append(bytes(line))
        prev = line
    return w, h, ch, rows


def colour_share(data: bytes, rgb, tolerance=8, step=4) -> float:
    """The share of (sampled) pixels of a PNG within `tolerance` of colour `rgb`."""
    w, h, ch, rows = png_pixels(data)
    hit = total = 0
    for y in range(0, h, step):
        row = rows[y]
        for x in range(0, w, step):
            px = row[x * ch:x * ch + 3] if ch >= 3 else bytes([row[x * ch]] * 3)
            total += 1
            if all(abs(px[i] - rgb[i]) <= tolerance for i in range(3)):
                hit += 1
    return hit / max(total, 1)


def distinct_colours(data: bytes, step=4) -> int:
    w, h, ch, rows = png_pixels(data)
    seen = set()
    for y in range(0, h, step):
        row = rows[y]
        for x in range(0, w, step):
            seen.add(bytes(row[x * ch:x * ch + min(ch, 3)]))
    return len(seen)
