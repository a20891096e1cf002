"""Runaway workloads: each is stopped inside its sandbox, the way a VM would stop it, while the
agent, other commands and other sandboxes carry on."""

import time

import pytest
from e2b import CommandExitException

from conftest import MEMORY_MB, PIDS_LIMIT, assert_unharmed


def test_fork_bomb_is_contained_and_killable(sandbox, bystander):
    bomb = sandbox.commands.run(
        "bomb() { bomb | bomb & }; bomb; sleep 1000", background=True
    )
    # The bomb fills its own pids cgroup (the sandbox's limit less 32, at most memory/2)...
    limit = min(PIDS_LIMIT - 32, MEMORY_MB // 2)
    deadline = time.time() + 30
    count = 0
    while time.time() < deadline:
        out = sandbox.commands.run(
            "cat /sys/fs/cgroup/pids/kiln-cmd-*/pids.current | sort -n | tail -1", user="root"
        ).stdout.strip()
        count = int(out or 0)
        if count >= limit - 8:
            break
        time.sleep(0.2)
    assert limit - 8 <= count <= limit, f"the bomb reached {count} processes (limit {limit})"
    # ...while the agent still runs new commands, as the user and as root.
    assert sandbox.commands.run("echo still-here").stdout == "still-here\n"
    assert sandbox.commands.run("sudo id -u").stdout.strip() == "0"
    # Killing the command ends every process it started.
    bomb.kill()
    deadline = time.time() + 10
    while time.time() < deadline:
        n = int(sandbox.commands.run("ps -e --no-headers | wc -l").stdout.strip())
        if n < 20:
            break
        time.sleep(0.2)
    assert n < 20, sandbox.commands.run("ps -ef").stdout
    assert_unharmed(bystander)


def test_memory_hog_is_oom_killed_inside(sandbox, bystander):
    sandbox.commands.run("sleep 1000", background=True)
    with pytest.raises(CommandExitException) as ei:
        sandbox.commands.run(
            "python3 -c 'a = []\nwhile True: a.append(bytearray(16 << 20))'", timeout=60
        )
    # Killed by SIGKILL, as the kernel's OOM killer would.
    assert ei.value.exit_code in (-1, 137), ei.value
    # The agent and the other process live on.
    assert "sleep 1000" in sandbox.commands.run("ps -eo args").stdout
    r = sandbox.commands.run("python3 -c 'a = bytearray(64 << 20); print(len(a) >> 20)'")
    assert r.stdout.strip() == "64"
    assert_unharmed(bystander)


def test_memory_hog_under_sudo_is_killed_too(sandbox):
    with pytest.raises(CommandExitException) as ei:
        sandbox.commands.run(
            "sudo python3 -c 'a = []\nwhile True: a.append(bytearray(16 << 20))'", timeout=60
        )
    assert ei.value.exit_code in (-1, 137), ei.value
    assert sandbox.commands.run("echo ok").stdout == "ok\n"


def test_metrics_report_the_sandbox_size(sandbox):
    deadline = time.time() + 15
    metrics = []
    while time.time() < deadline and not metrics:
        metrics = sandbox.get_metrics()
        time.sleep(0.5)
    assert metrics, "no metrics"
    assert metrics[-1].mem_total == MEMORY_MB << 20
