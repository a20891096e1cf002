"""Idle hints through the real e2b SDK (`kiln serve --idle-hint-after 3s --idle-timer-slack-ms
40 --deep-idle-after 6s --deep-idle-timer-slack-ms 300`): a sandbox nobody uses, its runtime
quiet, has every host task of its runtime given 40 ms of timer slack (the systrap controller's
wake-ups coalesce: docs/density.md), 300 ms once it stays hinted 6 s more, and its first
command takes the slack back before it runs; a CPU-busy sandbox and one created with
`kiln.standby=off` are never hinted. The metrics gauge `kiln_sandboxes_idle_hinted` follows."""

import glob
import os
import time

import pytest
from e2b import Sandbox

from .conftest import KilnServer, own_server
from .test_server_standby import start_detached

IDLE_SLACK_NS = 40_000_000
DEEP_SLACK_NS = 300_000_000
KERNEL_SLACK_NS = 50_000
TOKEN = "idle-hint-metrics-token-0123"


@pytest.fixture(scope="module")
def srv():
    with own_server("kiln-idle-hint-", ["--pool-off", "--idle-hint-after", "3s",
                                        "--idle-timer-slack-ms", "40",
                                        "--deep-idle-after", "6s",
                                        "--deep-idle-timer-slack-ms", "300",
                                        "--metrics-token", TOKEN]) as s:
        yield s


def slacks(sid: str) -> list:
    """The timer slack (ns) of every host task in the sandbox's runtime cgroups."""
    files = (glob.glob(f"/sys/fs/cgroup/pids/kiln/{sid}*/tasks")
             or glob.glob(f"/sys/fs/cgroup/kiln/{sid}*/cgroup.threads")
             or glob.glob(f"/sys/fs/cgroup/unified/kiln/{sid}*/cgroup.threads"))
    out = []
    for f in files:
        with open(f) as fh:
            for tid in fh.read().split():
                try:
                    with open(f"/proc/{tid}/timerslack_ns") as t:
                        out.append(int(t.read()))
                except OSError:
                    pass  # the task ended meanwhile
    assert out, f"no host tasks found for {sid}"
    return out


def hinted_gauge(s: KilnServer) -> float:
    status, text, _ = s.request("GET", "/metrics", api_key=None,
                                headers={"Authorization": f"Bearer {TOKEN}"})
    assert status == 200, text
    return float([line.split()[-1] for line in text.splitlines()
                  if line.startswith("kiln_sandboxes_idle_hinted ")][0])


def wait_for(cond, what: str, limit: float = 30):
    deadline = time.time() + limit
    while not cond():
        assert time.time() < deadline, what
        time.sleep(0.2)


def test_an_idle_sandbox_gets_timer_slack_and_its_first_use_takes_it_back(srv):
    sbx = Sandbox.create(timeout=300, **srv.opts())
    sid = sbx.sandbox_id
    try:
        assert sbx.commands.run("echo warm").stdout == "warm\n"
        assert set(slacks(sid)) == {KERNEL_SLACK_NS}, "awake: the kernel's slack"
        wait_for(lambda: set(slacks(sid)) == {IDLE_SLACK_NS},
                 f"the idle slack on every host task: {sorted(set(slacks(sid)))}")
        assert hinted_gauge(srv) == 1

        # The first command takes the hint back before it runs; the slack stays off while it
        # is used.
        t = time.time()
        r = sbx.commands.run("echo used")
        first = time.time() - t
        assert r.stdout == "used\n"
        assert set(slacks(sid)) == {KERNEL_SLACK_NS}, sorted(set(slacks(sid)))
        assert hinted_gauge(srv) == 0
        t = time.time()
        sbx.commands.run("echo again")
        print(f"first command after idleness {first * 1000:.0f} ms, "
              f"next {(time.time() - t) * 1000:.0f} ms")

        # Quiet again: hinted again.
        wait_for(lambda: set(slacks(sid)) == {IDLE_SLACK_NS}, "the hint a second time")
    finally:
        sbx.kill()


def test_a_sandbox_idle_long_gets_the_deep_slack_until_its_next_use(srv):
    sbx = Sandbox.create(timeout=300, **srv.opts())
    sid = sbx.sandbox_id
    try:
        wait_for(lambda: set(slacks(sid)) == {IDLE_SLACK_NS}, "the idle slack first")
        hinted = time.time()
        wait_for(lambda: set(slacks(sid)) == {DEEP_SLACK_NS},
                 f"the deep slack on every host task: {sorted(set(slacks(sid)))}")
        # Not before the deep period (a watcher tick after it at most).
        assert time.time() - hinted > 4, time.time() - hinted
        assert hinted_gauge(srv) == 1, "still one hinted sandbox"
        assert sbx.commands.run("echo used").stdout == "used\n"
        assert set(slacks(sid)) == {KERNEL_SLACK_NS}, sorted(set(slacks(sid)))
        # A new hint starts from the idle slack again.
        wait_for(lambda: set(slacks(sid)) == {IDLE_SLACK_NS}, "the idle slack again")
    finally:
        sbx.kill()


def test_busy_and_opted_out_sandboxes_are_never_hinted(srv):
    busy = Sandbox.create(timeout=300, **srv.opts())
    opted = Sandbox.create(timeout=300, metadata={"kiln.standby": "off"}, **srv.opts())
    try:
        start_detached(busy, "while :; do :; done")
        deadline = time.time() + 8
        while time.time() < deadline:
            for s in (busy, opted):
                assert set(slacks(s.sandbox_id)) == {KERNEL_SLACK_NS}, s.sandbox_id
            time.sleep(0.5)
        assert hinted_gauge(srv) == 0
    finally:
        busy.kill()
        opted.kill()


def test_a_restart_takes_back_the_hints_of_the_previous_run(state_dir):
    args = os.environ.get("KILN_SERVE_EXTRA_ARGS", "").split() + [
        "--pool-off", "--idle-timer-slack-ms", "40", "--idle-hint-after"]
    first = KilnServer(state_dir, args + ["3s"]).start()
    second = None
    try:
        sbx = Sandbox.create(timeout=300, **first.opts())
        sid = sbx.sandbox_id
        wait_for(lambda: set(slacks(sid)) == {IDLE_SLACK_NS}, "the idle slack")
        first.kill9()
        # The next run has not seen it idle: its runtime gets the kernel's slack back.
        second = KilnServer(state_dir, args + ["off"])
        second.api_key, second.url = first.api_key, first.url
        second.start()
        wait_for(lambda: "recovered from the previous run" in second.log(), "recovery")
        assert set(slacks(sid)) == {KERNEL_SLACK_NS}, sorted(set(slacks(sid)))
        again = Sandbox.connect(sid, **second.opts())
        assert again.commands.run("echo back").stdout == "back\n"
        again.kill()
    finally:
        if second:
            second.kill9()
        first.kill9()
