"""Disk quota: a sandbox's writable disk is an ext4 image of `--disk-mb` (here DISK_MB) on the
host, so a disk fill gets ENOSPC inside at about the quota, the sandbox goes on, and the host
and other sandboxes are unaffected; /tmp is a tmpfs bounded to half the sandbox's memory.
Pauses, snapshots and forks keep the quota (each sandbox has its own)."""

import os
import shutil
import time

from e2b import Sandbox

from conftest import DISK_MB, MEMORY_MB, assert_unharmed, wait_gone

MB = 1 << 20


def _fill(sandbox, path, mb):
    """Writes up to `mb` MiB to `path`; returns (exit code, stderr, MiB written)."""
    r = sandbox.commands.run(
        f"dd if=/dev/zero of={path} bs=1M count={mb} conv=fsync; echo rc=$? >&2; "
        f"stat -c %s {path}",
        timeout=180,
        user="root",
    )
    size = int(r.stdout.strip().splitlines()[-1])
    return r.stderr, size / MB


def _sandbox_dir(server, sbx):
    return os.path.join(server.state_dir, "gvisor", "sandboxes", sbx.sandbox_id)


def test_disk_fill_gets_enospc_at_the_quota(server, sandbox, bystander):
    host_free = shutil.disk_usage(server.state_dir).free
    err, written = _fill(sandbox, "/home/user/fill", DISK_MB * 2)
    assert "No space left on device" in err, err
    # ext4's own metadata and the journal take some of the image.
    assert DISK_MB * 0.75 <= written <= DISK_MB, f"{written:.0f} MiB written of {DISK_MB}"
    # The sandbox still works: commands, a file write through the API once space is freed.
    assert sandbox.commands.run("echo still-here").stdout == "still-here\n"
    sandbox.commands.run("rm /home/user/fill")
    sandbox.files.write("/home/user/after.txt", "x" * (4 * MB))
    assert len(sandbox.files.read("/home/user/after.txt")) == 4 * MB
    # The host gave at most the quota (the sparse image holds what was written).
    img = os.path.join(_sandbox_dir(server, sandbox), "disk.img")
    assert os.stat(img).st_blocks * 512 <= (DISK_MB + 1) * MB
    assert host_free - shutil.disk_usage(server.state_dir).free < (DISK_MB + 64) * MB
    # What the sandbox sees as its disk is the quota.
    df = sandbox.commands.run("df -m / | tail -1").stdout.split()
    assert int(df[1]) <= DISK_MB, df
    assert_unharmed(bystander)
    _, w = _fill(bystander, "/home/user/ten", 10)
    assert w == 10


def test_tmp_is_bounded(sandbox, bystander):
    err, written = _fill(sandbox, "/tmp/fill", MEMORY_MB)
    assert "No space left on device" in err, err
    assert written <= MEMORY_MB // 2, f"{written:.0f} MiB in /tmp"
    assert sandbox.commands.run("echo still-here").stdout == "still-here\n"
    sandbox.commands.run("rm -f /tmp/fill", user="root")
    assert_unharmed(bystander)


def test_pause_snapshot_and_fork_keep_a_quota_each(server, sandbox):
    sandbox.files.write("/home/user/kept.txt", "kept")
    _, w = _fill(sandbox, "/home/user/half", DISK_MB // 2)
    assert w == DISK_MB // 2
    # A full pause and resume: the disk and its quota come back.
    assert sandbox.pause() is True
    again = Sandbox.connect(sandbox.sandbox_id, timeout=120)
    assert again.files.read("/home/user/kept.txt") == "kept"
    snap = again.create_snapshot()
    child = None
    try:
        child = Sandbox.create(template=snap.snapshot_id, timeout=120)
        for sbx in (again, child):
            assert sbx.files.read("/home/user/kept.txt") == "kept"
            # Each continues on its own fresh disk above the frozen layer: a full quota again.
            err, w = _fill(sbx, "/home/user/more", DISK_MB * 2)
            assert "No space left on device" in err, err
            assert DISK_MB * 0.75 <= w <= DISK_MB, f"{w:.0f} MiB"
            sbx.commands.run("rm /home/user/more")
            assert sbx.commands.run("echo ok").stdout == "ok\n"
        # The frozen layer is a read-only mount of the source's disk; the source's writes
        # after the snapshot do not reach the child.
        again.files.write("/home/user/kept.txt", "changed")
        assert child.files.read("/home/user/kept.txt") == "kept"
    finally:
        if child is not None:
            child.kill()
        Sandbox.delete_snapshot(snap.snapshot_id)
    # Killing leaves no image or mount behind.
    d = _sandbox_dir(server, again)
    again.kill()
    assert wait_gone(d)
    with open("/proc/self/mountinfo") as f:
        assert again.sandbox_id not in f.read()
    # The snapshot is deleted and its source gone: its frozen layer and image too (once the
    # sandboxes' teardowns, which run after their kills answered, are done).
    layers = os.path.join(server.state_dir, "gvisor", "layers")
    deadline = time.time() + 30
    while True:
        left = os.listdir(layers) if os.path.isdir(layers) else []
        if not left or time.time() > deadline:
            break
        time.sleep(0.2)
    assert not left, left


def test_console_flood_keeps_host_disk_growth_small(server, sandbox):
    """A sandbox writing 6 GiB to its console (the agent's stdout, open to root as
    /proc/1/fd/1): the log rotates at 4 MiB, checked often enough that the host's disk grows
    by far less than the flood (it grew by > 1 GiB when only the once-a-second tick rotated)."""
    import threading
    import time

    flood_mb = 6144
    sdir = _sandbox_dir(server, sandbox)
    # The flood runs at 50-100 MiB/s here (slower on a busy host): longer than the fixture's
    # 120 s sandbox timeout may allow.
    sandbox.set_timeout(600)

    def used():
        """Host disk the console holds: the blocks allocated to its log files (not the
        filesystem's free space, which other work on the host moves as well)."""
        total = 0
        for name in ("console.log", "console.log.1", "console.log.1.tmp"):
            try:
                total += os.stat(os.path.join(sdir, name)).st_blocks * 512
            except OSError:
                pass
        return total

    base, peak, done = used(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], used() - base)
            time.sleep(0.002)

    t = threading.Thread(target=sample)
    t.start()
    try:
        start = time.time()
        r = sandbox.commands.run(
            f"head -c {flood_mb}M /dev/zero > /proc/1/fd/1; echo rc=$?", user="root", timeout=500)
        took = time.time() - start
    finally:
        done.set()
        t.join()
    assert r.stdout.strip() == "rc=0", r.stderr
    log = os.path.join(_sandbox_dir(server, sandbox), "console.log")
    print(f"console flood: {flood_mb} MiB in {took:.1f} s ({flood_mb / took:.0f} MiB/s), "
          f"host disk grew by at most {peak[0] / MB:.1f} MiB")
    assert peak[0] < 64 * MB, f"host disk grew by {peak[0] / MB:.0f} MiB"
    assert os.path.getsize(log) <= 64 * MB
    # The sandbox goes on, and its console still logs.
    assert sandbox.commands.run("echo still-here").stdout == "still-here\n"
