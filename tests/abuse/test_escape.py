"""Probing the host from inside a sandbox: nothing of the host is visible or reachable; the
directory shared with the host at /run/kiln is sealed (only the agent's socket, immutable
outside the server's own windows, again after pause/resume, snapshots and forks); and what
would be planted there is never followed, nor a socket served by anything but the sandbox's
own runtime used."""

import fcntl
import os
import shutil
import socket
import struct
import tempfile
import threading
import time

import pytest
from e2b import CommandExitException, Sandbox

from conftest import assert_unharmed, wait_gone

# <linux/fs.h>
FS_IOC_GETFLAGS = 0x80086601
FS_IOC_SETFLAGS = 0x40086602
FS_IMMUTABLE_FL = 0x10
AGENT_SOCK = "agent.sock"


def run_root(sbx, cmd):
    return sbx.commands.run(cmd, user="root")


def test_proc_and_sys_show_no_host(server, sandbox):
    state = server.state_dir
    r = run_root(
        sandbox,
        "cat /proc/self/mountinfo /proc/mounts /proc/1/cmdline /proc/cmdline "
        "/proc/self/cgroup 2>/dev/null; echo; hostname; ls /sys/class/net /sys/block 2>/dev/null; true",
    )
    assert state not in r.stdout and "/var/lib/kiln" not in r.stdout, r.stdout
    assert r.stdout.split("\n").count(sandbox.sandbox_id) >= 1  # hostname
    # Only the sandbox's own processes.
    n = int(run_root(sandbox, "ps -e --no-headers | wc -l").stdout.strip())
    assert n < 10
    # Masked and read-only kernel interfaces.
    for cmd in [
        "head -c 16 /proc/kcore",
        "echo b > /proc/sysrq-trigger",
        "echo 1 > /proc/sys/kernel/panic",
        "ls /sys/firmware/efi",
    ]:
        with pytest.raises(CommandExitException):
            run_root(sandbox, cmd)


def test_mount_ptrace_kexec_and_modules_fail(sandbox, bystander):
    attempts = {
        "mount": "mount -t tmpfs none /mnt",
        "remount /run/kiln": "mount -o remount,rw,bind /run/kiln",
        "kexec": "python3 -c 'import ctypes,sys; l=ctypes.CDLL(None); "
        "sys.exit(0 if l.syscall(246, 0, 0, 0, 0) == 0 else 1)'",
        "init_module": "python3 -c 'import ctypes,sys; l=ctypes.CDLL(None); "
        "sys.exit(0 if l.syscall(175, 0, 0, b\"\") == 0 else 1)'",
        "reboot": "python3 -c 'import ctypes,sys; l=ctypes.CDLL(None); "
        "sys.exit(0 if l.reboot(0x01234567) == 0 else 1)'",
        "mknod a disk": "mknod /tmp/sda b 8 0 && head -c 512 /tmp/sda",
    }
    for what, cmd in attempts.items():
        with pytest.raises(CommandExitException):
            run_root(sandbox, cmd)
            pytest.fail(f"{what} succeeded")
    # As the user, ptrace of PID 1 (the agent, root) is refused.
    with pytest.raises(CommandExitException):
        sandbox.commands.run(
            "python3 -c 'import ctypes,sys; l=ctypes.CDLL(None); "
            "sys.exit(0 if l.ptrace(16, 1, 0, 0) == 0 else 1)'"
        )
    assert sandbox.commands.run("echo fine").stdout == "fine\n"
    assert_unharmed(bystander)


def host_run(server, sbx):
    """The server's side of the sandbox's /run/kiln."""
    return os.path.join(server.state_dir, "gvisor", "sandboxes", sbx.sandbox_id, "run")


def host_flags(path):
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        return struct.unpack("i", fcntl.ioctl(fd, FS_IOC_GETFLAGS, struct.pack("l", 0))[:4])[0]
    finally:
        os.close(fd)


def set_host_immutable(path, on):
    """What only the server may do (as root on the host): used to simulate a sandbox that won
    a race against the seal."""
    flags = host_flags(path)
    flags = flags | FS_IMMUTABLE_FL if on else flags & ~FS_IMMUTABLE_FL
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        fcntl.ioctl(fd, FS_IOC_SETFLAGS, struct.pack("l", flags))
    finally:
        os.close(fd)


def assert_sealed(server, sbx, what=""):
    """The host side holds only the agent's socket, immutable, and root inside cannot add to
    it; the agent answers through it (first: a snapshot's or fork's source continues in the
    background, and requests wait for it)."""
    assert sbx.commands.run("echo first").stdout == "first\n"
    d = host_run(server, sbx)
    assert sorted(os.listdir(d)) == [AGENT_SOCK], (what, os.listdir(d))
    assert host_flags(d) & FS_IMMUTABLE_FL, f"{what}: /run/kiln is not immutable on the host"
    with pytest.raises(CommandExitException):
        run_root(sbx, "touch /run/kiln/after")
        pytest.fail(f"{what}: a file could be created in /run/kiln")
    assert sorted(os.listdir(d)) == [AGENT_SOCK], (what, os.listdir(d))
    assert sbx.commands.run("echo fine").stdout == "fine\n"


# What root in a sandbox tries in /run/kiln; every one must fail.
ATTEMPTS = {
    "create a file": "touch /run/kiln/f",
    "write a file": "echo x > /run/kiln/f",
    "create a directory": "mkdir /run/kiln/d",
    "create a symlink": "ln -s /etc/passwd /run/kiln/l",
    "hard-link the socket": "ln /run/kiln/agent.sock /run/kiln/h",
    "remove agent.sock": "rm -f /run/kiln/agent.sock",
    "rename agent.sock": "mv /run/kiln/agent.sock /run/kiln/moved",
    "replace agent.sock": "ln -sf /etc/passwd /run/kiln/agent.sock",
    # FS_IOC_SETFLAGS without the immutable flag, then a create.
    "lift the flag": "python3 -c 'import fcntl,os,struct; fd=os.open(\"/run/kiln\", os.O_RDONLY);"
    " fcntl.ioctl(fd, 0x40086602, struct.pack(\"l\", 0))' && touch /run/kiln/f",
}


# gVisor answers the host's EPERM for a fifo or a socket with a synthetic one that lives in the
# sentry's memory only, and keeps a chmod of the mount's root to itself: these may "succeed"
# inside, but nothing reaches the host directory (its entries and mode are checked).
SENTRY_ONLY = {
    "chmod the directory": "chmod 0777 /run/kiln",
    "create a fifo": "mkfifo /run/kiln/p",
    "bind a socket": "python3 -c 'import socket; socket.socket(socket.AF_UNIX).bind(\"/run/kiln/s\")'",
}


def test_root_cannot_change_the_shared_run_dir(server, sandbox, bystander):
    d = host_run(server, sandbox)
    assert_sealed(server, sandbox, "after boot")
    mode = os.lstat(d).st_mode
    for what, cmd in ATTEMPTS.items():
        with pytest.raises(CommandExitException):
            run_root(sandbox, cmd)
            pytest.fail(f"root in the sandbox could {what}")
        assert sorted(os.listdir(d)) == [AGENT_SOCK], (what, os.listdir(d))
    for what, cmd in SENTRY_ONLY.items():
        try:
            run_root(sandbox, cmd)
        except CommandExitException:
            pass
        assert sorted(os.listdir(d)) == [AGENT_SOCK], (what, os.listdir(d))
    assert os.lstat(d).st_mode == mode
    assert os.path.isdir(d) and not os.path.islink(d)
    assert_sealed(server, sandbox, "after the attempts")
    assert_unharmed(bystander)


def test_sealed_again_after_pause_snapshot_and_fork(server):
    sbx = Sandbox.create(timeout=120)
    made = []
    snap = None
    try:
        assert_sealed(server, sbx, "after boot")
        sid = sbx.sandbox_id
        assert sbx.pause() is True
        again = Sandbox.connect(sid, timeout=120)
        assert_sealed(server, again, "after pause and connect")
        again.files.write("/home/user/notes.txt", "captured")
        snap = again.create_snapshot()
        assert again.files.read("/home/user/notes.txt") == "captured"
        assert_sealed(server, again, "the snapshot's source")
        child = Sandbox.create(template=snap.snapshot_id, timeout=120)
        made.append(child)
        assert child.files.read("/home/user/notes.txt") == "captured"
        assert_sealed(server, child, "created from the snapshot")
        forks = again.fork(count=2, timeout=120)
        made.extend(f for f in forks if not isinstance(f, Exception))
        assert len(made) == 3, forks
        for f in forks:
            assert f.files.read("/home/user/notes.txt") == "captured"
            assert_sealed(server, f, "a fork child")
        assert_sealed(server, again, "the fork's parent")
        # Filesystem-only: a fresh boot, sealed on its first connection.
        assert again.pause(keep_memory=False) is True
        third = Sandbox.connect(sid, timeout=120)
        assert third.files.read("/home/user/notes.txt") == "captured"
        assert_sealed(server, third, "after a filesystem-only pause")
    finally:
        for s in made:
            try:
                s.kill()
            except Exception:
                pass
        if snap is not None:
            Sandbox.delete_snapshot(snap.snapshot_id)
        try:
            sbx.kill()
        except Exception:
            pass
    assert wait_gone(os.path.dirname(host_run(server, sbx))), "removal left the dir"


class Bait:
    """A host socket the sandbox would like the server to talk to; records what reaches it."""

    def __init__(self, path=None):
        self.dir = tempfile.mkdtemp(prefix="kiln-abuse-bait-")
        self.path = path or os.path.join(self.dir, "bait.sock")
        self.lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.lst.bind(self.path)
        self.lst.listen(4)
        self.lst.settimeout(0.2)
        self.hits = []
        self.received = b""
        self.t = threading.Thread(target=self._accept)
        self.t.start()

    def _accept(self):
        for _ in range(40):
            try:
                c, _ = self.lst.accept()
            except OSError:
                continue
            self.hits.append(c)
            c.settimeout(1.0)
            try:
                self.received += c.recv(65536)
            except OSError:
                pass

    def close(self):
        self.t.join()
        self.lst.close()
        for c in self.hits:
            c.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def agent_error(sbx):
    """What the SDK reports for a command once the agent socket is not the agent's."""
    try:
        sbx.commands.run("echo through", timeout=20, request_timeout=20)
    except Exception as e:  # noqa: BLE001 - whatever the SDK makes of the 502
        return str(e)
    pytest.fail("a command ran through the replaced agent socket")


def test_planted_link_for_the_agent_socket_is_not_followed(server, sandbox):
    bait = Bait()
    d = host_run(server, sandbox)
    try:
        # From inside, the swap is refused (sealed).
        with pytest.raises(CommandExitException):
            run_root(sandbox, f"rm /run/kiln/agent.sock; ln -s {bait.path} /run/kiln/agent.sock")
        assert not os.path.islink(os.path.join(d, AGENT_SOCK))
        assert sandbox.commands.run("echo fine").stdout == "fine\n"
        # A sandbox that won a race against the seal (simulated from the host): the link is
        # there, and still never followed.
        set_host_immutable(d, False)
        os.unlink(os.path.join(d, AGENT_SOCK))
        os.symlink(bait.path, os.path.join(d, AGENT_SOCK))
        err = agent_error(sandbox)
        assert "replaced" in err, err
        assert server.state_dir not in err and bait.dir not in err, err
    finally:
        bait.close()
    assert not bait.hits, "the server connected through a link planted by the sandbox"


def test_a_socket_not_served_by_the_sandbox_is_refused(server, sandbox):
    """SO_PEERCRED: a socket in place of agent.sock whose listener is a host process (here
    this test) is refused after the connect; not one byte of the request reaches it."""
    d = host_run(server, sandbox)
    assert sandbox.commands.run("echo fine").stdout == "fine\n"
    # (A sandbox cannot do this: simulated from the host, as a sandbox that won a race.)
    set_host_immutable(d, False)
    os.unlink(os.path.join(d, AGENT_SOCK))
    bait = Bait(os.path.join(d, AGENT_SOCK))
    try:
        err = agent_error(sandbox)
        assert "not served by this sandbox" in err, err
        assert server.state_dir not in err, err
    finally:
        time.sleep(0.5)
        bait.close()
    assert bait.hits, "the request never reached the check (the test is not testing it)"
    assert bait.received == b"", f"the server sent {bait.received[:80]!r} to a foreign socket"


def test_the_shared_run_dir_cannot_fill_the_host(server, sandbox, bystander):
    # /run/kiln is the host's <sandbox>/run: a tiny tmpfs, not the host disk, so even in the
    # server's windows (unsealed) it holds 64 KiB and 32 inodes at most.
    d = host_run(server, sandbox)
    with open("/proc/self/mountinfo") as f:
        mounts = [ln.split(" - ")[1].split() for ln in f if ln.split()[4] == d]
    assert [m[0] for m in mounts] == ["tmpfs"], mounts
    opts = mounts[0][2].split(",")
    assert "size=64k" in opts and "nr_inodes=32" in opts, opts
    with pytest.raises(CommandExitException) as ei:
        run_root(sandbox, "head -c 8388608 /dev/zero > /run/kiln/fill")
    assert "not permitted" in ei.value.stderr, ei.value.stderr
    run_root(sandbox, "for i in $(seq 200); do touch /run/kiln/f$i 2>/dev/null || break; done; true")
    assert sorted(os.listdir(d)) == [AGENT_SOCK], os.listdir(d)
    used = sum(os.lstat(os.path.join(d, n)).st_size for n in os.listdir(d))
    assert used <= 64 << 10, used
    # The agent still answers, and the bystander never noticed.
    assert sandbox.commands.run("echo fine").stdout == "fine\n"
    assert_unharmed(bystander)


def test_a_detach_asked_from_inside_is_refused(server, sandbox):
    # Only the server detaches the agent (before a checkpoint, with the directory opened): a
    # root process asking for it by signal or over the agent's own port would only leave the
    # sandbox unreachable.
    sandbox.commands.run("kill -USR1 1", user="root")
    sandbox.commands.run(
        "curl -s -m 5 -X POST http://127.0.0.1:49983/kiln/detach -o /dev/null || true",
        user="root",
    )
    time.sleep(1)
    for _ in range(5):
        assert sandbox.commands.run("echo still", timeout=10).stdout == "still\n"
    # And the server's own pause and resume still work afterwards.
    assert sandbox.pause() is True
    again = Sandbox.connect(sandbox.sandbox_id)
    assert again.commands.run("echo back").stdout == "back\n"
