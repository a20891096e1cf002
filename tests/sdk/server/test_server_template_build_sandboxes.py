"""Build sandboxes are the builds' own: a team whose sandbox quota is full (and whose largest
timeout is below a build's) still builds, its build sandbox is in none of its sandbox lists,
and a client cannot mark a sandbox of its own as one. Builds are bounded per team instead: one
more than `KILN_TEMPLATE_BUILDS_PER_TEAM` started and unfinished is a 429 that says so."""

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
