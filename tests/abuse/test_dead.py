"""A sandbox whose runtime dies on the host is noticed within seconds, cleaned up and reported
as `died`; clients get a plain 404, with no host paths."""

import os
import signal
import time

from conftest import assert_unharmed


def runsc_sandbox_pids(sandbox_id):
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if args and args[0] == b"runsc-sandbox" and any(sandbox_id.encode() in a for a in args):
            pids.append(int(pid))
    return pids


def test_dead_runtime_is_detected_and_cleaned_up(server, sandbox, bystander):
    sid = sandbox.sandbox_id
    pids = runsc_sandbox_pids(sid)
    assert pids, "no runsc-sandbox process found for the sandbox"
    t0 = time.time()
    for p in pids:
        os.kill(p, signal.SIGKILL)
    gone = False
    while time.time() - t0 < 10:
        status, body, _ = server.request("GET", f"/sandboxes/{sid}")
        if status == 404:
            gone = True
            break
        time.sleep(0.1)
    elapsed = time.time() - t0
    assert gone, f"the dead sandbox is still listed: {body}"
    assert elapsed < 5, f"noticed only after {elapsed:.1f}s"
    deadline = time.time() + 3
    while f"{sid} died" not in server.log() and time.time() < deadline:
        time.sleep(0.1)
    assert f"{sid} died" in server.log()
    # Nothing of it is left on the host.
    d = os.path.join(server.state_dir, "gvisor", "sandboxes", sid)
    deadline = time.time() + 5
    while os.path.exists(d) and time.time() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(d)
    # Clients get a clear error without host paths.
    try:
        sandbox.commands.run("echo hi")
        raise AssertionError("a command ran in a dead sandbox")
    except Exception as e:  # the SDK's own exception type
        assert server.state_dir not in str(e), e
    status, body, _ = server.request(
        "POST",
        "/process.Process/List",
        body={},
        headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983",
                 "Connect-Protocol-Version": "1"},
    )
    assert status in (404, 502), (status, body)
    assert server.state_dir not in str(body), body
    assert_unharmed(bystander)
