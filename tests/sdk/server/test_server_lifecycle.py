"""Pause and resume through the real e2b SDK: a running counter process, files and environment
survive pause -> connect, with the server restarted in between; paused sandboxes are listed as
paused; a filesystem-only pause keeps the files; autoPause pauses at timeout and traffic to the
sandbox resumes it."""

import os
import time

import pytest
from e2b import Sandbox, SandboxQuery, SandboxState

from .conftest import KilnServer, mounts_under, read_count, runsc_processes_for

COUNTER = "bash -c 'i=0; while :; do i=$((i+1)); echo $i > /home/user/count; sleep 0.1; done'"


def count(sbx) -> int:
    return read_count(sbx, tries=10, pause=0.02)


def paused_ids(opts) -> set:
    pages = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED]), **opts)
    ids = set()
    while pages.has_next:
        ids.update(s.sandbox_id for s in pages.next_items())
    return ids


def test_pause_connect_across_a_restart(state_dir, server):
    # --pool-off: this test counts the runsc processes and mounts left on the host once every
    # sandbox is killed; a warm pool's sandbox is by design a booted sandbox on the host.
    extra = os.environ.get("KILN_SERVE_EXTRA_ARGS", "").split() + ["--pool-off"]
    first = KilnServer(state_dir, extra).start()
    second = None
    try:
        sbx = Sandbox.create(timeout=120, envs={"KEPT": "across-pauses"}, **first.opts())
        sid = sbx.sandbox_id
        sbx.commands.run(COUNTER, background=True)
        sbx.files.write("/home/user/notes.txt", "written before the pause")
        time.sleep(0.6)
        before = count(sbx)
        assert before > 0

        assert sbx.pause() is True
        assert Sandbox.pause(sid, **first.opts()) is False, "a second pause is a 409"
        assert sid in paused_ids(first.opts())
        info = Sandbox.get_info(sid, **first.opts())
        assert info.state == SandboxState.PAUSED
        status, detail, _ = first.request("GET", f"/sandboxes/{sid}")
        assert status == 200 and detail["state"] == "paused" and detail["pauseMode"] == "full"
        status, metrics, _ = first.request("GET", f"/sandboxes/{sid}/metrics")
        # Its history is kept while paused, and nothing new is sampled.
        assert status == 200 and all(m["timestampUnix"] <= time.time() for m in metrics)
        status, again, _ = first.request("GET", f"/sandboxes/{sid}/metrics")
        assert status == 200 and again == metrics, "a paused sandbox was sampled"
        # Envd traffic to it (no autoResume) is refused, saying why.
        status, body, _ = first.request("GET", "/health", api_key=None,
                                        headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983"})
        assert status == 502 and "paused" in body["message"], body
        # Nothing of it runs on the host while paused. Its container is deleted in the
        # background, right after the pause returned: the sandbox's processes exit on their
        # own, then the server reaps them and runs `runsc delete`, so "no process" is not yet
        # the end; the driver's retiring marker (retiring/<container>) is, and it goes only
        # once the delete is done.
        retiring = os.path.join(state_dir, "gvisor", "sandboxes", sid, "retiring")

        def on_host() -> list:
            marks = os.listdir(retiring) if os.path.isdir(retiring) else []
            return [p for p in runsc_processes_for(state_dir) if sid in p] + marks

        deadline = time.time() + 30
        while on_host() and time.time() < deadline:
            time.sleep(0.1)
        assert not on_host(), f"still on the host 30 s after the pause: {on_host()}"
        time.sleep(0.5)
        assert not on_host(), f"on the host again after its container was deleted: {on_host()}"

        first.stop()
        second = KilnServer(state_dir, extra)
        second.api_key = first.api_key
        second.url = first.url
        second.start()
        assert sid in paused_ids(second.opts()), "still paused after the restart"

        again = Sandbox.connect(sid, timeout=120, **second.opts())
        after = count(again)
        assert before <= after < before + 30, f"the counter restarted or jumped: {before} -> {after}"
        time.sleep(0.5)
        assert count(again) > after, "the counter process does not run after resume"
        assert again.files.read("/home/user/notes.txt") == "written before the pause"
        assert again.commands.run("echo $KEPT").stdout == "across-pauses\n"
        assert sid not in paused_ids(second.opts())

        # Filesystem-only pause: the files stay, the processes do not.
        again.files.write("/home/user/second.txt", "fs pause")
        assert again.pause(keep_memory=False) is True
        status, detail, _ = second.request("GET", f"/sandboxes/{sid}")
        assert detail["pauseMode"] == "filesystem"
        third = Sandbox.connect(sid, timeout=120, **second.opts())
        assert third.files.read("/home/user/second.txt") == "fs pause"
        assert third.commands.run("echo $KEPT").stdout == "across-pauses\n"
        # The counter file stays as the pause kept it (a half-written count, possibly, since the
        # counter truncates before it writes): nothing changes it any more.
        kept = third.files.read("/home/user/count")
        time.sleep(0.4)
        assert third.files.read("/home/user/count") == kept, "a rebooted sandbox runs no old process"

        third.pause()
        third.kill()
        deadline = time.time() + 15
        while (runsc_processes_for(state_dir) or mounts_under(state_dir)) and time.time() < deadline:
            time.sleep(0.1)
        assert not runsc_processes_for(state_dir)
        assert not mounts_under(state_dir)
    finally:
        for s in (second, first):
            if s:
                s.kill_all_sandboxes()
                s.stop()


def test_auto_pause_then_auto_resume_on_traffic(server):
    sbx = Sandbox.create(timeout=3, lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        sbx.files.write("/tmp/mark", "before the auto-pause")
        deadline = time.time() + 30
        while Sandbox.get_info(sbx.sandbox_id).state != SandboxState.PAUSED:
            assert time.time() < deadline, "never auto-paused"
            time.sleep(0.2)
        # Envd traffic to the paused sandbox resumes it transparently.
        assert sbx.files.read("/tmp/mark") == "before the auto-pause"
        assert Sandbox.get_info(sbx.sandbox_id).state == SandboxState.RUNNING
    finally:
        sbx.kill()


def test_set_timeout_zero_applies_the_timeout_action_now(server):
    plain = Sandbox.create(timeout=120)
    pausing = Sandbox.create(timeout=120, lifecycle={"on_timeout": "pause", "auto_resume": False})
    try:
        with pytest.raises(Exception) as ei:
            plain.set_timeout(-1)
        assert "positive" in str(ei.value), ei.value
        assert plain.is_running()
        # Without autoPause the sandbox ends at once.
        plain.set_timeout(0)
        assert not plain.is_running()
        with pytest.raises(Exception) as ei:
            Sandbox.get_info(plain.sandbox_id)
        assert "not found" in str(ei.value).lower()
        # With autoPause it pauses at once, and connect resumes it.
        pausing.files.write("/tmp/mark", "kept")
        pausing.set_timeout(0)
        assert Sandbox.get_info(pausing.sandbox_id).state == SandboxState.PAUSED
        again = Sandbox.connect(pausing.sandbox_id, timeout=60)
        assert again.files.read("/tmp/mark") == "kept"
    finally:
        for s in (plain, pausing):
            try:
                s.kill()
            except Exception:
                pass


def listed_snapshots(**kw) -> list:
    pages = Sandbox.list_snapshots(**kw)
    out = []
    while pages.has_next:
        out.extend(pages.next_items())
    return out


def test_snapshot_outlives_its_source_and_starts_sandboxes(server):
    src = Sandbox.create(timeout=120, envs={"KEPT": "in-snapshot"})
    made = []
    snap = None
    try:
        src.commands.run(COUNTER, background=True)
        src.files.write("/home/user/notes.txt", "captured")
        time.sleep(0.4)
        snap = src.create_snapshot(name="life-snap")
        assert snap.snapshot_id.endswith(":default")
        assert snap.names == ["life-snap:default"]
        # The source keeps running.
        c = count(src)
        time.sleep(0.4)
        assert count(src) > c
        listed = listed_snapshots(sandbox_id=src.sandbox_id)
        assert [s.snapshot_id for s in listed] == [snap.snapshot_id]
        status, raw, _ = server.request("GET", f"/snapshots?sandboxID={src.sandbox_id}")
        assert status == 200 and raw[0]["sizeBytes"] > 0, "disk used is reported"
        src.kill()

        # Twice from the snapshot (by id and by name), after its source is gone.
        for template in (snap.snapshot_id, "life-snap"):
            sbx = Sandbox.create(template=template, timeout=120)
            made.append(sbx)
            assert sbx.files.read("/home/user/notes.txt") == "captured"
            assert sbx.commands.run("echo $KEPT").stdout == "in-snapshot\n"
            c = count(sbx)
            time.sleep(0.4)
            assert count(sbx) > c, "the snapshot's process does not run"
        made[0].files.write("/home/user/notes.txt", "first's own")
        assert made[1].files.read("/home/user/notes.txt") == "captured"

        assert Sandbox.delete_snapshot(snap.snapshot_id) is True
        assert Sandbox.delete_snapshot(snap.snapshot_id) is False
        snap = None
        assert not listed_snapshots(sandbox_id=src.sandbox_id)
    finally:
        for s in made:
            s.kill()
        if snap is not None:
            Sandbox.delete_snapshot(snap.snapshot_id)
        try:
            src.kill()
        except Exception:
            pass


def test_fork_three_children_diverge(server):
    parent = Sandbox.create(timeout=120)
    children = []
    try:
        parent.commands.run(COUNTER, background=True)
        parent.files.write("/home/user/notes.txt", "parent")
        time.sleep(0.4)
        children = parent.fork(count=3, timeout=120)
        assert len(children) == 3
        assert all(not isinstance(c, Exception) for c in children), children
        assert len({c.sandbox_id for c in children} | {parent.sandbox_id}) == 4
        for i, child in enumerate(children):
            assert child.files.read("/home/user/notes.txt") == "parent"
            c = count(child)
            time.sleep(0.3)
            assert count(child) > c
            child.files.write("/home/user/notes.txt", f"child {i}")
        for i, child in enumerate(children):
            assert child.files.read("/home/user/notes.txt") == f"child {i}"
        assert parent.files.read("/home/user/notes.txt") == "parent"
        c = count(parent)
        time.sleep(0.3)
        assert count(parent) > c, "the parent keeps running"
    finally:
        for c in children:
            if not isinstance(c, Exception):
                c.kill()
        parent.kill()


def test_auto_pause_filesystem_only(server):
    sbx = Sandbox.create(timeout=3, lifecycle={"on_timeout": {"action": "pause", "mode": "filesystem"}})
    try:
        sbx.files.write("/home/user/on-disk", "kept")
        deadline = time.time() + 30
        while Sandbox.get_info(sbx.sandbox_id).state != SandboxState.PAUSED:
            assert time.time() < deadline, "never auto-paused"
            time.sleep(0.2)
        status, detail, _ = server.request("GET", f"/sandboxes/{sbx.sandbox_id}")
        assert status == 200 and detail["pauseMode"] == "filesystem"
        again = Sandbox.connect(sbx.sandbox_id, timeout=60)
        assert again.files.read("/home/user/on-disk") == "kept"
    finally:
        sbx.kill()


def test_list_pagination_with_states_never_repeats_or_skips(server):
    made = [Sandbox.create(timeout=120, metadata={"page": "life"}) for _ in range(3)]
    try:
        made[1].pause()
        want = {s.sandbox_id for s in made}
        for state in ("running,paused", "paused", "running"):
            seen, token = [], None
            while True:
                q = f"/v2/sandboxes?state={state}&metadata=page%3Dlife&limit=1"
                if token:
                    q += f"&nextToken={token}"
                status, page, headers = server.request("GET", q)
                assert status == 200 and len(page) <= 1
                seen += [p["sandboxID"] for p in page]
                token = headers.get("x-next-token")
                if not token:
                    break
            assert len(seen) == len(set(seen)), f"{state}: repeated {seen}"
            # Newest first (by start time, then id), as E2B pages.
            newest_first = [s.sandbox_id for s in reversed(made)]
            expect = {
                "running,paused": newest_first,
                "paused": [made[1].sandbox_id],
                "running": [i for i in newest_first if i != made[1].sandbox_id],
            }[state]
            assert seen == expect, f"{state}: {seen}"
        # The SDK's paginator agrees, newest first.
        pager = Sandbox.list(query=SandboxQuery(metadata={"page": "life"}), limit=1)
        first = pager.next_items()
        assert [s.sandbox_id for s in first] == [made[2].sandbox_id]
        # Malformed paging answers 400 naming the parameter.
        for q, word in (("limit=-5", "limit"), ("nextToken=%ff%fe", "nextToken")):
            for path in ("/sandboxes", "/v2/sandboxes"):
                status, resp, _ = server.request("GET", f"{path}?{q}")
                assert status == 400 and word in resp["message"], (path, q, resp)
        paused = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED], metadata={"page": "life"}), limit=1)
        ids = []
        while paused.has_next:
            ids += [s.sandbox_id for s in paused.next_items()]
        assert ids == [made[1].sandbox_id]
    finally:
        for s in made:
            s.kill()
