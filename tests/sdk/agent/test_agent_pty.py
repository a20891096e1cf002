import time

from e2b import PtySize


def _wait_for(buf, needle, timeout=10):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if needle in bytes(buf):
            return True
        time.sleep(0.05)
    return False


def test_pty_create_input_resize_output(sbx):
    import threading

    from e2b import CommandExitException

    out = bytearray()
    result = {}

    def run():
        try:
            h.wait(on_pty=out.extend)
            result["code"] = 0
        except CommandExitException as e:
            result["code"] = e.exit_code

    h = sbx.pty.create(PtySize(rows=24, cols=80))
    t = threading.Thread(target=run, daemon=True)
    t.start()
    sbx.pty.send_stdin(h.pid, b"echo TERM=$TERM; stty size\n")
    assert _wait_for(out, b"TERM=xterm-256color"), bytes(out)
    assert _wait_for(out, b"24 80"), bytes(out)
    sbx.pty.resize(h.pid, PtySize(rows=40, cols=120))
    sbx.pty.send_stdin(h.pid, b"stty size\n")
    assert _wait_for(out, b"40 120"), bytes(out)
    # raw bytes (a tab and a non-UTF-8 byte through printf) come back unmodified
    sbx.pty.send_stdin(h.pid, b"printf 'X\\x01\\xffY\\n'\n")
    assert _wait_for(out, b"X\x01\xffY"), bytes(out)
    sbx.pty.send_stdin(h.pid, b"exit 3\n")
    t.join(timeout=10)
    assert not t.is_alive()
    assert result["code"] == 3


def test_pty_kill_and_reattach(sbx):
    h = sbx.pty.create(PtySize(rows=10, cols=50))
    pid = h.pid
    h.disconnect()
    out = bytearray()
    import threading

    h2 = sbx.pty.connect(pid)
    t = threading.Thread(target=lambda: _swallow(h2, out), daemon=True)
    t.start()
    sbx.pty.send_stdin(pid, b"echo reattached\n")
    assert _wait_for(out, b"reattached"), bytes(out)
    assert sbx.pty.kill(pid) is True
    t.join(timeout=10)
    assert not t.is_alive()


def _swallow(h, out):
    try:
        h.wait(on_pty=out.extend)
    except Exception:
        pass
