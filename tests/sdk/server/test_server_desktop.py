"""The published `e2b-desktop` SDK against a kiln sandbox of the `desktop` template (real gVisor,
real Xvfb, real x11vnc and noVNC), plus kiln's computer-use action API (port 49990).

Everything goes through `kiln serve` with sandbox networking on: the SDK's envd calls, the noVNC
view on port 6080 (rendered by the host's Chromium through Playwright, with the sandbox host
names resolved to the server) and the action API. One desktop sandbox serves the whole module
(Chromium-class sandboxes are heavy on a shared machine).
"""

import base64
import json
import os
import re
import shutil
import time

import pytest
from e2b import CommandExitException
from e2b_desktop import Sandbox

from .rich_support import (colour_share, distinct_colours, ensure_template, need, png_size,
                           port_request, start_net_server, stop_net_server)

WIDTH, HEIGHT = 800, 600
# The desktop's background colour (templates/desktop.toml, xfce4-desktop.xml).
BACKGROUND = (0x3B, 0x6E, 0xA5)
ACTIONS_PORT = 49990
HOST_CHROMIUM = os.environ.get("KILN_HOST_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture(scope="module")
def net_server():
    srv, base = start_net_server("kiln-desktop-srv-", "10.137.0.0/24")
    try:
        yield srv
    finally:
        stop_net_server(srv, base)


@pytest.fixture(scope="module")
def desk(net_server):
    tpl = ensure_template(net_server, "desktop")
    s = Sandbox.create(template=tpl, resolution=(WIDTH, HEIGHT), timeout=900, **net_server.opts())
    try:
        # Chromium and LibreOffice need the template's 3 GiB: in a sandbox of the server's
        # default 512 MiB the in-sandbox OOM killer takes them.
        status, info, _ = net_server.request("GET", f"/sandboxes/{s.sandbox_id}")
        assert status == 200 and info["memoryMB"] == 3072, info
        status, templates, _ = net_server.request("GET", "/templates")
        assert [t["memoryMB"] for t in templates if t["templateID"] == "desktop"] == [3072], templates
        yield s
    finally:
        s.kill()


def diagnose(server, desk, log=None) -> str:
    """What a Chromium that did not come up leaves behind: its log, the in-sandbox OOM
    killer's lines, the processes and the memory."""
    out = []
    if log:
        out.append(desk.commands.run(f"tail -n 30 {log} 2>&1 || true").stdout)
    status, logs, _ = server.request("GET", f"/sandboxes/{desk.sandbox_id}/logs")
    if status == 200:
        out += [e["message"] for e in logs.get("logEntries", []) if "memory" in e["message"]]
    out.append(desk.commands.run("ps -eo pid,nlwp,rss,args --sort=-rss | head -n 15; free -m",
                                 timeout=30).stdout)
    return "\n".join(out)


def wait_for(fn, what, timeout=30, interval=0.3):
    deadline = time.time() + timeout
    while True:
        v = fn()
        if v:
            return v
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(interval)


def windows(desk, name):
    r = desk.commands.run(f"xdotool search --onlyvisible --name '{name}' || true")
    return [w for w in r.stdout.split() if w]


def actions(server, desk, body):
    status, data, _ = port_request(server, desk.sandbox_id, ACTIONS_PORT, "POST", "/actions",
                                   json.dumps(body).encode(), {"Content-Type": "application/json"})
    return status, json.loads(data)


def test_desktop_session_runs_with_the_names_the_sdk_checks(desk):
    # Sandbox.create already waited for these; they keep running. The session is XFCE's own:
    # its panel, settings daemon and Thunar's daemon run beside them.
    for name in ["Xvfb", "xfce4-session", "xfwm4", "xfdesktop", "xfce4-panel", "xfsettingsd", "Thunar"]:
        assert desk.commands.run(f"pgrep -x {name}").exit_code == 0, name
    assert desk.get_screen_size() == (WIDTH, HEIGHT)


def test_screenshot_is_a_png_of_the_configured_size(desk):
    png = bytes(desk.screenshot())
    assert png_size(png) == (WIDTH, HEIGHT)
    # The desktop's background fills most of an empty screen.
    assert colour_share(png, BACKGROUND) > 0.5


def test_type_into_a_text_window_and_read_it_back(desk):
    # kiln-notepad: the template's small Tk text window (Ctrl+S saves to its file).
    desk.commands.run("rm -f /tmp/typed.txt")
    h = desk.commands.run("exec kiln-notepad /tmp/typed.txt", background=True, timeout=0)
    try:
        def app_windows():
            # The SDK's query; xdotool exits 1 until the window is mapped.
            try:
                return [w for w in desk.get_application_windows("kiln-notepad") if w]
            except CommandExitException:
                return []
        wins = wait_for(app_windows, "the text window")
        assert desk.get_window_title(wins[0]) == "kiln-notepad: /tmp/typed.txt"
        desk.left_click(200, 120)
        desk.write("hello from kiln", chunk_size=8, delay_in_ms=20)
        desk.press("enter")
        desk.write("line two")
        desk.press(["ctrl", "s"])
        text = wait_for(lambda: desk.commands.run("cat /tmp/typed.txt 2>/dev/null || true").stdout,
                        "the saved text")
        assert text == "hello from kiln\nline two"
    finally:
        h.kill()


def test_mouse_clicks_reach_a_window(desk):
    desk.commands.run("rm -f /tmp/xev.log")
    h = desk.commands.run("exec stdbuf -oL xev -geometry 300x200+300+300 -event button > /tmp/xev.log",
                          background=True, timeout=0)
    try:
        wait_for(lambda: windows(desk, "Event Tester"), "the xev window")
        time.sleep(0.5)
        desk.move_mouse(420, 400)
        assert desk.get_cursor_position() == (420, 400)
        desk.left_click()
        desk.right_click(430, 410)
        desk.double_click(440, 420)
        desk.scroll("down", 2)

        def presses():
            log = desk.commands.run("cat /tmp/xev.log").stdout
            return re.findall(r"ButtonPress event.*?button (\d+)", log, re.S)
        got = wait_for(lambda: (p := presses()) and len(p) >= 6 and p, "button presses")
        assert got[:6] == ["1", "3", "1", "1", "5", "5"], got
    finally:
        h.kill()


def render_stream(server, url: str, out: str, until=None) -> bytes:
    """Opens the stream URL in the host's headless Chromium (Playwright) with the sandbox host
    names resolved to the kiln server; returns a PNG screenshot after the VNC view settles, or
    (with `until`) the first one `until(png)` accepts within 150 s (noVNC's modules, the
    WebSocket and the VNC handshake take long on a loaded machine; the page is reloaded every
    40 s until then)."""
    from playwright.sync_api import sync_playwright

    need(os.path.exists(HOST_CHROMIUM), "the host needs Debian's chromium (apt-get install chromium)")
    host_port = server.url.split("//", 1)[1]
    domain = re.match(r"https?://6080-[^.]+\.([^/]+)/", url).group(1)
    # The SDK names an https URL (E2B's edge); kiln serves plain HTTP on one port.
    url = "http://" + url.split("://", 1)[1]
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=HOST_CHROMIUM,
            args=[f"--host-resolver-rules=MAP *.{domain} {host_port}", "--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1024, "height": 768})
            page.goto(url, wait_until="load", timeout=60000)
            # noVNC draws the remote screen into a canvas once connected.
            try:
                page.wait_for_function(
                    "document.querySelector('#noVNC_container canvas') &&"
                    " document.querySelector('#noVNC_container canvas').width > 100",
                    timeout=20000)
            except Exception:
                pass
            page.wait_for_timeout(2000)
            png = page.screenshot(path=out)
            # noVNC loads some fifty modules through websockify's one-threaded web server,
            # which shares the sandbox's CPU with x11vnc polling the screen.
            # A page still on noVNC's loading screen after 40 s (a module or the one connect
            # attempt lost on a starved host) is loaded again.
            deadline = time.time() + 150
            reload_at = time.time() + 40
            while until and not until(png) and time.time() < deadline:
                if time.time() > reload_at:
                    page.reload(wait_until="load", timeout=60000)
                    reload_at = time.time() + 40
                page.wait_for_timeout(1000)
                png = page.screenshot(path=out)
        finally:
            browser.close()
    return png


def wait_vnc(desk):
    """Waits until x11vnc answers with its RFB banner: on a loaded host it takes seconds after
    `stream.start()` returns, and noVNC's single autoconnect attempt fails before that."""
    probe = ("python3 -c \"import socket; s = socket.create_connection(('127.0.0.1', 5900), "
             "timeout=30); print(s.recv(12))\" 2>&1 || true")
    last = [""]

    def answered():
        last[0] = desk.commands.run(probe, timeout=60).stdout
        return "RFB" in last[0]

    try:
        wait_for(answered, "x11vnc's banner", timeout=120, interval=1)
    except AssertionError as e:
        # What the sandbox looked like: the probe's own error, x11vnc, and its listening sockets.
        seen = desk.commands.run("pgrep -a x11vnc; echo ---; grep -E ':170C|:17C0' /proc/net/tcp "
                                 "/proc/net/tcp6; true", timeout=30).stdout
        raise AssertionError(f"{e}\nlast probe: {last[0][-500:]}\nin the sandbox:\n{seen}") from None


def test_stream_without_auth_renders_the_desktop(net_server, desk, tmp_path):
    desk.stream.start()
    try:
        wait_vnc(desk)
        url = desk.stream.get_url()
        assert re.match(rf"https://6080-{desk.sandbox_id}\.[^/]+/vnc\.html\?autoconnect=true", url), url
        # noVNC's page is served through kiln's routing.
        status, body, _ = port_request(net_server, desk.sandbox_id, 6080, "GET", "/vnc.html")
        assert status == 200 and b"noVNC" in body
        png = render_stream(net_server, url, str(tmp_path / "stream.png"),
                            until=lambda p: colour_share(p, BACKGROUND) > 0.2)
        assert distinct_colours(png) > 3, "the stream page is blank"
        assert colour_share(png, BACKGROUND) > 0.2, "the desktop is not shown in the stream view"
    finally:
        desk.stream.stop()


def test_stream_with_auth_needs_the_key(net_server, desk, tmp_path):
    # The SDK starts x11vnc in the background (-bg) and checks `pgrep -x x11vnc`; wait until the
    # previous test's server is gone.
    wait_for(lambda: desk.commands.run("pgrep -x x11vnc || true").stdout.strip() == "", "x11vnc to stop")
    desk.stream.start(require_auth=True)
    try:
        wait_vnc(desk)
        key = desk.stream.get_auth_key()
        assert len(key) == 16
        with_key = render_stream(net_server, desk.stream.get_url(auth_key=key),
                                 str(tmp_path / "with-key.png"),
                                 until=lambda p: colour_share(p, BACKGROUND) > 0.2)
        assert colour_share(with_key, BACKGROUND) > 0.2, "the desktop is not shown with the key"
        without = render_stream(net_server, desk.stream.get_url(), str(tmp_path / "without.png"))
        assert colour_share(without, BACKGROUND) < 0.05, "the desktop is shown without the key"
    finally:
        desk.stream.stop()


def test_computer_use_actions(net_server, desk):
    desk.commands.run("rm -f /tmp/xev2.log")
    h = desk.commands.run("exec stdbuf -oL xev -geometry 300x200+100+100 -event button -event keyboard > /tmp/xev2.log",
                          background=True, timeout=0)
    try:
        wait_for(lambda: windows(desk, "Event Tester"), "the xev window")
        time.sleep(0.5)
        # Anthropic's vocabulary, with a screenshot after the batch.
        status, r = actions(net_server, desk, {"actions": [
            {"action": "mouse_move", "coordinate": [200, 150]},
            {"action": "left_click", "coordinate": [210, 160]},
            {"action": "double_click", "coordinate": [220, 170], "text": "shift"},
            {"action": "scroll", "coordinate": [220, 170], "scroll_direction": "up", "scroll_amount": 2},
            {"action": "key", "text": "ctrl+a"},
            {"action": "cursor_position"},
            {"action": "zoom", "region": [100, 100, 300, 250]},
        ], "screenshot": True})
        assert status == 200, r
        assert r["results"][5] == {"x": 220, "y": 170}
        zoom = base64.b64decode(r["results"][6]["image"]["data"])
        assert png_size(zoom) == (200, 150)
        assert r["cursor"] == {"x": 220, "y": 170}
        assert r["screen"] == {"width": WIDTH, "height": HEIGHT}
        shot = base64.b64decode(r["screenshot"]["data"])
        assert png_size(shot) == (WIDTH, HEIGHT)
        # OpenAI's vocabulary in model coordinates (half the screen), JPEG screenshot.
        status, r = actions(net_server, desk, {"actions": [
            {"type": "click", "x": 110, "y": 85, "button": "right"},
            {"type": "drag", "path": [{"x": 110, "y": 85}, {"x": 120, "y": 90}, {"x": 125, "y": 95}]},
            {"type": "scroll", "x": 110, "y": 85, "scroll_x": 0, "scroll_y": 200},
            {"type": "keypress", "keys": ["SHIFT", "B"]},
            {"type": "wait", "ms": 100},
            {"type": "move", "x": 50, "y": 60},
        ], "coordinate_space": {"width": WIDTH // 2, "height": HEIGHT // 2}, "screenshot": "jpeg"})
        assert status == 200, r
        assert r["cursor"] == {"x": 100, "y": 120}
        assert base64.b64decode(r["screenshot"]["data"])[:3] == b"\xff\xd8\xff"

        def events():
            log = desk.commands.run("cat /tmp/xev2.log").stdout
            return (re.findall(r"ButtonPress event.*?state (0x\w+).*?button (\d+)", log, re.S),
                    re.findall(r"KeyPress event.*?keysym 0x\w+, (\w+)\)", log, re.S))
        def done():
            b, k = events()
            return len(b) >= 9 and "B" in k and (b, k)
        buttons, keys = wait_for(done, "the xev events")
        assert [b for _, b in buttons[:9]] == ["1", "1", "1", "4", "4", "3", "1", "5", "5"], buttons
        assert int(buttons[1][0], 16) & 1, "shift was not held during the double click"
        assert "Control_L" in keys and "a" in keys and "Shift_L" in keys, keys

        # Bad input is a 400 naming the action, and nothing runs.
        status, r = actions(net_server, desk, {"actions": [{"action": "left_click"}, {"action": "fly"}]})
        assert status == 400 and r["index"] == 1 and "fly" in r["error"]
        status, body, hdrs = port_request(net_server, desk.sandbox_id, ACTIONS_PORT, "GET", "/screenshot")
        assert status == 200 and png_size(body) == (WIDTH, HEIGHT)
    finally:
        h.kill()


def test_actions_type_text_into_a_window(net_server, desk):
    """Keys sent through the action API reach a window: text with characters outside the
    keyboard layout (each mapped onto a free keycode, given back a second after the typing)
    is typed into kiln-notepad, saved with Ctrl+S and read back from its file."""
    path = "/tmp/typed-actions.txt"
    keymap = desk.commands.run("xmodmap -pke").stdout
    desk.commands.run(f"rm -f {path}")
    h = desk.commands.run(f"exec kiln-notepad {path}", background=True, timeout=0)
    try:
        wait_for(lambda: windows(desk, f"kiln-notepad: {path}"), "the text window")
        time.sleep(0.5)
        text = "Grüße, Zoë: 日本 € 3½\nline Two"
        status, r = actions(net_server, desk, {"actions": [
            {"action": "left_click", "coordinate": [200, 120]},
            {"action": "type", "text": text},
            {"type": "keypress", "keys": ["CTRL", "s"]},
        ], "screenshot": True})
        assert status == 200, r
        saved = wait_for(lambda: desk.commands.run(f"cat {path} 2>/dev/null || true").stdout,
                         "the saved text")
        assert saved == text
        # The keycodes lent to the characters outside the layout are given back a moment
        # after the typing (clients read the mapping when they get to it).
        wait_for(lambda: desk.commands.run("xmodmap -pke").stdout == keymap,
                 "the keyboard map given back", timeout=10)
    finally:
        h.kill()


def test_desktop_chromium_is_driven_over_cdp(net_server, desk):
    """Chromium headful on the desktop, its DevTools fronted by `kiln-agent cdp` on 9222:
    Playwright on the host drives it through kiln, and the page shows on the desktop."""
    from playwright.sync_api import sync_playwright

    colour = (0xC8, 0x1E, 0x1E)
    log = "/tmp/kiln-desk-chromium.log"
    b = desk.commands.run("exec chromium --remote-debugging-port=9223 --user-data-dir=/tmp/kiln-desk-chromium"
                          f" --window-position=0,0 --window-size=700,500 about:blank > {log} 2>&1",
                          background=True, timeout=0)
    c = desk.commands.run("exec kiln-agent cdp --listen 0.0.0.0:9222 --upstream 127.0.0.1:9223",
                          background=True, timeout=0)
    try:
        try:
            wait_for(lambda: port_request(net_server, desk.sandbox_id, 9222, "GET", "/json/version",
                                          timeout=10)[0] == 200, "Chromium's DevTools", timeout=90,
                     interval=1)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{diagnose(net_server, desk, log)}") from None
        headers = {"E2b-Sandbox-Id": desk.sandbox_id, "E2b-Sandbox-Port": "9222"}
        with sync_playwright() as p:
            browser = p.chromium.connect_over_cdp(net_server.url, headers=headers, timeout=60000)
            try:
                ctx = browser.contexts[0]
                page = ctx.pages[0] if ctx.pages else ctx.new_page()
                page.set_content(f"<body style='margin:0;background:rgb{colour}'><h1>on the desktop</h1></body>")
                assert page.inner_text("h1") == "on the desktop"
                assert "Headless" not in page.evaluate("navigator.userAgent")
                png = wait_for(lambda: (s := bytes(desk.screenshot())) and colour_share(s, colour) > 0.2 and s,
                               "the page on the desktop", timeout=30, interval=1)
                assert png_size(png) == (WIDTH, HEIGHT)
            finally:
                browser.close()
    finally:
        c.kill()
        b.kill()



def test_open_url_starts_the_browser(net_server, desk):
    """`open(url)` runs xdg-open, which (no desktop environment) finds the URL scheme's handler
    in /etc/xdg/mimeapps.list: the template's Chromium, on the desktop."""
    url = "http://127.0.0.1:9/kiln-open-test"
    try:
        desk.open(url)
        try:
            wait_for(lambda: desk.commands.run(f"pgrep -f '[c]hromium.*{url}' || true").stdout.strip(),
                     "Chromium with the URL", timeout=60, interval=1)
            wait_for(lambda: desk.commands.run("xdotool search --onlyvisible --class chromium || true")
                     .stdout.strip(), "a Chromium window", timeout=60, interval=1)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{diagnose(net_server, desk)}") from None
    finally:
        desk.commands.run("pkill -f '[k]iln-open-test' || true")


def test_launch_google_chrome_starts_chromium(net_server, desk):
    """E2B's docs launch the browser as `launch('google-chrome')`: the same name starts the
    template's Chromium (google-chrome.desktop) on the URL given."""
    url = "http://127.0.0.1:9/kiln-launch-test"
    try:
        desk.launch("google-chrome", url)
        try:
            wait_for(lambda: desk.commands.run(f"pgrep -f '[c]hromium.*{url}' || true").stdout.strip(),
                     "Chromium with the URL", timeout=60, interval=1)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{diagnose(net_server, desk)}") from None
    finally:
        desk.commands.run("pkill -f '[k]iln-launch-test' || true")


def notepad_window(desk, path):
    """The id of the (visible) kiln-notepad window showing `path`, through the SDK's queries."""
    try:
        wins = [w for w in desk.get_application_windows("kiln-notepad") if w]
    except CommandExitException:  # xdotool exits 1 until a window is mapped
        return None
    for w in wins:
        if desk.get_window_title(w) == f"kiln-notepad: {path}":
            return w
    return None


def test_launch_starts_an_application_from_its_desktop_entry(desk):
    """`launch(app, uri)` runs `gtk-launch app uri` (GTK's own, spawning through GLib):
    kiln-notepad.desktop's Exec line starts the editor on the file, which gets a focused
    window."""
    path = "/tmp/launched.txt"
    desk.commands.run(f"printf 'launched\\n' > {path}")
    try:
        desk.launch("kiln-notepad", path)
        win = wait_for(lambda: notepad_window(desk, path), "the launched editor's window")
        assert wait_for(lambda: desk.get_current_window_id() == win, "the window to get the focus")
        # The window holds the file: add to it and save.
        desk.press(["ctrl", "End"])
        desk.write(" and edited")
        desk.press(["ctrl", "s"])
        wait_for(lambda: desk.commands.run(f"cat {path}").stdout == "launched\n and edited",
                 "the edited file")
        # Unknown applications fail as GTK's gtk-launch does.
        with pytest.raises(CommandExitException) as e:
            desk.commands.run("gtk-launch no-such-app")
        assert e.value.exit_code == 2 and "no such application" in e.value.stderr
    finally:
        desk.commands.run(f"pkill -f '[k]iln-notepad {path}' || true")


def test_open_file_shows_it_in_the_default_application(desk):
    """`open(file)` runs xdg-open: `file` names the type (text/plain), /etc/xdg/mimeapps.list
    its handler (Mousepad), whose window shows the file."""
    path = "/home/user/notes.txt"
    desk.files.write(path, "opened by xdg-open\n")
    assert desk.commands.run(f"xdg-mime query filetype {path}").stdout.strip() == "text/plain"
    assert desk.commands.run("xdg-mime query default text/plain").stdout.strip() == "org.xfce.mousepad.desktop"
    try:
        desk.open(path)
        win = wait_for(lambda: [w for w in windows(desk, "notes.txt") if "Mousepad" in desk.get_window_title(w)],
                       "Mousepad showing the file")[0]
        wait_for(lambda: desk.get_current_window_id() == win, "the window to get the focus")
        desk.press(["ctrl", "End"])
        desk.write("more")
        desk.press(["ctrl", "s"])
        wait_for(lambda: desk.commands.run(f"cat {path}").stdout == "opened by xdg-open\nmore",
                 "the edited file")
    finally:
        desk.commands.run("pkill -x mousepad || true")


def test_glib_spawns_programs(desk):
    """GIO's launcher starts a program through GLib's g_spawn (fork, close_range, exec): under
    this gVisor close_range(3, ~0U) fails with EINVAL, which the template's preload clamps
    (templates/desktop.toml). Without it `gio launch` fails with "Failed to close file
    descriptor for child process"."""
    entry = "/home/user/.local/share/applications/kiln-probe.desktop"
    marker = "/tmp/gio-launched"
    desk.files.write(entry, "[Desktop Entry]\nType=Application\nName=kiln-probe\n"
                            f"Exec=sh -c 'echo spawned by glib > {marker}'\n")
    r = desk.commands.run(f"gio launch {entry}", timeout=30)
    assert r.exit_code == 0, r.stderr
    wait_for(lambda: desk.commands.run(f"cat {marker} 2>/dev/null || true").stdout
             == "spawned by glib\n", "the program GLib started")


def test_terminal_runs_a_shell_on_a_pty(desk):
    """xfce4-terminal (VTE) puts its pty in packet mode, which this gVisor lacks: the template's
    preload supplies it (templates/desktop.toml). Without it the window opens with no shell."""
    marker = "/tmp/terminal-tty"
    desk.commands.run(f"rm -f {marker}")
    h = desk.commands.run(f"exec xfce4-terminal --disable-server -x sh -c 'tty > {marker}; "
                          "printf ready; sleep 60'", background=True, timeout=0)
    try:
        tty = wait_for(lambda: desk.commands.run(f"cat {marker} 2>/dev/null || true").stdout,
                       "the terminal's shell")
        assert tty.startswith("/dev/pts/"), tty
    finally:
        h.kill()
