"""Probing the host from inside a sandbox: nothing of the host is visible or reachable, and
what root in a sandbox plants in the directory shared with the host is never followed."""

import os
import shutil
import socket
import tempfile
import threading

import pytest
from e2b import CommandExitException

from conftest import assert_unharmed


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


def test_planted_link_for_the_agent_socket_is_not_followed(server, sandbox):
    # A host socket the sandbox would like the server to talk to.
    d = tempfile.mkdtemp(prefix="kiln-abuse-bait-")
    bait = os.path.join(d, "bait.sock")
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lst.bind(bait)
    lst.listen(4)
    lst.settimeout(0.2)
    hits = []

    def accept():
        for _ in range(40):
            try:
                c, _ = lst.accept()
                hits.append(c)
            except OSError:
                pass

    t = threading.Thread(target=accept)
    t.start()
    try:
        # The server's side of /run/kiln; the sandbox swaps the agent socket for a link.
        host_run = os.path.join(server.state_dir, "gvisor", "sandboxes", sandbox.sandbox_id, "run")
        assert os.path.exists(os.path.join(host_run, "agent.sock"))
        try:
            run_root(sandbox, f"rm /run/kiln/agent.sock; ln -s {bait} /run/kiln/agent.sock")
        except Exception:
            pass  # the command's own connection may go with the socket
        assert os.path.islink(os.path.join(host_run, "agent.sock"))
        # The API does not talk through the link; its errors carry no host path.
        status, body, _ = server.request(
            "POST",
            "/process.Process/List",
            body={},
            headers={"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "49983",
                     "Connect-Protocol-Version": "1"},
        )
        assert status >= 400
        assert server.state_dir not in str(body) and d not in str(body), body
    finally:
        t.join()
        lst.close()
        shutil.rmtree(d, ignore_errors=True)
    assert not hits, "the server connected through a link planted by the sandbox"


def test_the_shared_run_dir_cannot_fill_the_host(server, sandbox, bystander):
    # /run/kiln is the host's <sandbox>/run: a tiny tmpfs, not the host disk.
    host_run = os.path.join(server.state_dir, "gvisor", "sandboxes", sandbox.sandbox_id, "run")
    with open("/proc/self/mountinfo") as f:
        fstypes = [ln.split(" - ")[1].split()[0] for ln in f if ln.split()[4] == host_run]
    assert fstypes == ["tmpfs"], fstypes
    with pytest.raises(CommandExitException) as ei:
        run_root(sandbox, "head -c 8388608 /dev/zero > /run/kiln/fill")
    assert "No space left" in ei.value.stderr, ei.value.stderr
    r = run_root(
        sandbox, "for i in $(seq 200); do touch /run/kiln/f$i 2>/dev/null || break; done; "
        "ls /run/kiln | wc -l",
    )
    assert int(r.stdout.strip()) <= 32, r.stdout
    used = sum(os.lstat(os.path.join(host_run, n)).st_size for n in os.listdir(host_run))
    assert used <= 64 << 10, used
    # The agent still answers, and the bystander never noticed.
    assert sandbox.commands.run("echo fine").stdout == "fine\n"
    assert_unharmed(bystander)
