"""Volumes with the pinned e2b SDK against a `kiln serve` of its own (64 MiB volumes, restarted
once): `Volume.create/list/get_info/destroy`, the volume-content API (files, directories, stat
fields, uid/gid/mode, `force`), two running sandboxes sharing a volume mounted with
`volume_mounts`, its data surviving pause/resume, a fork, kill and a server restart, ENOSPC at
the volume's size inside a sandbox and 507 from the content API, and bad input: `..` paths,
another team's volume, a mounted volume's deletion, an unknown volume in `volumeMounts`."""

import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

import pytest
from e2b import Sandbox
from e2b.exceptions import NotFoundException
from e2b.volume.volume_sync import Volume

from .conftest import KilnServer, cleanup_state, kiln_bin

VOLUME_MB = 64


@pytest.fixture(scope="module")
def own():
    """A server of this module's own (restarted by a test), with the SDK pointed at it."""
    base = tempfile.mkdtemp(prefix="kiln-vol-")
    state = os.path.join(base, "state")
    extra = os.environ.get("KILN_SERVE_EXTRA_ARGS", "").split()
    srv = KilnServer(state, [*extra, "--volume-mb", str(VOLUME_MB)]).start()
    saved = os.environ.get("E2B_VOLUME_API_URL")
    # The SDK's volume-content calls go to E2B_VOLUME_API_URL (else https://api.<domain>).
    os.environ["E2B_VOLUME_API_URL"] = srv.url
    try:
        yield srv
    finally:
        if saved is None:
            os.environ.pop("E2B_VOLUME_API_URL", None)
        else:
            os.environ["E2B_VOLUME_API_URL"] = saved
        srv.kill_all_sandboxes()
        srv.stop()
        log = srv.log()
        cleanup_state(state)
        shutil.rmtree(base, ignore_errors=True)
        assert "panicked" not in log, log[-8000:]


def content(srv, vol, method, route, path, body=None, query="", token=None):
    """A raw volume-content request: (status, body bytes)."""
    url = f"{srv.url}/volumecontent/{vol.volume_id}/{route}?path={urllib.request.quote(path)}{query}"
    req = urllib.request.Request(url, data=body, method=method,
                                 headers={"Authorization": f"Bearer {token or vol.token}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_volume_api_content_and_bad_input(own):
    opts = own.opts()
    vol = Volume.create("data-one", **opts)
    assert re.fullmatch(r"vol_[0-9a-f]{16}", vol.volume_id) and vol.token
    assert [(v.volume_id, v.name) for v in Volume.list(**opts)] == [(vol.volume_id, "data-one")]
    info = Volume.get_info(vol.volume_id, **opts)
    assert (info.name, info.token) == ("data-one", vol.token)
    status, body, _ = own.request("POST", "/volumes", {"name": "data-one"})
    assert status == 409, body
    status, body, _ = own.request("POST", "/volumes", {"name": "bad name"})
    assert status == 400, body

    v = Volume.connect(vol.volume_id, **opts)
    assert v.list("/") == []
    d = v.make_dir("/a/b", force=True, mode=0o750, uid=1000, gid=1000)
    assert (d.type.value, d.path, d.name, d.mode, d.uid, d.gid) == ("directory", "/a/b", "b", 0o750, 1000, 1000)
    with pytest.raises(NotFoundException):
        v.make_dir("/x/y")  # no parent without force
    f = v.write_file("/a/b/hello.txt", "hi there", uid=1000, gid=1000, mode=0o640)
    assert (f.type.value, f.size, f.mode, f.uid, f.gid) == ("file", 8, 0o640, 1000, 1000)
    assert f.mtime.year >= 2024
    assert v.read_file("/a/b/hello.txt") == "hi there"
    v.write_file("/a/b/hello.txt", b"replaced")  # writing again overwrites
    assert v.read_file("/a/b/hello.txt", format="bytes") == b"replaced"
    assert v.write_file("/deep/er/f", "x", force=True).path == "/deep/er/f"
    assert [e.path for e in v.list("/", depth=3)] == ["/a", "/a/b", "/a/b/hello.txt", "/deep", "/deep/er", "/deep/er/f"]
    u = v.update_metadata("/a/b/hello.txt", uid=0, gid=0, mode=0o600)
    assert (u.uid, u.gid, u.mode) == (0, 0, 0o600)
    assert v.exists("/a/b/hello.txt") and not v.exists("/nope")
    v.remove("/deep")
    assert not v.exists("/deep/er/f")

    # Bad input: `..`, a wrong token, another team's volume, an unknown volume to mount.
    for route in ("path", "dir", "file"):
        status, body = content(own, vol, "GET", route, "/a/../../etc/passwd")
        assert status == 400 and b"'..'" in body, (route, status, body)
    assert content(own, vol, "GET", "path", "/a", token="wrong")[0] == 401
    r = subprocess.run([kiln_bin(), "keys", "create", "--team", "vol-other", "--state-dir", own.state_dir],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    other = r.stdout.strip()
    for method, path in (("GET", f"/volumes/{vol.volume_id}"), ("DELETE", f"/volumes/{vol.volume_id}"),
                         ("GET", "/volumes/data-one")):
        status, body, _ = own.request(method, path, api_key=other)
        assert status == 404, (method, path, body)
    status, body, _ = own.request("GET", "/volumes", api_key=other)
    assert (status, body) == (200, [])
    status, body, _ = own.request("POST", "/sandboxes", {
        "templateID": "base", "volumeMounts": [{"name": "data-one", "path": "/mnt/v"}]}, api_key=other)
    assert status == 400 and "data-one" in body["message"], body
    status, body, _ = own.request("POST", "/sandboxes", {
        "templateID": "base", "volumeMounts": [{"name": "data-one", "path": "/mnt/../etc"}]})
    assert status == 400 and "'..'" in body["message"], body

    # The CLI lists, and deletes.
    r = subprocess.run([kiln_bin(), "volumes", "create", "cli-vol", "--url", own.url, "--api-key", own.api_key],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "\tcli-vol\t" in r.stdout, r.stderr
    r = subprocess.run([kiln_bin(), "volumes", "list", "--url", own.url, "--api-key", own.api_key],
                       capture_output=True, text=True, timeout=60)
    assert "\tcli-vol" in r.stdout and "\tdata-one" in r.stdout, r.stdout
    r = subprocess.run([kiln_bin(), "volumes", "rm", "cli-vol", "--url", own.url, "--api-key", own.api_key],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert Volume.destroy(vol.volume_id, **opts) is True
    assert Volume.destroy(vol.volume_id, **opts) is False
    assert [v.name for v in Volume.list(**opts)] == []


def test_shared_volume_survives_pause_fork_kill_and_restart(own):
    opts = own.opts()
    vol = Volume.create("shared", **opts)
    a = Sandbox.create(timeout=120, volume_mounts={"/mnt/data": vol}, **opts)
    b = Sandbox.create(timeout=120, volume_mounts={"/mnt/data": "shared"}, **opts)
    child = None
    try:
        assert a.get_info().volume_mounts == [{"name": "shared", "path": "/mnt/data"}]
        a.commands.run("echo from-a > /mnt/data/a.txt")
        assert b.commands.run("cat /mnt/data/a.txt").stdout == "from-a\n"
        b.commands.run("echo from-b > /mnt/data/b.txt")
        assert a.commands.run("cat /mnt/data/b.txt").stdout == "from-b\n"
        # Written inside as the sandbox's user, readable through the content API.
        st = vol.get_info("/a.txt")
        assert (st.size, st.uid) == (7, 1000), st
        vol.write_file("/from-api.txt", "api")
        assert a.commands.run("cat /mnt/data/from-api.txt").stdout == "api"

        # A mounted volume cannot be deleted.
        status, body, _ = own.request("DELETE", f"/volumes/{vol.volume_id}")
        assert status == 409 and a.sandbox_id in body["message"] and b.sandbox_id in body["message"], body

        a.pause()
        b.commands.run("echo while-paused > /mnt/data/p.txt")
        a = Sandbox.connect(a.sandbox_id, **opts)
        assert a.commands.run("cat /mnt/data/p.txt").stdout == "while-paused\n"

        child = a.fork(timeout=120)[0]
        assert not isinstance(child, Exception), child
        assert child.commands.run("cat /mnt/data/a.txt").stdout == "from-a\n"
        child.commands.run("echo from-child > /mnt/data/c.txt")
        assert b.commands.run("cat /mnt/data/c.txt").stdout == "from-child\n"
        assert child.get_info().volume_mounts == [{"name": "shared", "path": "/mnt/data"}]
    finally:
        for s in (a, b, child):
            if s is not None and not isinstance(s, Exception):
                s.kill()

    assert vol.read_file("/c.txt") == "from-child\n"
    # Restart the server (kill -9): the volume and its data are still there.
    own.kill9()
    own.start()  # on a new port
    opts = own.opts()
    os.environ["E2B_VOLUME_API_URL"] = own.url
    assert [v.name for v in Volume.list(**opts)] == ["shared"]
    assert vol.read_file("/b.txt") == "from-b\n"
    again = Sandbox.create(timeout=60, volume_mounts={"/data": "shared"}, **opts)
    try:
        assert again.commands.run("cat /data/a.txt /data/c.txt").stdout == "from-a\nfrom-child\n"
    finally:
        again.kill()
    assert Volume.destroy(vol.volume_id, **opts) is True


def test_volume_quota_is_enospc_inside_and_507_outside(own):
    opts = own.opts()
    vol = Volume.create("small", **opts)
    sbx = Sandbox.create(timeout=60, volume_mounts={"/mnt/small": vol}, **opts)
    try:
        r = sbx.commands.run(
            f"dd if=/dev/zero of=/mnt/small/big bs=1M count={VOLUME_MB + 16} 2>&1; echo rc=$?",
            timeout=60)
        assert "No space left on device" in r.stdout and "rc=1" in r.stdout, r.stdout
        # The sandbox's own disk is not the volume's.
        assert sbx.commands.run("echo fine > /home/user/ok && cat /home/user/ok").stdout == "fine\n"
        status, body = content(own, vol, "PUT", "file", "/more", body=b"x" * (2 << 20))
        assert status == 507, (status, body)
        sbx.commands.run("rm /mnt/small/big")
        assert vol.write_file("/more", b"x" * (2 << 20)).size == 2 << 20
    finally:
        sbx.kill()
    deadline = time.time() + 20
    while time.time() < deadline:
        status, _, _ = own.request("DELETE", f"/volumes/{vol.volume_id}")
        if status == 204:
            break
        time.sleep(0.2)
    assert status == 204
