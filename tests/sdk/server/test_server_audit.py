"""The audit log through the real e2b SDK: a scripted session (commands, PTY, upload, download,
watch) produces exactly the expected records in order; 100 concurrent commands give 100 start
and 100 end records; `kiln audit` prints them; editing one stored record makes
`kiln audit verify` fail at that record."""

import json
import os
import sqlite3
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from e2b import Sandbox
from e2b.sandbox.commands.command_handle import PtySize

from .conftest import kiln_bin


def audit(server, sbx_id, kind=None):
    """Every audit record of the sandbox (all pages)."""
    out, cursor = [], ""
    while True:
        q = "limit=200" + (f"&kind={kind}" if kind else "") + (f"&cursor={cursor}" if cursor else "")
        status, page, _ = server.request("GET", f"/sandboxes/{sbx_id}/audit?{q}")
        assert status == 200, page
        out += page["records"]
        cursor = page["nextCursor"]
        if len(page["records"]) < 200:
            return out


def cli(server, *args):
    env = {**os.environ, "KILN_URL": server.url, "KILN_API_KEY": server.api_key}
    return subprocess.run([kiln_bin(), "audit", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def strip(r):
    """The fields of a record a test can predict."""
    b = r["body"]
    if r["kind"] == "process":
        keep = ("event", "cmd", "args", "pty", "exitCode", "signal", "bytes")
    elif r["kind"] == "file":
        keep = ("op", "path", "bytes", "result")
    else:
        keep = ()
    return (r["kind"],) + tuple((k, b[k]) for k in keep if k in b)


def test_scripted_session_is_recorded_exactly_in_order(server):
    sbx = Sandbox.create(timeout=180, **server.opts())
    try:
        r = sbx.commands.run("echo hello")
        assert r.stdout.strip() == "hello"
        try:
            sbx.commands.run("ls /nonexistent-dir")
        except Exception:
            pass
        sbx.files.write("/home/user/a.txt", b"x" * 1000)
        assert sbx.files.read("/home/user/a.txt", format="bytes") == b"x" * 1000
        h = sbx.files.watch_dir("/home/user")
        sbx.files.make_dir("/home/user/d")
        h.stop()
        assert sbx.files.exists("/home/user/d")
        pty = sbx.pty.create(PtySize(rows=24, cols=80))
        sbx.pty.send_stdin(pty.pid, b"echo hi\n")
        time.sleep(0.5)
        sbx.pty.kill(pty.pid)
        try:
            pty.wait()
        except Exception:
            pass
        pid = pty.pid
    finally:
        sbx_id = sbx.sandbox_id
        sbx.kill()

    recs = audit(server, sbx_id)
    # The chain: seq 1, 2, 3 … linked by hashes.
    assert [r["seq"] for r in recs] == list(range(1, len(recs) + 1))
    for a, b in zip(recs, recs[1:]):
        assert b["prevHash"] == a["hash"]

    got = [strip(r) for r in recs if r["kind"] in ("process", "file")]
    bash = "/bin/bash"
    expected = [
        ("process", ("event", "start"), ("cmd", bash), ("args", ["-l", "-c", "echo hello"]), ("pty", False)),
        ("process", ("event", "end"), ("cmd", bash), ("args", ["-l", "-c", "echo hello"]), ("pty", False), ("exitCode", 0)),
        ("process", ("event", "start"), ("cmd", bash), ("args", ["-l", "-c", "ls /nonexistent-dir"]), ("pty", False)),
        ("process", ("event", "end"), ("cmd", bash), ("args", ["-l", "-c", "ls /nonexistent-dir"]), ("pty", False), ("exitCode", 2)),
        ("file", ("op", "write"), ("path", "/home/user/a.txt"), ("bytes", 1000), ("result", "ok")),
        ("file", ("op", "read"), ("path", "/home/user/a.txt"), ("bytes", 1000), ("result", "ok")),
        ("file", ("op", "watch"), ("path", "/home/user"), ("result", "ok")),
        ("file", ("op", "mkdir"), ("path", "/home/user/d"), ("result", "ok")),
        ("file", ("op", "unwatch"), ("result", "ok")),
        ("file", ("op", "stat"), ("path", "/home/user/d"), ("result", "ok")),
    ]
    assert got[:len(expected)] == expected, json.dumps(got, indent=1)
    pty_recs = got[len(expected):]
    assert pty_recs[0][:2] == ("process", ("event", "start")) and ("pty", True) in pty_recs[0], pty_recs
    assert pty_recs[1] == ("process", ("event", "input"), ("pty", True), ("bytes", 8)), pty_recs
    # The kill and the end it causes race (two connections); both are there.
    tail = sorted(pty_recs[2:], key=lambda r: r[1][1])
    assert len(tail) == 2, pty_recs
    assert tail[0][1] == ("event", "end") and ("signal", "killed") in tail[0], tail
    assert tail[1][1] == ("event", "signal"), tail
    start = next(r for r in recs if r["kind"] == "process" and r["body"].get("pty"))
    assert start["body"]["pid"] == pid
    ends = [r for r in recs if r["body"].get("event") == "end"]
    assert all(r["body"]["durationMs"] >= 0 for r in ends)
    assert all("envNames" in r["body"] for r in recs if r["body"].get("event") == "start")

    # API calls and lifecycle on the same chain: created … killed, the create by our key.
    kinds = [(r["kind"], r["body"].get("event") or r["body"].get("route")) for r in recs]
    assert kinds[0] == ("lifecycle", "created"), kinds
    assert kinds[1] in (("api", "/sandboxes"), ("api", "/v2/sandboxes")), kinds
    api = [r for r in recs if r["kind"] == "api"]
    assert api[0]["body"]["method"] == "POST" and api[0]["body"]["status"] == 201
    assert api[0]["body"]["key"].startswith("key_")
    assert ("lifecycle", "killed") in kinds
    assert api[-1]["body"]["method"] == "DELETE" and api[-1]["body"]["status"] == 204, api[-1]
    # Process records carry the key that created the sandbox.
    assert all(r["body"].get("key") == api[0]["body"]["key"] for r in recs
               if r["kind"] == "process" and r["body"]["event"] in ("start", "end"))

    # Filters: kind, and the CLI prints the same records.
    only = audit(server, sbx_id, kind="file")
    assert [strip(r) for r in only] == [g for g in got if g[0] == "file"]
    out = cli(server, sbx_id, "--json", "--kind", "process")
    assert out.returncode == 0, out.stderr
    lines = [json.loads(l) for l in out.stdout.splitlines()]
    assert [strip(r) for r in lines] == [g for g in got if g[0] == "process"]
    human = cli(server, sbx_id)
    assert human.returncode == 0 and "echo hello" in human.stdout and "write /home/user/a.txt" in human.stdout, human.stdout

    # Verification: intact, then one record edited in the database → fails at that record.
    ok = cli(server, "verify", sbx_id)
    assert ok.returncode == 0 and ok.stdout.startswith("ok"), ok.stdout + ok.stderr
    db = sqlite3.connect(os.path.join(server.state_dir, "kiln.db"))
    target = next(r for r in recs if r["kind"] == "file" and r["body"]["op"] == "read")
    db.execute("UPDATE audit SET body = replace(body, '1000', '999') WHERE sandbox_id = ? AND seq = ?",
               (sbx_id, target["seq"]))
    db.commit()
    db.close()
    bad = cli(server, "verify", sbx_id)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert f"at record {target['seq']}:" in bad.stdout, bad.stdout


def test_100_concurrent_commands_give_100_process_records(server):
    sbx = Sandbox.create(timeout=300, **server.opts())
    try:
        def run(i):
            return sbx.commands.run(f"echo n{i}", timeout=240).stdout.strip()

        with ThreadPoolExecutor(max_workers=100) as ex:
            outs = list(ex.map(run, range(100)))
        assert outs == [f"n{i}" for i in range(100)]
        recs = audit(server, sbx.sandbox_id, kind="process")
    finally:
        sbx.kill()
    starts = {r["body"]["args"][-1]: r["body"]["pid"] for r in recs if r["body"]["event"] == "start"}
    ends = {r["body"]["args"][-1]: r["body"] for r in recs if r["body"]["event"] == "end"}
    assert len(starts) == 100 and len(ends) == 100, (len(starts), len(ends))
    for i in range(100):
        c = f"echo n{i}"
        assert ends[c]["pid"] == starts[c] and ends[c]["exitCode"] == 0


def test_follow_streams_new_records(server):
    sbx = Sandbox.create(timeout=120, **server.opts())
    try:
        req = urllib.request.Request(
            f"{server.url}/sandboxes/{sbx.sandbox_id}/audit?follow=true&kind=process",
            headers={"X-API-Key": server.api_key})
        with urllib.request.urlopen(req, timeout=60) as stream:
            sbx.commands.run("echo followed")
            first = json.loads(stream.readline())
            second = json.loads(stream.readline())
        assert first["body"]["event"] == "start" and first["body"]["args"][-1] == "echo followed"
        assert second["body"]["event"] == "end" and second["seq"] > first["seq"]
    finally:
        sbx.kill()


def test_pause_resume_and_fork_lose_nothing_and_forks_link_to_the_parent(server):
    sbx = Sandbox.create(timeout=180, **server.opts())
    child = None
    try:
        sbx.commands.run("echo before")
        assert sbx.pause() is True
        sbx = Sandbox.connect(sbx.sandbox_id, **server.opts())
        sbx.commands.run("echo after")
        children = sbx.fork(count=1, timeout=120)
        assert len(children) == 1 and not isinstance(children[0], Exception), children
        child = children[0]
        child.commands.run("echo child")
        parent_id, child_id = sbx.sandbox_id, child.sandbox_id
    finally:
        sbx.kill()
        if child is not None:
            child.kill()

    recs = audit(server, parent_id)
    cmds = [r["body"]["args"][-1] for r in recs if r["kind"] == "process" and r["body"]["event"] == "start"]
    assert cmds == ["echo before", "echo after"], cmds
    events = [r["body"]["event"] for r in recs if r["kind"] == "lifecycle"]
    assert events.index("paused") < events.index("resumed"), events
    assert "forked" in events and events[-1] == "killed", events

    kid = audit(server, child_id)
    first = kid[0]
    assert first["seq"] == 1 and first["kind"] == "lifecycle"
    assert first["body"]["event"] == "chain_start" and first["body"]["parent"] == parent_id
    linked = next(r for r in recs if r["seq"] == first["body"]["parentSeq"])
    assert first["prevHash"] == linked["hash"], "the child's chain starts at the parent's head"
    assert [r["body"]["args"][-1] for r in kid if r["body"].get("event") == "start"] == ["echo child"]
    for sid in (parent_id, child_id):
        status, v, _ = server.request("GET", f"/audit/verify?sandboxID={sid}")
        assert status == 200 and v["ok"], v
