"""Build sandboxes are the builds' own: a team whose sandbox quota is full (and whose largest
timeout is below a build's) still builds, its build sandbox is in none of its sandbox lists,
and a client cannot mark a sandbox of its own as one. Builds are bounded per team instead: one
more than `KILN_TEMPLATE_BUILDS_PER_TEAM` started and unfinished is a 429 that says so.
After a build, a sandbox of its last step's parent layer stands for the template's next
build, which runs a changed last step on it."""

import re
import time

from .conftest import KilnServer, runsc_processes_for


def _build(srv, name, steps):
    status, req, _ = srv.request("POST", "/v3/templates", {"name": name})
    assert status == 202, req
    path = f"/v2/templates/{req['templateID']}/builds/{req['buildID']}"
    status, body, hdrs = srv.request("POST", path, {"fromTemplate": "base", "steps": steps})
    return req, status, body, hdrs


def _wait(srv, req, timeout=240):
    path = f"/templates/{req['templateID']}/builds/{req['buildID']}/status"
    deadline = time.time() + timeout
    while time.time() < deadline:
        _, st, _ = srv.request("GET", path)
        if st["status"] in ("ready", "error"):
            return st
        time.sleep(0.3)
    raise AssertionError(f"build did not end: {st}")


def test_build_sandboxes_are_hidden_and_outside_the_team_quota(state_dir, monkeypatch):
    monkeypatch.setenv("KILN_TEMPLATE_BUILDS_PER_TEAM", "1")
    srv = KilnServer(state_dir, ["--network", "off", "--pool-off", "--team-max-sandboxes", "1",
                                 "--team-max-timeout", "300"]).start()
    try:
        status, mine, _ = srv.request("POST", "/sandboxes", {"templateID": "base", "timeout": 120})
        assert status == 201, mine
        # The team's quota is full now.
        status, body, _ = srv.request("POST", "/sandboxes", {"templateID": "base", "timeout": 120})
        assert status == 429, body
        before = len(runsc_processes_for(state_dir))

        req, status, body, _ = _build(srv, "kt-hidden", [
            {"type": "RUN", "args": ["sleep 6; echo slept > /home/user/slept.txt"], "force": True}])
        assert status == 202, body
        deadline = time.time() + 60
        while len(runsc_processes_for(state_dir)) <= before:
            assert time.time() < deadline, "no build sandbox started"
            time.sleep(0.2)
        # The build sandbox runs: in no list.
        for path in ("/sandboxes", "/v2/sandboxes", "/v2/sandboxes?state=running,paused"):
            status, lst, _ = srv.request("GET", path)
            assert status == 200 and [s["sandboxID"] for s in lst] == [mine["sandboxID"]], lst
        # A second build of the team while the first runs: 429 naming the limit.
        req2, status, body, hdrs = _build(srv, "kt-hidden-2", [
            {"type": "RUN", "args": ["true"], "force": True}])
        assert status == 429, body
        assert "KILN_TEMPLATE_BUILDS_PER_TEAM" in body["message"], body
        assert "1 template builds running or queued" in body["message"], body
        assert hdrs.get("Retry-After"), dict(hdrs)

        st = _wait(srv, req)
        assert st["status"] == "ready", st
        # The refused build can start now that the first has ended.
        path = f"/v2/templates/{req2['templateID']}/builds/{req2['buildID']}"
        status, body, _ = srv.request("POST", path, {"fromTemplate": "base", "steps": [
            {"type": "RUN", "args": ["true"], "force": True}]})
        assert status == 202, body
        assert _wait(srv, req2)["status"] == "ready"

        # The built template starts once the team has room again.
        assert srv.request("DELETE", f"/sandboxes/{mine['sandboxID']}")[0] == 204
        status, sbx, _ = srv.request("POST", "/sandboxes", {"templateID": "kt-hidden", "timeout": 60})
        assert status == 201, sbx

        # Clients cannot mark their sandboxes as build sandboxes.
        status, body, _ = srv.request("POST", "/sandboxes", {
            "templateID": "base", "metadata": {"kiln.template.build": "x"}})
        assert status == 400 and "reserved" in body["message"], body
    finally:
        srv.kill_all_sandboxes()
        srv.stop()


def _running(state_dir):
    """Ids of the sandboxes of this state dir whose runsc processes run now."""
    ids = set()
    for cmd in runsc_processes_for(state_dir):
        ids.update(re.findall(r"/sandboxes/([a-z0-9]{20})/", cmd))
    return ids


def _standing(srv, state_dir):
    """Running sandboxes of the server's state dir that its log shows created and not killed:
    with no sandbox of the test's own, the standing one once booted (a build's sandbox may
    still be exiting)."""
    log = srv.log()
    created = set(re.findall(r'sandbox="([a-z0-9]{20})" event="created"', log))
    killed = set(re.findall(r'sandbox="([a-z0-9]{20})" event="killed"', log))
    return (_running(state_dir) & created) - killed


def _until(what, f, timeout=90):
    deadline = time.time() + timeout
    while True:
        v = f()
        if v:
            return v
        assert time.time() < deadline, what
        time.sleep(0.2)


def _messages(srv, req):
    path = f"/templates/{req['templateID']}/builds/{req['buildID']}/status?level=debug&limit=1000"
    status, st, _ = srv.request("GET", path)
    assert status == 200, st
    return [e["message"] for e in st["logEntries"]]


def _killed_for(srv, sid, why):
    return any(sid in line and why in line for line in srv.log().splitlines())


def _build_and_standing(srv, state_dir, name, steps):
    """Builds `name` to `ready`; the id of the one sandbox standing after it."""
    req, status, body, _ = _build(srv, name, steps)
    assert status == 202, body
    assert _wait(srv, req)["status"] == "ready"
    standing = _until("no sandbox stands after the build", lambda: _standing(srv, state_dir))
    assert len(standing) == 1, standing
    return req, next(iter(standing))


def _stopped(srv, state_dir, sid, why, timeout=90):
    """Waits until sandbox `sid` was killed for `why`; then nothing of it runs."""
    _until(f"{sid} was not stopped ({why})", lambda: _killed_for(srv, sid, why), timeout)
    assert sid not in _running(state_dir)


def test_a_rebuild_runs_its_changed_last_step_on_the_standing_sandbox(state_dir):
    from e2b import Sandbox

    srv = KilnServer(state_dir, ["--network", "off", "--pool-off",
                                 "--template-standing", "10m"]).start()
    try:
        def steps(v):
            return [{"type": "RUN", "args": ["echo one > /home/user/a.txt"]},
                    {"type": "RUN", "args": [f"echo {v} > /home/user/b.txt"]}]

        # Nothing else runs on this server: the one sandbox is the standing one.
        _, first = _build_and_standing(srv, state_dir, "kt-stand", steps("first"))

        req, status, body, _ = _build(srv, "kt-stand", steps("second"))
        assert status == 202, body
        assert _wait(srv, req)["status"] == "ready"
        logs = _messages(srv, req)
        assert any(m.startswith("CACHED [1/2] RUN") for m in logs), logs
        assert any(m.startswith(f"build sandbox {first}: standing on ") for m in logs), logs
        # The template is what its steps say: the cached layer below, the new step on it.
        sbx = Sandbox.create("kt-stand", timeout=60, **srv.opts())
        try:
            out = sbx.commands.run("cat /home/user/a.txt /home/user/b.txt").stdout.split()
            assert out == ["one", "second"], out
            # The taken sandbox ended with its build; a replacement stands on the same layer.
            standing = _until("no replacement stands",
                              lambda: _standing(srv, state_dir) - {sbx.sandbox_id})
            assert _killed_for(srv, first, "its last layer is saved"), srv.log()[-3000:]
        finally:
            sbx.kill()
        assert len(standing) == 1, standing
        (replacement,) = standing

        # Deleting the template stops its standing sandbox.
        status, body, _ = srv.request("DELETE", f"/templates/{req['templateID']}")
        assert status == 204, body
        _stopped(srv, state_dir, replacement, "its template was deleted")

        # One standing from this server is a leftover for the next, which stops it.
        _, left = _build_and_standing(srv, state_dir, "kt-stand-2", steps("x"))
        srv.stop()
        srv.extra_args = ["--network", "off", "--pool-off", "--template-standing", "3s"]
        srv.start()
        _stopped(srv, state_dir, left, "ended with the previous server")

        # Unused, it stops when its time is up.
        _, unused = _build_and_standing(srv, state_dir, "kt-stand-3", steps("y"))
        _stopped(srv, state_dir, unused, "next build did not come in time", 60)
    finally:
        srv.kill_all_sandboxes()
        srv.stop()


def test_no_sandbox_stands_in_the_place_a_create_needs(state_dir):
    # One sandbox at most on this server: after a build, a standing sandbox would take the
    # place of the template's first sandbox.
    srv = KilnServer(state_dir, ["--network", "off", "--pool-off", "--max-sandboxes", "1"]).start()
    try:
        req, status, body, _ = _build(srv, "kt-full", [
            {"type": "RUN", "args": ["echo one > /home/user/a.txt"]},
            {"type": "RUN", "args": ["echo two > /home/user/b.txt"]}])
        assert status == 202, body
        assert _wait(srv, req)["status"] == "ready"
        # A standing sandbox boots within a second of the build's end; none does here.
        time.sleep(5)
        assert not _standing(srv, state_dir), srv.log()[-3000:]
        status, sbx, _ = srv.request("POST", "/sandboxes", {"templateID": "kt-full", "timeout": 60})
        assert status == 201, sbx
    finally:
        srv.kill_all_sandboxes()
        srv.stop()
