"""E2B behaviours a user trips over (issue 33), with the published e2b SDK against `kiln serve`:
signed file URLs for clients without routing headers, symlinks, file metadata, watch event
sequences, the base template's `python`."""

import json
import urllib.error
import urllib.request
import uuid

from e2b import FileType


def fetch(url: str, data: bytes = None, headers: dict = None):
    """(status, body) of a plain urllib request: no E2B routing headers, no API key."""
    req = urllib.request.Request(url, data=data, headers=headers or {},
                                 method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_signed_urls_work_without_routing_headers(sandbox):
    sandbox.files.write("/home/user/dl.txt", "signed body")
    url = sandbox.download_url("/home/user/dl.txt", use_signature_expiration=60)
    # With E2B_SANDBOX_URL set the URL names no sandbox: the signature finds it.
    assert sandbox.sandbox_id not in url and "signature=" in url, url
    assert fetch(url) == (200, b"signed body")
    # Without an expiry too.
    assert fetch(sandbox.download_url("/home/user/dl.txt")) == (200, b"signed body")

    up = sandbox.upload_url("/home/user/up.txt", use_signature_expiration=60)
    boundary = uuid.uuid4().hex
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"up.txt\"\r\n"
            f"Content-Type: application/octet-stream\r\n\r\nuploaded by urllib\r\n--{boundary}--\r\n").encode()
    status, resp = fetch(up, body, {"Content-Type": f"multipart/form-data; boundary={boundary}"})
    assert status == 200, resp
    assert sandbox.files.read("/home/user/up.txt") == "uploaded by urllib"

    # A signature for another path, or a read signature used to write, is refused.
    status, resp = fetch(url.replace("dl.txt", "up.txt"))
    assert status == 401, resp
    status, resp = fetch(url, body, {"Content-Type": f"multipart/form-data; boundary={boundary}"})
    assert status == 401, resp

    expired = sandbox.download_url("/home/user/dl.txt", use_signature_expiration=-5)
    status, resp = fetch(expired)
    assert status == 401 and json.loads(resp)["message"] == "signature is already expired", resp


def test_python_command_is_python3(sandbox):
    r = sandbox.commands.run("python -c 'import sys; print(sys.version_info[0])'")
    assert r.stdout == "3\n", r.stderr


def test_get_host_names_resolve_with_pythons_resolver(state_dir):
    """`kiln serve` (preparing the host, as for a user) makes `{port}-{id}.localhost` resolve
    through the C library's resolver, which Python uses; `kiln doctor` says so."""
    import os
    import socket
    import subprocess
    import time

    from e2b import Sandbox

    from .conftest import KilnServer, kiln_bin

    srv = KilnServer(state_dir, prepare=True).start(timeout=600)
    sbx = None
    try:
        sbx = Sandbox.create(timeout=120, **srv.opts())
        sbx.commands.run("mkdir -p /tmp/www && echo hi-from-8000 > /tmp/www/index.html")
        sbx.commands.run("cd /tmp/www && python3 -m http.server 8000", background=True)
        host = sbx.get_host(8000)
        assert host == f"8000-{sbx.sandbox_id}.localhost", host
        port = int(srv.url.rsplit(":", 1)[1])
        addrs = {a[4][0] for a in socket.getaddrinfo(host, port)}
        assert addrs and all(a in ("127.0.0.1", "::1") for a in addrs), addrs
        deadline, body = time.time() + 30, None
        while time.time() < deadline:
            status, body = fetch(f"http://{host}:{port}/index.html")
            if status == 200:
                break
            time.sleep(0.2)
        assert body == b"hi-from-8000\n", body
        r = subprocess.run([kiln_bin(), "doctor", "--quick", "--json"], capture_output=True,
                           text=True, timeout=120, env={**os.environ, "KILN_DOMAIN": "localhost"})
        names = [c for c in json.loads(r.stdout)["checks"] if c["name"] == "host names"]
        assert names and names[0]["ok"], names
    finally:
        if sbx:
            sbx.kill()
        srv.stop()


def connect_json(sandbox, method: str, body: dict) -> dict:
    """A filesystem RPC in Connect's JSON form, as envd's wire carries it (what the SDK maps
    into its own types)."""
    import base64

    url = f"{sandbox.connection_config.get_sandbox_url(sandbox.sandbox_id, sandbox.sandbox_domain)}" \
          f"/filesystem.Filesystem/{method}"
    headers = {
        "Content-Type": "application/json",
        "E2b-Sandbox-Id": sandbox.sandbox_id,
        "E2b-Sandbox-Port": "49983",
        "X-Access-Token": sandbox._envd_access_token,
        "Authorization": "Basic " + base64.b64encode(b"user:").decode(),
    }
    status, resp = fetch(url, json.dumps(body).encode(), headers)
    assert status == 200, resp
    return json.loads(resp)


def test_symlinks_report_the_targets_type_and_target(sandbox):
    sandbox.commands.run("mkdir -p /home/user/ln/dir && printf 12345 > /home/user/ln/file.txt && "
                         "ln -s /home/user/ln/file.txt /home/user/ln/to-file && "
                         "ln -s dir /home/user/ln/to-dir && ln -s nowhere /home/user/ln/dangling")
    # On the wire, as envd: the target's type, `isSymlink` and the resolved target.
    e = connect_json(sandbox, "Stat", {"path": "/home/user/ln/to-file"})["entry"]
    assert e["type"] == "FILE_TYPE_FILE" and e["isSymlink"] is True, e
    assert e["symlinkTarget"] == "/home/user/ln/file.txt" and int(e["size"]) == 5, e
    e = connect_json(sandbox, "Stat", {"path": "/home/user/ln/to-dir"})["entry"]
    assert e["type"] == "FILE_TYPE_DIRECTORY" and e["symlinkTarget"] == "/home/user/ln/dir", e
    # The SDK shows links as SYMLINK (it reads `isSymlink`), with the target and its size.
    info = sandbox.files.get_info("/home/user/ln/to-file")
    assert info.type == FileType.SYMLINK and info.symlink_target == "/home/user/ln/file.txt"
    assert info.size == 5
    listed = {x.name: x for x in sandbox.files.list("/home/user/ln")}
    assert listed["to-dir"].type == FileType.SYMLINK
    assert listed["to-dir"].symlink_target == "/home/user/ln/dir"
    assert listed["file.txt"].type == FileType.FILE and listed["file.txt"].symlink_target is None
    assert listed["dangling"].symlink_target.endswith("nowhere")
    # A listing does not descend into linked directories.
    deep = [x.path for x in sandbox.files.list("/home/user/ln", depth=3)]
    assert "/home/user/ln/to-dir" in deep and not any(p.startswith("/home/user/ln/to-dir/") for p in deep)


def test_file_metadata_on_write_list_rename_and_info(sandbox):
    want = {"owner-team": "kiln", "stage": "test"}
    info = sandbox.files.write("/home/user/meta/a.txt", "a", metadata={"Owner-Team": "kiln", "stage": "test"})
    assert info.metadata == want
    assert sandbox.files.get_info("/home/user/meta/a.txt").metadata == want
    assert {e.name: e.metadata for e in sandbox.files.list("/home/user/meta")} == {"a.txt": want}
    # A rename keeps it (also of the directory holding the file).
    moved = sandbox.files.rename("/home/user/meta/a.txt", "/home/user/meta/b.txt")
    assert moved.metadata == want
    sandbox.files.rename("/home/user/meta", "/home/user/meta2")
    assert sandbox.files.get_info("/home/user/meta2/b.txt").metadata == want
    # An overwrite replaces it: new metadata, or none.
    sandbox.files.write("/home/user/meta2/b.txt", "b", metadata={"k": "v"})
    assert sandbox.files.get_info("/home/user/meta2/b.txt").metadata == {"k": "v"}
    sandbox.files.write("/home/user/meta2/b.txt", "c")
    assert sandbox.files.get_info("/home/user/meta2/b.txt").metadata is None
    # A removed file's metadata goes with it.
    sandbox.files.write("/home/user/meta2/c.txt", "c", metadata={"gone": "soon"})
    sandbox.files.remove("/home/user/meta2/c.txt")
    sandbox.files.write("/home/user/meta2/c.txt", "again")
    assert sandbox.files.get_info("/home/user/meta2/c.txt").metadata is None
    # A file replaced from inside the sandbox is another file: no stale metadata.
    sandbox.files.write("/home/user/meta2/d.txt", "d", metadata={"stale": "yes"})
    sandbox.commands.run("cd /home/user/meta2 && mv d.txt d.old && echo new > d.txt")
    assert sandbox.files.get_info("/home/user/meta2/d.txt").metadata is None
    # Where the file system has user xattrs (gVisor's tmpfs), ones set inside show up too.
    sandbox.commands.run("echo t > /tmp/x && python3 -c \"import os; "
                         "os.setxattr('/tmp/x', 'user.e2b.color', b'blue')\"")
    assert sandbox.files.get_info("/tmp/x").metadata == {"color": "blue"}
    # Multi-file writes carry the same metadata on every file.
    infos = sandbox.files.write_files([{"path": "/home/user/m/x", "data": "x"},
                                       {"path": "/home/user/m/y", "data": "y"}], metadata={"batch": "1"})
    assert [i.metadata for i in infos] == [{"batch": "1"}] * 2
    assert sandbox.files.get_info("/home/user/m/y").metadata == {"batch": "1"}


def events_of(handle, count: int, settle: float = 0.5) -> list:
    """(name, type) of a watch's events once `count` arrived, plus any that follow within
    `settle` seconds."""
    import time

    got = []
    deadline = time.time() + 15
    while len(got) < count and time.time() < deadline:
        got += [(e.name, e.type) for e in handle.get_new_events()]
        time.sleep(0.05)
    time.sleep(settle)
    got += [(e.name, e.type) for e in handle.get_new_events()]
    return got


def test_watch_event_sequences_match_envd(sandbox):
    from e2b import FilesystemEventType as T

    d = "/home/user/watched"
    sandbox.files.make_dir(d)
    h = sandbox.files.watch_dir(d, recursive=True)
    try:
        # A new file written through the API: create, the chown to the writer, the data.
        sandbox.files.write(f"{d}/new.txt", "x")
        assert events_of(h, 3) == [("new.txt", T.CREATE), ("new.txt", T.CHMOD), ("new.txt", T.WRITE)]
        # Overwriting it: the truncation, the chown, the data.
        sandbox.files.write(f"{d}/new.txt", "y")
        assert events_of(h, 3) == [("new.txt", T.WRITE), ("new.txt", T.CHMOD), ("new.txt", T.WRITE)]
        sandbox.commands.run(f"chmod 600 {d}/new.txt")
        assert events_of(h, 1) == [("new.txt", T.CHMOD)]
        sandbox.commands.run(f"sudo chown root {d}/new.txt")
        assert events_of(h, 1) == [("new.txt", T.CHMOD)]
        sandbox.commands.run(f"sudo chown user {d}/new.txt")
        events_of(h, 1)
        sandbox.files.rename(f"{d}/new.txt", f"{d}/renamed.txt")
        assert events_of(h, 2) == [("new.txt", T.RENAME), ("renamed.txt", T.CREATE)]
        sandbox.files.remove(f"{d}/renamed.txt")
        assert events_of(h, 1) == [("renamed.txt", T.REMOVE)]
        # Recursive: a new directory is watched too, names are relative to the watched one.
        sandbox.files.make_dir(f"{d}/sub")
        assert events_of(h, 1)[0] == ("sub", T.CREATE)
        sandbox.files.write(f"{d}/sub/f.txt", "z")
        assert events_of(h, 3) == [("sub/f.txt", T.CREATE), ("sub/f.txt", T.CHMOD), ("sub/f.txt", T.WRITE)]
        sandbox.files.remove(f"{d}/sub")
        assert ("sub", T.REMOVE) in events_of(h, 2)
    finally:
        h.stop()
