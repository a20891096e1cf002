"""Standby through the real e2b SDK (`kiln serve --standby-after 2s`): an idle sandbox is
checkpointed to disk while it stays `running` (its runtime gone from the host, `kilnStandby`
in the API, `standby` in its events); a command, a file read, a proxied HTTP request to a
server inside it and a PTY each wake it with its files, environment and a counting process
intact; a CPU-busy sandbox and one created with `kiln.standby=off` never enter standby; the
timeout of a sandbox in standby still ends it (or, with autoPause, pauses it with its memory);
a server killed with -9 adopts its standby sandboxes as standby on restart, and traffic wakes
them; one sandbox's checkpoint does not hold up another's wake."""

import json
import os
import subprocess
import time
import urllib.error
import urllib.request

import pytest
from e2b import CommandExitException, PtySize, Sandbox

from .conftest import KilnServer, kiln_bin, own_server, read_count, runsc_processes_for

STANDBY_AFTER = "2s"
METRICS_TOKEN = "standby-metrics-token-0123"
COUNTER = "i=0; while :; do i=$((i+1)); echo $i > /home/user/count; sleep 0.5; done"


SERVE_ARGS = ["--pool-off", "--standby-after", STANDBY_AFTER, "--metrics-token", METRICS_TOKEN]


def serve_args() -> list:
    return os.environ.get("KILN_SERVE_EXTRA_ARGS", "").split() + SERVE_ARGS


@pytest.fixture(scope="module")
def srv():
    with own_server("kiln-standby-", SERVE_ARGS) as s:
        yield s


def detail(s: KilnServer, sid: str) -> dict:
    status, body, _ = s.request("GET", f"/sandboxes/{sid}")
    assert status == 200, body
    return body


def events(s: KilnServer, sid: str, kind: str) -> list:
    status, body, _ = s.request("GET", f"/sandboxes/{sid}/events?type={kind}&limit=1000")
    assert status == 200, body
    return body["events"]


def runtime_on_host(s: KilnServer, sid: str) -> list:
    return [p for p in runsc_processes_for(s.state_dir) if sid in p]


def wait_standby(s: KilnServer, sid: str, limit: float = 40) -> dict:
    """Polls GET /sandboxes/{id} (which does not count as use) until the sandbox is in standby
    with its checkpoint done (one more `standby` event than before); checks what a client sees
    of it then."""
    seen = len(events(s, sid, "standby"))
    deadline = time.time() + limit
    while time.time() < deadline:
        d = detail(s, sid)
        if d.get("kilnStandby") and len(events(s, sid, "standby")) > seen:
            assert d["state"] == "running", d
            assert d["kilnStandbySince"], d
            return d
        time.sleep(0.25)
    pytest.fail(f"{sid} did not enter standby within {limit}s: {detail(s, sid)}\n"
                f"{s.log()[-4000:]}")


def count(sbx) -> int:
    return read_count(sbx, tries=20, pause=0.05)


def start_detached(sbx, cmd: str):
    """Starts `cmd` in the background inside the sandbox; the SDK call returns at once, so no
    command stream stays open (an open one keeps a sandbox awake)."""
    sbx.commands.run(f"nohup sh -c '{cmd}' >/dev/null 2>&1 &")


def wakes(s: KilnServer, sid: str, seen: int) -> str:
    """The detail of the wake event after the first `seen` ones."""
    deadline = time.time() + 10
    while time.time() < deadline:
        w = events(s, sid, "wake")
        if len(w) > seen:
            return w[seen]["detail"]
        time.sleep(0.1)
    pytest.fail(f"no new wake event for {sid}: {events(s, sid, 'wake')}")


def standby_counts(s: KilnServer) -> tuple:
    """What the server's metrics and `kiln doctor` (reading the state database beside the
    running server) say: (the standby gauge, doctor's running/standby/paused counts)."""
    status, text, _ = s.request("GET", "/metrics", api_key=None,
                                headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
    assert status == 200, text
    gauge = [line.split()[-1] for line in text.splitlines()
             if line.startswith("kiln_sandboxes_standby ")]
    out = subprocess.run([kiln_bin(), "doctor", "--quick", "--json", "--state-dir", s.state_dir],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode in (0, 3), out.stderr
    return float(gauge[0]), json.loads(out.stdout)["sandboxes"]


def proxied_get(s: KilnServer, sid: str, port: int, path: str):
    req = urllib.request.Request(s.url + path, headers={
        "E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(port)})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_standby_and_every_kind_of_traffic_wakes_it_with_state_intact(srv):
    sbx = Sandbox.create(timeout=300, envs={"KEPT": "from-create"}, **srv.opts())
    sid = sbx.sandbox_id
    try:
        sbx.files.write("/home/user/notes.txt", "written before standby")
        sbx.commands.run("mkdir -p /tmp/www && echo served-from-standby > /tmp/www/index.html")
        start_detached(sbx, COUNTER)
        start_detached(sbx, "cd /tmp/www && exec python3 -m http.server 8000")
        deadline = time.time() + 30
        while proxied_get(srv, sid, 8000, "/index.html")[0] != 200:
            assert time.time() < deadline, "the server inside never answered"
            time.sleep(0.2)
        before = count(sbx)

        # Idle: checkpointed to disk, still running to every client.
        wait_standby(srv, sid)
        assert [e["detail"] for e in events(srv, sid, "standby")], "no standby event"
        deadline = time.time() + 15
        while runtime_on_host(srv, sid):
            assert time.time() < deadline, f"runtime still on the host: {runtime_on_host(srv, sid)}"
            time.sleep(0.2)
        info = Sandbox.get_info(sid, **srv.opts())
        assert info.state.value == "running", info
        listed = {x.sandbox_id: x for x in Sandbox.list(**srv.opts()).next_items()}
        assert sid in listed and listed[sid].state.value == "running"
        status, raw_list, _ = srv.request("GET", "/v2/sandboxes")
        assert status == 200
        assert [x["kilnStandby"] for x in raw_list if x["sandboxID"] == sid] == [True]
        gauge, doctor = standby_counts(srv)
        assert gauge >= 1 and doctor["standby"] >= 1, (gauge, doctor)

        # A command wakes it: the environment and the counting process are as they were.
        r = sbx.commands.run("echo $KEPT; cat /home/user/notes.txt")
        assert r.stdout == "from-create\nwritten before standby", r
        assert "envd request" in wakes(srv, sid, 0)
        assert detail(srv, sid)["kilnStandby"] is False
        time.sleep(1.2)
        after_cmd = count(sbx)
        assert after_cmd > before, (before, after_cmd)

        # A file read wakes it.
        wait_standby(srv, sid)
        assert sbx.files.read("/home/user/notes.txt") == "written before standby"
        assert "envd request" in wakes(srv, sid, 1)

        # A proxied HTTP request to a port wakes it; the server inside still listens.
        wait_standby(srv, sid)
        status, body = proxied_get(srv, sid, 8000, "/index.html")
        assert (status, body) == (200, b"served-from-standby\n"), (status, body)
        assert "traffic to port 8000" in wakes(srv, sid, 2)

        # A PTY wakes it.
        wait_standby(srv, sid)
        out = []
        term = sbx.pty.create(PtySize(rows=24, cols=80))
        try:
            sbx.pty.send_stdin(term.pid, b"echo pty-$KEPT-$((6*7)); exit\n")
            term.wait(on_pty=lambda data: out.append(data))
        except CommandExitException:
            pass
        text = b"".join(out).decode(errors="replace")
        assert "pty-from-create-42" in text, text
        assert "envd request" in wakes(srv, sid, 3)
        time.sleep(1.2)
        assert count(sbx) > after_cmd, "the counter stopped counting"

        # Each standby and wake was recorded in order.
        status, body, _ = srv.request("GET", f"/sandboxes/{sid}/events?type=standby,wake&limit=1000")
        kinds = [e["type"] for e in body["events"]]
        assert kinds == ["standby", "wake"] * 4, kinds
    finally:
        sbx.kill()


def test_cpu_busy_and_opted_out_sandboxes_stay_awake(srv):
    idle = Sandbox.create(timeout=120, **srv.opts())
    busy = Sandbox.create(timeout=120, **srv.opts())
    opted = Sandbox.create(timeout=120, metadata={"kiln.standby": "off"}, **srv.opts())
    try:
        start_detached(busy, "while :; do :; done")
        # The control sandbox shows the detector works on this host right now.
        wait_standby(srv, idle.sandbox_id)
        deadline = time.time() + 8
        while time.time() < deadline:
            for s in (busy, opted):
                assert detail(srv, s.sandbox_id)["kilnStandby"] is False, s.sandbox_id
            time.sleep(0.5)
        assert events(srv, busy.sandbox_id, "standby") == []
        assert events(srv, opted.sandbox_id, "standby") == []
        assert busy.commands.run("echo ok").stdout == "ok\n"
        assert detail(srv, opted.sandbox_id)["metadata"]["kiln.standby"] == "off"
    finally:
        for s in (idle, busy, opted):
            s.kill()


def test_a_wake_does_not_wait_for_another_sandboxs_checkpoint(srv):
    """A standby holds its own sandbox, not every sandbox: while a sandbox with a large
    memory is being checkpointed, another one in standby wakes and answers at once (before
    that checkpoint is done and recorded)."""
    small = Sandbox.create(timeout=180, **srv.opts())
    big = Sandbox.create(timeout=180, **srv.opts())
    try:
        wait_standby(srv, small.sandbox_id)
        # 256 MiB that do not compress: its checkpoint takes seconds.
        big.files.write("/tmp/hold.py", "import os, time\nb = os.urandom(256 << 20)\n"
                                        "time.sleep(3600)\n")
        start_detached(big, "exec python3 /tmp/hold.py")
        # `big` idled beside `small` and may have had a (small) standby of its own already: the
        # write above woke it, and that standby's event is on record once the wake is done.
        before = len(events(srv, big.sandbox_id, "standby"))
        deadline = time.time() + 60
        while not detail(srv, big.sandbox_id).get("kilnStandby"):
            assert time.time() < deadline, detail(srv, big.sandbox_id)
            time.sleep(0.05)
        assert len(events(srv, big.sandbox_id, "standby")) == before, \
            "the large checkpoint ended before the test saw it begin"
        assert small.commands.run("echo awake").stdout == "awake\n"
        assert "envd request" in wakes(srv, small.sandbox_id, 0)
        assert len(events(srv, big.sandbox_id, "standby")) == before, \
            "the wake waited for the other sandbox's checkpoint"
        deadline = time.time() + 120
        while len(events(srv, big.sandbox_id, "standby")) == before:
            assert time.time() < deadline, "the large checkpoint never ended"
            time.sleep(0.25)
    finally:
        for s in (small, big):
            s.kill()


def test_the_timeout_of_a_sandbox_in_standby_still_ends_it(srv):
    sbx = Sandbox.create(timeout=12, **srv.opts())
    sid = sbx.sandbox_id
    wait_standby(srv, sid)
    deadline = time.time() + 30
    while srv.request("GET", f"/sandboxes/{sid}")[0] != 404:
        assert time.time() < deadline, detail(srv, sid)
        time.sleep(0.25)
    # The end event follows the runtime's clean-up, which may still be going on after the
    # sandbox is gone from the API.
    deadline = time.time() + 15
    while not events(srv, sid, "timed-out"):
        assert time.time() < deadline, f"no timed-out event: {events(srv, sid, '')}"
        time.sleep(0.2)
    assert events(srv, sid, "wake") == [], "ending it must not wake it"
    gone = os.path.join(srv.state_dir, "gvisor", "sandboxes", sid)
    deadline = time.time() + 15
    while os.path.exists(gone) or runtime_on_host(srv, sid):
        assert time.time() < deadline, f"left behind: {os.path.exists(gone)} {runtime_on_host(srv, sid)}"
        time.sleep(0.2)


def test_auto_pause_at_timeout_of_a_sandbox_in_standby_keeps_its_memory(srv):
    sbx = Sandbox.create(timeout=12, lifecycle={"on_timeout": "pause", "auto_resume": False},
                         **srv.opts())
    sid = sbx.sandbox_id
    try:
        start_detached(sbx, COUNTER)
        time.sleep(1.2)
        before = count(sbx)
        wait_standby(srv, sid)
        deadline = time.time() + 30
        while detail(srv, sid)["state"] != "paused":
            assert time.time() < deadline, detail(srv, sid)
            time.sleep(0.25)
        d = detail(srv, sid)
        assert d["pauseMode"] == "full" and "kilnStandby" not in d, d
        assert events(srv, sid, "wake") == [], "pausing it must not wake it"
        again = Sandbox.connect(sid, timeout=60, **srv.opts())
        time.sleep(1.2)
        assert count(again) > before, "the counter did not go on after the resume"
    finally:
        sbx.kill()


def test_kill9_restart_adopts_standby_sandboxes_and_traffic_wakes_them(state_dir):
    first = KilnServer(state_dir, serve_args()).start()
    second = None
    try:
        sbx = Sandbox.create(timeout=300, envs={"KEPT": "across-restart"}, **first.opts())
        sid = sbx.sandbox_id
        sbx.files.write("/home/user/survives", "kept on disk")
        start_detached(sbx, COUNTER)
        time.sleep(1.2)
        before = count(sbx)
        wait_standby(first, sid)
        first.kill9()

        second = KilnServer(state_dir, serve_args())
        second.api_key, second.url = first.api_key, first.url
        second.start()
        deadline = time.time() + 30
        while "recovered from the previous run" not in second.log():
            assert time.time() < deadline, second.log()[-4000:]
            time.sleep(0.05)
        assert "1 in standby" in second.log(), second.log()[-2000:]
        d = detail(second, sid)
        assert d["state"] == "running" and d["kilnStandby"] is True, d
        assert any("server restart" in e["detail"] for e in events(second, sid, "standby"))
        assert runtime_on_host(second, sid) == [], "adopted in standby: no runtime started"

        again = Sandbox.connect(sid, **second.opts())
        r = again.commands.run("echo $KEPT; cat /home/user/survives")
        assert r.stdout == "across-restart\nkept on disk", r
        assert detail(second, sid)["kilnStandby"] is False
        time.sleep(1.2)
        assert count(again) > before
        again.kill()
    finally:
        if second:
            second.kill9()
        first.kill9()


def test_a_standby_cut_short_by_the_servers_end_stays_running_to_clients(state_dir):
    # The server is killed while a standby's checkpoint is under way (its `standby-begun` is on
    # record, its `standby` not yet): the next server must not take the sandbox for a paused
    # one. It is running to clients (in standby, or awake if the checkpoint never began), its
    # memory whole when traffic wakes it.
    first = KilnServer(state_dir, serve_args()).start()
    second = None
    try:
        sbx = Sandbox.create(timeout=300, **first.opts())
        sid = sbx.sandbox_id
        # 300 MiB of memory to save makes the checkpoint last long enough to be cut short.
        start_detached(sbx, "exec python3 -c \"import time; x = bytearray(300 << 20); "
                            "[x.__setitem__(i, 1) for i in range(0, len(x), 4096)]; time.sleep(1e6)\"")
        start_detached(sbx, COUNTER)
        time.sleep(1)
        before = count(sbx)  # a use: the standby comes STANDBY_AFTER after it
        deadline = time.time() + 60
        while True:
            status, body, _ = first.request(
                "GET", f"/sandboxes/{sid}/events?type=standby-begun,standby,standby-failed&limit=1000")
            assert status == 200, body
            kinds = [e["type"] for e in body["events"]]
            if kinds:
                assert kinds == ["standby-begun"], f"the checkpoint ended before the kill: {kinds}"
                first.kill9()
                break
            assert time.time() < deadline, first.log()[-4000:]
            time.sleep(0.005)

        second = KilnServer(state_dir, serve_args())
        second.api_key, second.url = first.api_key, first.url
        second.start()
        deadline = time.time() + 60
        while ("recovered from the previous run" not in second.log()
               and detail(second, sid)["state"] != "paused"):
            assert time.time() < deadline, second.log()[-4000:]
            time.sleep(0.05)
        d = detail(second, sid)
        assert d["state"] == "running", f"the standby came back as {d['state']}: {d}"
        assert d.get("kilnStandby") or runtime_on_host(second, sid), \
            f"neither in standby nor running on the host: {d}"
        again = Sandbox.connect(sid, timeout=60, **second.opts())
        assert again.commands.run("echo awake").stdout == "awake\n"
        time.sleep(1.2)
        assert count(again) > before, "the counter did not go on"
        assert "python3" in again.commands.run("ps -eo args").stdout, "the 300 MiB process is gone"
    finally:
        for s in (second, first):
            if s is not None:
                s.kill_all_sandboxes()
                s.stop()
