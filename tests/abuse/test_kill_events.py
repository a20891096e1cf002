"""The processes the agent kills to keep a sandbox alive are reported as events (`oom`,
`pids-limit`, `host-limit`), once each, for the sandbox they happened in: the events API and
the sandbox's audit log carry them, with what was killed."""

import time

import pytest
from e2b import CommandExitException

HOG = "python3 -c 'a = []\nwhile True: a.append(bytearray(16 << 20))'"


def _events(server, sandbox_id, kind):
    status, page, _ = server.request("GET", f"/sandboxes/{sandbox_id}/events?type={kind}")
    assert status == 200, page
    return page["events"]


def _wait_events(server, sandbox_id, kind, n, timeout=30):
    deadline = time.time() + timeout
    events = []
    while time.time() < deadline:
        events = _events(server, sandbox_id, kind)
        if len(events) >= n:
            return events
        time.sleep(0.5)
    return events


def test_an_oom_kill_is_one_oom_event_of_its_sandbox(server, sandbox, bystander):
    with pytest.raises(CommandExitException):
        sandbox.commands.run(HOG, timeout=60)
    events = _wait_events(server, sandbox.sandbox_id, "oom", 1)
    assert len(events) == 1, events
    assert "Out of memory" in events[0]["detail"] and "python3" in events[0]["detail"], events
    assert events[0]["sandboxID"] == sandbox.sandbox_id
    # The sandbox lives on; later samples (every few seconds) do not report the kill again.
    assert sandbox.commands.run("echo ok").stdout == "ok\n"
    time.sleep(12)
    assert len(_events(server, sandbox.sandbox_id, "oom")) == 1
    assert _events(server, bystander.sandbox_id, "oom") == []
    # The audit log has it as a lifecycle record.
    status, page, _ = server.request(
        "GET", f"/sandboxes/{sandbox.sandbox_id}/audit?kind=lifecycle&limit=1000")
    assert status == 200, page
    text = page if isinstance(page, str) else str(page)
    assert "Out of memory" in text, text[-2000:]


def test_an_oom_kill_just_before_the_sandboxs_end_is_on_record(server, sandbox):
    # Samples come every few seconds; the kill asks the agent for its last kills first.
    with pytest.raises(CommandExitException):
        sandbox.commands.run(HOG, timeout=60)
    sandbox.kill()
    events = _events(server, sandbox.sandbox_id, "oom")
    assert len(events) == 1 and "python3" in events[0]["detail"], events
    status, page, _ = server.request("GET", f"/sandboxes/{sandbox.sandbox_id}/events?limit=1000")
    assert status == 200, page
    kinds = [e["type"] for e in page["events"]]
    assert kinds.index("oom") < kinds.index("killed"), kinds


def test_a_fork_does_not_report_its_parents_kills(server, sandbox):
    with pytest.raises(CommandExitException):
        sandbox.commands.run(HOG, timeout=60)
    assert len(_wait_events(server, sandbox.sandbox_id, "oom", 1)) == 1
    (child,) = sandbox.fork(count=1, timeout=120)
    try:
        assert child.commands.run("echo child").stdout == "child\n"
        time.sleep(12)
        assert _events(server, child.sandbox_id, "oom") == []
        # Its own kill is its own event.
        with pytest.raises(CommandExitException):
            child.commands.run(HOG, timeout=60)
        events = _wait_events(server, child.sandbox_id, "oom", 1)
        assert len(events) == 1 and "python3" in events[0]["detail"], events
        assert len(_events(server, sandbox.sandbox_id, "oom")) == 1
    finally:
        child.kill()


def test_a_fork_loop_killed_inside_is_an_event(server, sandbox):
    cmd = sandbox.commands.run("perl -e 'fork while 1'; sleep 1000", background=True)
    deadline = time.time() + 150
    while time.time() < deadline:
        try:
            if not any(p.pid == cmd.pid for p in sandbox.commands.list(request_timeout=5)):
                break
        except Exception:
            pass  # the agent is busy
        time.sleep(1)
    # Killed for its process cap, or as the host side neared its limits, or for memory:
    # whichever of the agent's killers got it first, that kill is an event.
    kinds = "pids-limit,host-limit,oom"
    events = _wait_events(server, sandbox.sandbox_id, kinds, 1)
    assert events, "no kill event for the fork loop"
    assert all("killed command" in e["detail"] for e in events), events
    assert sandbox.commands.run("echo ok").stdout == "ok\n"
