"""`kill -9` of the server mid-life, then restart on the same state: running sandboxes are found
again and keep working; sandboxes that died meanwhile are reported gone and cleaned up; no
runsc process, overlay mount or sandbox directory is orphaned."""

import os
import subprocess
import time

from e2b import Sandbox

from .conftest import KilnServer, mounts_under, runsc_processes_for


def test_kill9_restart_adopts_running_and_cleans_dead(state_dir, server):
    # --pool-off: this test counts the runsc processes and mounts left on the host once every
    # sandbox is killed; a warm pool's sandbox is by design a booted sandbox on the host.
    extra = os.environ.get("KILN_SERVE_EXTRA_ARGS", "").split() + ["--pool-off"]
    first = KilnServer(state_dir, extra).start()
    try:
        keep = Sandbox.create(timeout=120, **first.opts())
        keep.files.write("/home/user/survives", "still here")
        doomed = Sandbox.create(timeout=120, **first.opts())
        first.kill9()

        # While the server is down, one sandbox dies behind its back.
        root = os.path.join(state_dir, "gvisor", "runsc")
        subprocess.run(["runsc", f"--root={root}", "--network=none", "--host-uds=create",
                        "delete", "--force", doomed.sandbox_id], check=True, capture_output=True)

        second = KilnServer(state_dir, extra)
        second.api_key = first.api_key  # keys persist; no new key is printed on restart
        second.url = first.url
        second.start()
        try:
            assert "first API key" not in second.log().split("listening on")[-1]
            # Recovery runs in the background once the server listens; its summary follows.
            deadline = time.time() + 30
            while "recovered from the previous run" not in second.log() and time.time() < deadline:
                time.sleep(0.05)
            assert "1 sandbox(es) still running, 1 gone and cleaned up" in second.log()
            again = Sandbox.connect(keep.sandbox_id, **second.opts())
            assert again.files.read("/home/user/survives") == "still here"
            assert again.commands.run("echo after-restart").stdout == "after-restart\n"
            status, body, _ = second.request("GET", f"/sandboxes/{doomed.sandbox_id}")
            assert status == 404 and body["code"] == 404
            # The dead sandbox left nothing behind.
            assert not os.path.exists(os.path.join(state_dir, "gvisor", "sandboxes", doomed.sandbox_id))
            assert not [m for m in mounts_under(state_dir) if doomed.sandbox_id in m]

            again.kill()
            # A kill answers before its teardown ends: wait for the processes, mounts and the
            # sandbox's directory to go.
            sandboxes = os.path.join(state_dir, "gvisor", "sandboxes")
            deadline = time.time() + 15
            while (
                runsc_processes_for(state_dir) or mounts_under(state_dir) or os.listdir(sandboxes)
            ) and time.time() < deadline:
                time.sleep(0.2)
            assert runsc_processes_for(state_dir) == []
            assert mounts_under(state_dir) == []
            assert os.listdir(sandboxes) == []
            assert "panicked" not in second.log()
        finally:
            second.kill9()
    finally:
        first.kill9()
