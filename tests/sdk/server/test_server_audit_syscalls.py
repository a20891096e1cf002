"""Syscall-level auditing (opt-in per sandbox: metadata `kiln.audit.syscalls=true`) through the
real e2b SDK: gVisor's runtime monitoring sends the sandbox's open/openat/execve/connect calls
to kiln, which records them as `syscall` records of the sandbox's chain. A sandbox without the
key gets none."""

from e2b import Sandbox

from .test_server_audit import audit

FLAG = {"kiln.audit.syscalls": "true"}


def syscalls(server, sbx_id):
    return audit(server, sbx_id, "syscall")


def test_an_audited_sandbox_records_its_open_execve_and_connect_calls(server):
    sbx = Sandbox.create(timeout=120, metadata=FLAG, **server.opts())
    plain = Sandbox.create(timeout=120, **server.opts())
    try:
        code = 'import socket; open("/etc/hostname").read(); ' \
               'socket.socket(socket.AF_UNIX).connect_ex("/tmp/nobody-listens")'
        for s in (sbx, plain):
            r = s.commands.run(f"python3 -c '{code}'")
            assert r.exit_code == 0, r.stderr
        recs = syscalls(server, sbx.sandbox_id)
        assert syscalls(server, plain.sandbox_id) == []
    finally:
        sbx.kill()
        plain.kill()
    bodies = [r["body"] for r in recs]
    opens = [b for b in bodies if b["call"] in ("open", "openat") and b["path"] == "/etc/hostname"]
    assert len(opens) == 1, bodies[-40:]
    o = opens[0]
    assert o["process"] == "python3" and o["result"] >= 0 and "errno" not in o, o
    assert isinstance(o["pid"], int) and o["pid"] > 1
    execs = [b for b in bodies if b["call"] == "execve" and b["argv"][:1] == ["python3"]]
    assert execs and execs[0]["argv"][1] == "-c", [b for b in bodies if b["call"] == "execve"]
    conns = [b for b in bodies if b["call"] == "connect" and b["address"] == "unix:/tmp/nobody-listens"]
    assert len(conns) == 1 and conns[0]["errno"] == 2, conns  # ENOENT
    # The execve precedes the open, which precedes the connect; nothing from the agent itself.
    seqs = [r["seq"] for r in recs]
    assert seqs == sorted(seqs)
    assert bodies.index(execs[0]) < bodies.index(o) < bodies.index(conns[0])
    assert all(b["process"] != "kiln-agent" for b in bodies)
    status, v, _ = server.request("GET", f"/audit/verify?sandboxID={sbx.sandbox_id}")
    assert status == 200 and v["ok"], v


def opened(server, sbx_id, path):
    return [r["body"] for r in syscalls(server, sbx_id)
            if r["body"]["call"] in ("open", "openat") and r["body"].get("path") == path]


def test_auditing_goes_on_after_resume_and_into_fork_children(server):
    """The trace session is not part of a checkpoint: a resumed sandbox and each fork child
    start theirs again, so their calls after the restore are recorded too."""
    sbx = Sandbox.create(timeout=120, metadata=FLAG, **server.opts())
    children = []
    try:
        sbx.files.write("/tmp/after-resume", "x")
        assert sbx.pause() is True
        sbx = Sandbox.connect(sbx.sandbox_id, **server.opts())
        r = sbx.commands.run("python3 -c 'open(\"/tmp/after-resume\").read()'")
        assert r.exit_code == 0, r.stderr
        got = opened(server, sbx.sandbox_id, "/tmp/after-resume")
        assert len(got) == 1 and got[0]["process"] == "python3", got

        forked = sbx.fork(count=1, timeout=120)
        assert len(forked) == 1 and not isinstance(forked[0], Exception), forked
        child = forked[0]
        child_id = child.sandbox_id
        children.append(child)
        r = child.commands.run("python3 -c 'open(\"/tmp/after-resume\").read()'")
        assert r.exit_code == 0, r.stderr
        got = opened(server, child_id, "/tmp/after-resume")
        assert len(got) == 1 and got[0]["process"] == "python3", got
        # The parent, restored beside its child, is still audited.
        r = sbx.commands.run("python3 -c 'open(\"/etc/hostname\").read()'")
        assert r.exit_code == 0, r.stderr
        assert len(opened(server, sbx.sandbox_id, "/etc/hostname")) >= 1
    finally:
        for c in children:
            c.kill()
        sbx.kill()
