import gzip
import io
import os
import time
import urllib.request

import pytest

from e2b import FileType
from e2b.exceptions import NotFoundException, InvalidArgumentException, SandboxException
from e2b.sandbox.filesystem.watch_handle import FilesystemEventType
from framework.skip import need_root



def test_write_read_text_and_bytes(sbx, agent):
    p = os.path.join(agent.workdir, "deep/nested/hello.txt")
    info = sbx.files.write(p, "héllo")
    assert info.path == p and info.name == "hello.txt"
    assert sbx.files.read(p) == "héllo"
    blob = bytes(range(256)) * 1000
    sbx.files.write(p, blob)  # overwrite
    assert bytes(sbx.files.read(p, format="bytes")) == blob
    assert b"".join(sbx.files.read(p, format="stream")) == blob
    # octet-stream upload from a file object
    sbx.files.write(p, io.BytesIO(b"from a stream"))
    assert sbx.files.read(p) == "from a stream"


def test_relative_path_resolves_to_user_home(sbx):
    name = f"kiln-agent-rel-{os.getpid()}.txt"
    try:
        sbx.files.write(name, "rel", user="root")
        assert open(os.path.join("/root", name)).read() == "rel"
    finally:
        if os.path.exists(os.path.join("/root", name)):
            os.remove(os.path.join("/root", name))


def test_write_files_multipart(sbx, agent):
    d = agent.workdir
    infos = sbx.files.write_files(
        [{"path": f"{d}/m/a.txt", "data": "A"}, {"path": f"{d}/m/b.bin", "data": b"B\x00"}]
    )
    assert sorted(i.name for i in infos) == ["a.txt", "b.bin"]
    assert open(f"{d}/m/a.txt").read() == "A"
    assert open(f"{d}/m/b.bin", "rb").read() == b"B\x00"


def test_gzip_both_ways(sbx, agent):
    p = os.path.join(agent.workdir, "gz.txt")
    text = "compress me " * 10000
    sbx.files.write(p, text, gzip=True)
    assert open(p).read() == text
    assert sbx.files.read(p, gzip=True) == text
    # the agent really gzips when asked
    req = urllib.request.Request(
        f"{agent.url}/files?path={p}", headers={"Accept-Encoding": "gzip"}
    )
    with urllib.request.urlopen(req) as r:
        assert r.headers["Content-Encoding"] == "gzip"
        assert gzip.decompress(r.read()).decode() == text


def test_metadata_xattrs(sbx, agent):
    p = os.path.join(agent.workdir, "meta.txt")
    try:
        sbx.files.write(p, "m", metadata={"Owner-Team": "kiln", "stage": "test"})
    except SandboxException as e:
        pytest.skip(f"filesystem of {agent.workdir} does not support user xattrs: {e}")
    assert os.getxattr(p, "user.e2b.owner-team") == b"kiln"
    info = sbx.files.get_info(p)
    assert info.metadata == {"owner-team": "kiln", "stage": "test"}


def test_list_depth_stat_mkdir_rename_remove(sbx, agent):
    d = os.path.join(agent.workdir, "tree")
    assert sbx.files.make_dir(d) is True
    assert sbx.files.make_dir(d) is False  # already exists
    sbx.files.write(f"{d}/a/b/c.txt", "c")
    sbx.files.write(f"{d}/top.txt", "t")
    names1 = sorted(e.name for e in sbx.files.list(d))
    assert names1 == ["a", "top.txt"]
    paths3 = sorted(e.path for e in sbx.files.list(d, depth=3))
    assert paths3 == sorted([f"{d}/a", f"{d}/a/b", f"{d}/a/b/c.txt", f"{d}/top.txt"])
    info = sbx.files.get_info(f"{d}/top.txt")
    assert info.type == FileType.FILE and info.size == 1 and info.owner
    assert sbx.files.get_info(f"{d}/a").type == FileType.DIR
    moved = sbx.files.rename(f"{d}/top.txt", f"{d}/renamed.txt")
    assert moved.path == f"{d}/renamed.txt"
    assert sbx.files.exists(f"{d}/renamed.txt") and not sbx.files.exists(f"{d}/top.txt")
    sbx.files.remove(f"{d}/a")
    assert not os.path.exists(f"{d}/a")
    sbx.files.remove(f"{d}/a")  # already gone: succeeds, as in E2B
    with pytest.raises(NotFoundException):
        sbx.files.get_info(f"{d}/a")
    with pytest.raises(NotFoundException):
        sbx.files.read(f"{d}/nope.txt")
    with pytest.raises(InvalidArgumentException):
        sbx.files.list(f"{d}/renamed.txt")


def test_symlink_entry(sbx, agent):
    target = os.path.join(agent.workdir, "target.txt")
    link = os.path.join(agent.workdir, "link.txt")
    open(target, "w").write("x")
    os.symlink(target, link)
    info = sbx.files.get_info(link)
    assert info.symlink_target == target
    # the target's information, not the link's
    os.chmod(target, 0o640)
    info = sbx.files.get_info(link)
    # (the SDK shows the type of any link as SYMLINK; size and mode are the target's)
    assert info.type == FileType.SYMLINK and info.size == 1
    assert info.mode == 0o640 and info.permissions == "-rw-r-----"


def test_watch_dir_events(sbx, agent):
    d = os.path.join(agent.workdir, "watched")
    os.makedirs(d)
    w = sbx.files.watch_dir(d, recursive=True)
    try:
        os.makedirs(f"{d}/sub")
        time.sleep(0.2)
        with open(f"{d}/sub/f.txt", "w") as f:
            f.write("1")
        os.chmod(f"{d}/sub/f.txt", 0o600)
        os.rename(f"{d}/sub/f.txt", f"{d}/g.txt")
        os.remove(f"{d}/g.txt")
        time.sleep(0.3)
        events = w.get_new_events()
    finally:
        w.stop()
    got = {(e.name, e.type) for e in events}
    assert ("sub", FilesystemEventType.CREATE) in got
    assert ("sub/f.txt", FilesystemEventType.CREATE) in got
    assert ("sub/f.txt", FilesystemEventType.WRITE) in got
    assert ("sub/f.txt", FilesystemEventType.CHMOD) in got
    assert ("sub/f.txt", FilesystemEventType.RENAME) in got
    assert ("g.txt", FilesystemEventType.REMOVE) in got


def test_watch_dir_stream_async(agent):
    import asyncio

    d = os.path.join(agent.workdir, "awatched")
    os.makedirs(d)

    async def main():
        s = agent.async_sandbox()
        got = []
        h = await s.files.watch_dir(d, on_event=lambda e: got.append(e))
        await s.files.write(f"{d}/new.txt", "n")
        for _ in range(50):
            if any(e.name == "new.txt" for e in got):
                break
            await asyncio.sleep(0.05)
        await h.stop()
        return got

    got = asyncio.run(main())
    assert any(e.name == "new.txt" and e.type == FilesystemEventType.CREATE for e in got)


def test_user_permissions_decide_paths(sbx, agent):
    need_root("switching users")
    secret = os.path.join(agent.workdir, "secret")
    os.makedirs(secret)
    os.chmod(secret, 0o700)
    open(os.path.join(secret, "s.txt"), "w").write("s")
    escape = os.path.join(agent.workdir, "public", "..", "secret", "s.txt")
    os.makedirs(os.path.join(agent.workdir, "public"))
    link = os.path.join(agent.workdir, "public", "link")
    os.symlink(secret, link)
    # root may follow `..` and symlinks
    assert sbx.files.read(escape, user="root") == "s"
    assert sbx.files.read(os.path.join(link, "s.txt"), user="root") == "s"
    # nobody may not, whichever way the path is spelled
    for p in (escape, os.path.join(link, "s.txt")):
        with pytest.raises(SandboxException):
            sbx.files.read(p, user="nobody")
    with pytest.raises(SandboxException):
        sbx.files.write(os.path.join(link, "x.txt"), "x", user="nobody")
    # files written as a user belong to that user
    pub = os.path.join(agent.workdir, "pubdir")
    os.makedirs(pub)
    os.chmod(pub, 0o777)
    sbx.files.write(os.path.join(pub, "mine.txt"), "m", user="nobody")
    import pwd

    assert os.stat(os.path.join(pub, "mine.txt")).st_uid == pwd.getpwnam("nobody").pw_uid


def test_enospc_is_507(sbx, agent):
    import subprocess

    from e2b.exceptions import NotEnoughSpaceException

    need_root("mounting a small tmpfs")
    small = os.path.join(agent.workdir, "small")
    os.makedirs(small)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", small], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        with pytest.raises(NotEnoughSpaceException):
            sbx.files.write(os.path.join(small, "big.bin"), b"x" * (3 << 20))
        # the agent keeps serving after the failed upload
        sbx.files.write(os.path.join(small, "ok.txt"), "fits")
        assert sbx.files.read(os.path.join(small, "ok.txt")) == "fits"
    finally:
        subprocess.run(["umount", "-l", small])


def test_large_streamed_transfer(sbx, agent):
    # 64 MiB through the SDK's streaming paths, checked by hash, without holding it in the test
    import hashlib

    p = os.path.join(agent.workdir, "large.bin")
    chunk = os.urandom(1 << 20)

    def gen():
        for _ in range(64):
            yield chunk

    sbx.files.write(p, gen())
    assert os.path.getsize(p) == 64 << 20
    h = hashlib.sha256()
    total = 0
    for part in sbx.files.read(p, format="stream"):
        h.update(part)
        total += len(part)
    assert total == 64 << 20
    assert h.hexdigest() == hashlib.sha256(chunk * 64).hexdigest()
