"""Garbage collection of built templates (`kiln template gc --built`, `POST /template-builds/gc`,
and on `DELETE /templates/{id}`): a version no tag or name points to goes with the cache
entries only it used, but never while a running or paused sandbox started from it; a layer a
user's snapshot stacks on stays usable; a shared layer stays cached."""

import subprocess
import uuid

from .conftest import kiln_bin


def _tpl(v):
    from e2b import Template

    return (Template().from_template("base")
            .run_cmd("echo shared > /home/user/shared.txt")
            .run_cmd(f"echo {v} > /home/user/v.txt"))


def _build(v, name):
    from e2b import Template

    logs = []
    info = Template.build(_tpl(v), name, on_build_logs=logs.append)
    return info, "\n".join(str(l.message) for l in logs)


def _gc_cli(server):
    r = subprocess.run([kiln_bin(), "template", "gc", "--built", "--url", server.url,
                        "--api-key", server.api_key], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


def _status(server, info):
    return server.request("GET", f"/templates/{info.template_id}/builds/{info.build_id}/status")[0]


def test_gc_keeps_what_sandboxes_use(server):
    from e2b import Sandbox

    name = f"kt-gc-{uuid.uuid4().hex[:6]}"
    v1, _ = _build("one", name)
    s1 = Sandbox.create(name, timeout=300)
    try:
        v2, text = _build("two", name)
        assert "CACHED [1/2]" in text and "CACHED [2/2]" not in text, text
        # v1 is no longer named, but s1 started from it.
        out = _gc_cli(server)
        assert out.startswith("built templates: "), out
        assert _status(server, v1) == 200
        assert s1.commands.run("cat /home/user/v.txt").stdout.strip() == "one"
        snap = s1.create_snapshot()
    finally:
        s1.kill()

    # s1 is gone: v1 and its own layer go; the shared layer stays cached.
    out = _gc_cli(server)
    assert "built templates: " in out and " 0 versions" not in out, out
    assert _status(server, v1) == 404 and _status(server, v2) == 200
    # The snapshot taken of s1 still starts: the layers it stacks on stayed.
    s = Sandbox.create(snap.snapshot_id, timeout=120)
    try:
        assert s.commands.run("cat /home/user/v.txt /home/user/shared.txt").stdout.split() == [
            "one", "shared"]
    finally:
        s.kill()
    assert server.request("DELETE", f"/templates/{snap.snapshot_id}")[0] == 204
    _, text = _build("one", name)
    assert "CACHED [1/2]" in text and "CACHED [2/2]" not in text, text

    # A paused sandbox keeps the version it started from, also through a delete.
    s2 = Sandbox.create(name, timeout=300)
    try:
        s2.pause()
        status, body, _ = server.request("DELETE", f"/templates/{name}")
        assert status == 204, body
        s2 = Sandbox.connect(s2.sandbox_id)
        assert s2.commands.run("cat /home/user/v.txt").stdout.strip() == "one"
    finally:
        s2.kill()
    status, done, _ = server.request("POST", "/template-builds/gc")
    assert status == 200 and done["snapshots"], done
    status, again, _ = server.request("POST", "/template-builds/gc")
    assert again == {"builds": [], "cacheEntries": 0, "snapshots": []}, again
    # Nothing of the template is left among the team's snapshots.
    status, snaps, _ = server.request("GET", "/snapshots")
    assert not any(s["snapshotID"].split(":")[0] in done["snapshots"] for s in snaps), snaps


# ---- the automatic collection (`kiln serve --template-gc-interval`) ----

import glob  # noqa: E402
import io  # noqa: E402
import os  # noqa: E402
import tarfile  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402

import pytest  # noqa: E402

from .conftest import own_server  # noqa: E402


@pytest.fixture(scope="module")
def gc_server():
    """A server collecting every 2 s, uploaded archives after 1 s, the template store left
    alone (it is the host's shared cache)."""
    with own_server("kiln-tplgc-", ["--template-gc-interval", "2s", "--template-files-grace", "1s",
                                    "--template-gc-store", "off"]) as s:
        yield s


def _upload(srv, template_id, digest):
    """Uploads a one-file archive under files hash `digest` as the SDK would."""
    status, link, _ = srv.request("GET", f"/templates/{template_id}/files/{digest}")
    assert status == 201 and not link["present"], link
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as t:
        info = tarfile.TarInfo("f.txt")
        data = b"unreferenced\n"
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
    req = urllib.request.Request(link["url"], data=raw.getvalue(), method="PUT",
                                 headers={"Content-Length": str(len(raw.getvalue()))})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status in (200, 201, 204), r.status


def _archives(srv):
    return {os.path.basename(p)[:-4] for p in glob.glob(os.path.join(srv.state_dir, "template-files", "*", "*.tar"))}


def _wait(pred, what, secs=30):
    deadline = time.time() + secs
    while not pred():
        assert time.time() < deadline, f"the automatic collection did not {what} in {secs}s"
        time.sleep(0.5)


def test_gc_runs_by_itself(gc_server, tmp_path):
    from e2b import Sandbox, Template

    srv = gc_server
    (tmp_path / "in.txt").write_text("copied\n")
    name = f"kt-autogc-{uuid.uuid4().hex[:6]}"

    def tpl(v):
        return (Template(file_context_path=str(tmp_path)).from_template("base")
                .copy("in.txt", "/home/user/in.txt")
                .run_cmd(f"echo {v} > /home/user/v.txt"))

    v1 = Template.build(tpl("one"), name, **srv.opts())
    copied = _archives(srv)
    assert len(copied) == 1, copied
    stray = uuid.uuid4().hex + uuid.uuid4().hex
    _upload(srv, v1.template_id, stray)
    assert stray in _archives(srv)

    s1 = Sandbox.create(name, timeout=300, **srv.opts())
    try:
        v2 = Template.build(tpl("two"), name, **srv.opts())
        # The stray archive goes; the COPY's stays (its step-cache entry names it); v1 stays
        # while s1 runs on it.
        _wait(lambda: stray not in _archives(srv), "remove an unreferenced archive")
        time.sleep(3)
        assert copied <= _archives(srv)
        st = srv.request("GET", f"/templates/{v1.template_id}/builds/{v1.build_id}/status")[0]
        assert st == 200
        assert s1.commands.run("cat /home/user/v.txt").stdout.strip() == "one"
    finally:
        s1.kill()
    # Nothing runs on v1 any more: it goes by itself; v2 (the name's) stays and starts.
    _wait(lambda: srv.request("GET", f"/templates/{v1.template_id}/builds/{v1.build_id}/status")[0] == 404,
          "remove an unnamed version")
    assert srv.request("GET", f"/templates/{v2.template_id}/builds/{v2.build_id}/status")[0] == 200
    assert copied <= _archives(srv)
    s2 = Sandbox.create(name, timeout=120, **srv.opts())
    try:
        assert s2.commands.run("cat /home/user/v.txt /home/user/in.txt").stdout.split() == ["two", "copied"]
    finally:
        s2.kill()
