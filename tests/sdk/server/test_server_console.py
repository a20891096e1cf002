"""The web console at /console, used as a person would: Debian's Chromium driven by
Playwright signs in with an API key, watches a sandbox made through the e2b SDK appear, opens
its terminal and reads a command's output, watches the CPU plot move under load, sees an audit
record and the kill event arrive; a desktop sandbox's live screen through noVNC (pixels read
from the canvas, control taken, typing saved by an editor in the sandbox); wrong keys, CSRF and
keyboard/label basics are checked too.
Screenshots go to $KILN_CONSOLE_SHOTS (default /tmp/kiln-console-shots;
`KILN_CONSOLE_SHOTS=docs/console` refreshes the ones in the docs).

Also checks that the committed front-end bundle is what `npm ci && npm run build` makes.
"""

import filecmp
import os
import shutil
import subprocess
import tempfile
import threading
import time

import pytest

from .rich_support import need

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
CONSOLE_SRC = os.path.join(ROOT, "crates", "server", "console")
CHROMIUM = os.environ.get("KILN_HOST_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
SHOTS = os.environ.get("KILN_CONSOLE_SHOTS") or "/tmp/kiln-console-shots"


def test_committed_bundle_is_what_the_build_makes(tmp_path):
    """`npm ci && npm run build` (pinned by package-lock.json) reproduces dist/ byte for byte."""
    need(shutil.which("npm") is not None, "the host needs node and npm (apt-get install nodejs npm)")
    work = tmp_path / "console"
    shutil.copytree(CONSOLE_SRC, work, ignore=shutil.ignore_patterns("node_modules", "dist"))
    for cmd in (["npm", "ci", "--no-audit", "--no-fund"], ["npm", "run", "build"]):
        r = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"{cmd}: {r.stdout}\n{r.stderr}"
    for f in ("app.js", "app.css"):
        built, committed = work / "dist" / f, os.path.join(CONSOLE_SRC, "dist", f)
        assert filecmp.cmp(built, committed, shallow=False), (
            f"dist/{f} differs from a fresh build: run `npm ci && npm run build` in "
            "crates/server/console and commit dist/")


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    need(os.path.exists(CHROMIUM), "the host needs Debian's chromium (apt-get install chromium)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser):
    ctx = browser.new_context(viewport={"width": 1280, "height": 860})
    try:
        yield ctx.new_page()
    finally:
        ctx.close()


def shot(page, name):
    os.makedirs(SHOTS, exist_ok=True)
    page.screenshot(path=os.path.join(SHOTS, name))


def sign_in_by_keyboard(page, server, key):
    """Reaches the key field and the button with Tab alone, as a keyboard user would."""
    page.goto(server.url + "/console")
    page.locator("body").focus()
    for _ in range(5):
        if page.evaluate("document.activeElement && document.activeElement.id") == "key":
            break
        page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.id") == "key", "Tab does not reach the key field"
    page.keyboard.type(key)
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.textContent.trim()") == "Sign in"
    page.keyboard.press("Enter")


def unlabelled_inputs(page):
    """Visible inputs, selects and textareas that no label names."""
    return page.evaluate("""() => [...document.querySelectorAll('input, select, textarea')]
        .filter(e => e.type !== 'hidden' && e.offsetParent !== null)
        .filter(e => !(e.labels && e.labels.length) && !e.getAttribute('aria-label')
                     && !e.getAttribute('aria-labelledby'))
        .map(e => e.outerHTML.slice(0, 120))""")


def test_wrong_key_gets_the_sign_in_page_with_an_error(server, page):
    page.goto(server.url + "/console")
    assert page.get_by_label("API key").is_visible()
    assert unlabelled_inputs(page) == []
    page.get_by_label("API key").fill("e2b_" + "0" * 40)
    with page.expect_response(lambda r: r.url.endswith("/console/login")) as resp:
        page.get_by_role("button", name="Sign in").click()
    assert resp.value.status == 401
    err = page.get_by_role("alert")
    assert "invalid API key" in err.inner_text()
    body = page.content()
    assert "panicked" not in body and "Traceback" not in body and "/var/lib" not in body
    assert page.get_by_label("API key").is_visible(), "the sign-in form is shown again"
    shot(page, "sign-in-error.png")


def test_post_without_the_csrf_token_is_refused(server, page):
    sign_in_by_keyboard(page, server, server.api_key)
    page.wait_for_selector("#main h1")
    csrf = page.get_attribute('meta[name="kiln-csrf"]', "content")
    cookies = page.context.cookies()
    c = next(c for c in cookies if c["name"] == "kiln_console")
    assert c["httpOnly"] and c["sameSite"] == "Strict", c
    req = page.request
    url = server.url + "/console/api/sandboxes/nosuchsandbox/pause"
    assert req.post(url).status == 403
    assert req.post(url, headers={"x-csrf-token": "0" * 64}).status == 403
    # From another origin, even with the token.
    assert req.post(url, headers={"x-csrf-token": csrf, "origin": "http://evil.test"}).status == 403
    # With the token the call reaches the API (which knows no such sandbox).
    assert req.post(url, headers={"x-csrf-token": csrf}).status == 404
    # Reads need the session, nothing more; without a session nothing is served.
    assert req.get(server.url + "/console/api/sandboxes").status == 200
    assert req.post(server.url + "/console/logout", form={}).status == 403
    # The terminal's WebSocket refuses a wrong token.
    ws_open = """url => new Promise(done => {
        const ws = new WebSocket(url);
        ws.onopen = () => { ws.close(); done('open'); };
        ws.onerror = () => done('refused');
    })"""
    ws = server.url.replace("http://", "ws://") + "/console/terminal/nosuchsandbox?csrf="
    assert page.evaluate(ws_open, ws + "0" * 64) == "refused"
    ctx = page.context.browser.new_context()
    try:
        assert ctx.request.get(server.url + "/console/api/sandboxes").status == 401
    finally:
        ctx.close()


def wait_for(page, fn_js, arg=None, timeout=30000):
    page.wait_for_function(fn_js, arg=arg, timeout=timeout)


def test_console_shows_a_sandbox_its_terminal_plots_audit_and_kill(server, page):
    from e2b import Sandbox

    sign_in_by_keyboard(page, server, server.api_key)
    page.wait_for_selector("#main h1:has-text('Sandboxes')")
    assert unlabelled_inputs(page) == []
    sbx = Sandbox.create(timeout=180)
    try:
        row = page.locator(f'tr[data-sandbox="{sbx.sandbox_id}"]')
        row.wait_for(timeout=15000)
        assert "running" in row.inner_text() and "base" in row.inner_text()
        # The state filter hides it when it does not match.
        page.get_by_label("State").select_option("paused")
        row.wait_for(state="detached", timeout=5000)
        page.get_by_label("State").select_option("running")
        row.wait_for(timeout=5000)
        # Its sparklines fill from the metrics history.
        wait_for(page, "id => +document.querySelector(`tr[data-sandbox='${id}'] .spark`).dataset.points > 0",
                 sbx.sandbox_id)

        # Keyboard: Tab reaches the sandbox's link.
        page.locator("body").focus()
        link = f"#/sandboxes/{sbx.sandbox_id}"
        for _ in range(30):
            page.keyboard.press("Tab")
            if page.evaluate("document.activeElement.getAttribute('href')") == link:
                break
        assert page.evaluate("document.activeElement.getAttribute('href')") == link
        page.keyboard.press("Enter")
        page.wait_for_selector("#sbx-state:has-text('running')")
        assert unlabelled_inputs(page) == []

        # Keyboard: the actions and the terminal button are reachable with Tab.
        reached = set()
        for _ in range(40):
            page.keyboard.press("Tab")
            reached.add(page.evaluate("document.activeElement.textContent.trim()"))
        for name in ("Pause", "Fork", "Kill", "Open terminal"):
            assert name in reached, f"Tab never reaches {name!r}: {sorted(reached)}"

        # The terminal: type a command, read its output.
        page.get_by_role("button", name="Open terminal").click()
        page.wait_for_selector("#term-status:has-text('connected')")
        page.wait_for_timeout(500)
        page.keyboard.type("echo console-$((6*7))\n")
        wait_for(page, "() => document.querySelector('#term .xterm-rows').innerText.includes('console-42')")

        # CPU load: the CPU plot's newest value climbs and new samples arrive.
        before = int(page.get_attribute("#plot-cpu", "data-points"))
        load = threading.Thread(target=lambda: sbx.commands.run(
            "timeout 25 sh -c 'while :; do :; done' || true", timeout=60))
        load.start()
        # One busy thread of the sandbox's two vCPUs is ~50%; the idle shell stays near 0.
        try:
            wait_for(page, "n => +document.querySelector('#plot-cpu').dataset.points > n"
                           " && +document.querySelector('#plot-cpu').dataset.last > 30", before, timeout=40000)
        except Exception:
            shot(page, "failed-cpu.png")
            raise AssertionError("the CPU plot did not climb: "
                                 + str(page.get_attribute("#plot-cpu", "aria-label")))
        label = page.get_attribute("#plot-cpu", "aria-label")
        assert label.startswith("CPU: ") and "samples" in label, label
        shot(page, "sandbox.png")

        # Audit: the command's process record arrives in the stream.
        wait_for(page, "() => [...document.querySelectorAll('#audit li[data-kind=process]')].length > 0")
        # The kind filter narrows the stream.
        page.get_by_label("process").uncheck()
        wait_for(page, "() => document.querySelectorAll('#audit li[data-kind=process]').length === 0")
        page.get_by_label("process").check()
        load.join(timeout=60)

        # Back on the list, the sparklines now show the load.
        page.get_by_role("link", name="Sandboxes", exact=True).click()
        wait_for(page, "id => +document.querySelector(`tr[data-sandbox='${id}'] .spark`)?.dataset.points >= 3",
                 sbx.sandbox_id)
        shot(page, "sandboxes.png")
        page.go_back()
        page.wait_for_selector("#sbx-state:has-text('running')")

        # Pause and resume with the buttons; the state follows.
        page.get_by_role("button", name="Pause").click()
        page.wait_for_selector("#sbx-state:has-text('paused')", timeout=60000)
        page.get_by_role("button", name="Resume").click()
        page.wait_for_selector("#sbx-state:has-text('running')", timeout=60000)
        assert sbx.commands.run("echo back").stdout.strip() == "back"
        # Fork: the new sandbox is linked, and it is a real one.
        page.get_by_role("button", name="Fork").click()
        fork_link = page.locator(".actions a.fork")
        fork_link.wait_for(timeout=60000)
        fork_id = fork_link.inner_text().strip()
        try:
            assert fork_id and fork_id != sbx.sandbox_id
            fork = Sandbox.connect(fork_id)
            assert fork.commands.run("echo forked").stdout.strip() == "forked"
        finally:
            server.request("DELETE", f"/sandboxes/{fork_id}")

        # Kill with the button (two steps); the kill event arrives, the state says ended.
        page.get_by_role("button", name="Kill").click()
        page.get_by_role("button", name="Confirm kill").click()
        page.wait_for_selector("#events li[data-type=killed]", timeout=20000)
        page.wait_for_selector("#sbx-state:has-text('ended')", timeout=10000)
        # The kill is on the sandbox's audit chain as the signed-in key's API call; the
        # console's own refreshing reads are not.
        wait_for(page, "() => [...document.querySelectorAll('#audit li[data-kind=api]')]"
                       ".some(li => li.innerText.includes('method=DELETE'))")
        api_lines = page.locator("#audit li[data-kind=api]").all_inner_texts()
        assert not any("/metrics" in t or "/events" in t for t in api_lines), api_lines
        shot(page, "sandbox-killed.png")
        with pytest.raises(Exception):
            sbx.commands.run("true", timeout=5)
    finally:
        try:
            sbx.kill()
        except Exception:
            pass


def test_other_pages_and_sign_out(server, page):
    sign_in_by_keyboard(page, server, server.api_key)
    page.wait_for_selector("#main h1")
    nav = page.get_by_role("navigation", name="Main")
    for link, heading, needle in [
        ("Templates", "Templates", "#templates td:text-is('base')"),
        ("Snapshots", "Snapshots", "#main h1"),
        ("Webhooks", "Webhooks", "#main h1"),
        ("Keys and teams", "Keys and teams", "#acct-team:text-is('default')"),
    ]:
        nav.get_by_role("link", name=link).click()
        page.wait_for_selector(f"#main h1:text-is('{heading}')")
        page.wait_for_selector(needle)
        assert nav.get_by_role("link", name=link).get_attribute("aria-current") == "page"
        assert unlabelled_inputs(page) == []
    page.get_by_role("button", name="Sign out").click()
    page.get_by_label("API key").wait_for()
    assert page.request.get(server.url + "/console/api/sandboxes").status == 401


# The desktop view: noVNC in the page, bridged by the server to the sandbox's x11vnc. Ports
# other than the agent's are reached through the sandbox network, so this server has it on.
DESK_W, DESK_H = 1024, 768
DESK_BACKGROUND = (0x3B, 0x6E, 0xA5)

CANVAS_STATS = """([bg]) => {
    const c = document.querySelector('#desktop-screen canvas');
    if (!c || !c.width) return null;
    const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
    const seen = new Set();
    let back = 0, n = 0, sum = 0;
    for (let i = 0; i < d.length; i += 4 * 7) {
        seen.add((d[i] << 16) | (d[i + 1] << 8) | d[i + 2]);
        if (Math.abs(d[i] - bg[0]) < 8 && Math.abs(d[i + 1] - bg[1]) < 8 && Math.abs(d[i + 2] - bg[2]) < 8) back++;
        n++;
        sum = (sum * 31 + d[i] + d[i + 1] * 7 + d[i + 2] * 13) >>> 0;
    }
    return {w: c.width, h: c.height, colours: seen.size, background: back / n, sum};
}"""


@pytest.fixture(scope="module")
def desk_server():
    from .rich_support import start_net_server, stop_net_server

    srv, base = start_net_server("kiln-console-desk-", "10.185.0.0/24")
    try:
        yield srv
    finally:
        stop_net_server(srv, base)


def test_desktop_view_streams_the_screen_and_takes_control(desk_server, page):
    from e2b import Sandbox as Plain
    from e2b_desktop import Sandbox

    from .rich_support import ensure_template

    srv = desk_server
    desk = Sandbox.create(template=ensure_template(srv, "desktop"), resolution=(DESK_W, DESK_H),
                          timeout=600, **srv.opts())
    plain = Plain.create(timeout=300, **srv.opts())
    try:
        sign_in_by_keyboard(page, srv, srv.api_key)
        page.wait_for_selector("#main h1")

        # A sandbox without a desktop: no desktop panel, and the routes say why.
        with page.expect_response(lambda r: f"/console/desktop/{plain.sandbox_id}" in r.url,
                                  timeout=30000) as r:
            page.goto(f"{srv.url}/console#/sandboxes/{plain.sandbox_id}")
        assert r.value.json() == {"desktop": False, "vnc": False}
        page.wait_for_selector("#sbx-state:has-text('running')")
        page.wait_for_timeout(500)
        assert page.locator("#h-desktop").count() == 0

        # The desktop sandbox: its stream is not started, the panel offers to start it.
        page.goto(f"{srv.url}/console#/sandboxes/{desk.sandbox_id}")
        start = page.locator("#desktop-start")
        try:
            start.wait_for(timeout=30000)
        except Exception:
            shot(page, "failed-desktop.png")
            raise AssertionError(page.request.get(f"{srv.url}/console/desktop/{desk.sandbox_id}").text())
        assert "Start the stream" in start.inner_text()
        assert unlabelled_inputs(page) == []
        start.focus()
        page.keyboard.press("Enter")  # keyboard reachable
        # The stream starts x11vnc inside and connects noVNC: slow on a loaded host.
        page.wait_for_selector("#desktop-status:has-text('connected')", timeout=90000)
        assert "view only" in page.inner_text("#desktop-status")
        assert "Live screen" in page.inner_text("#desktop-caption")
        assert desk.commands.run("pgrep -x x11vnc").exit_code == 0

        # The canvas shows the desktop: its size, the XFCE background and more than one colour.
        wait_for(page, "a => { const s = (" + CANVAS_STATS + ")(a); return s && s.background > 0.2; }",
                 [list(DESK_BACKGROUND)], timeout=30000)
        stats = page.evaluate(CANVAS_STATS, [list(DESK_BACKGROUND)])
        assert (stats["w"], stats["h"]) == (DESK_W, DESK_H), stats
        assert stats["colours"] > 10, stats

        # An editor window on a file, focused in the sandbox.
        path = "/tmp/console-typed.txt"
        desk.commands.run(f"printf 'start\\n' > {path}")
        desk.launch("kiln-notepad", path)

        def editor_focused():
            try:
                w = desk.get_current_window_id()
                return w and desk.get_window_title(w) == f"kiln-notepad: {path}"
            except Exception:
                return False

        deadline = time.time() + 40
        while not editor_focused():
            assert time.time() < deadline, "the editor never got the focus"
            time.sleep(0.5)
        page.wait_for_timeout(1000)
        before = page.evaluate(CANVAS_STATS, [list(DESK_BACKGROUND)])

        # View only: the pointer does not follow the page's mouse.
        def point(fx, fy):
            canvas = page.locator("#desktop-screen canvas")
            canvas.scroll_into_view_if_needed()
            box = canvas.bounding_box()
            page.mouse.move(box["x"] + box["width"] * fx, box["y"] + box["height"] * fy)
            page.wait_for_timeout(700)

        def remote_pointer():
            out = desk.commands.run("xdotool getmouselocation", envs={"DISPLAY": ":0"}).stdout
            kv = dict(p.split(":") for p in out.split() if ":" in p)
            return int(kv["x"]), int(kv["y"])
        point(0.9, 0.9)
        x, y = remote_pointer()
        assert not (abs(x - DESK_W * 0.9) < 15 and abs(y - DESK_H * 0.9) < 15), (x, y)

        # Taking control: the pointer follows, typed keys reach the editor, which saves them.
        page.get_by_label("Take control (keyboard and mouse)").check()
        assert "you control" in page.inner_text("#desktop-status")
        point(0.25, 0.75)
        x, y = remote_pointer()
        assert abs(x - DESK_W * 0.25) < 15 and abs(y - DESK_H * 0.75) < 15, (x, y)
        page.evaluate("() => document.querySelector('#desktop-screen canvas').focus()")
        page.keyboard.press("Control+End")
        page.keyboard.type("typed in the console")
        page.keyboard.press("Control+s")
        deadline = time.time() + 20
        while desk.commands.run(f"cat {path}").stdout != "start\ntyped in the console":
            assert time.time() < deadline, desk.commands.run(f"cat {path}").stdout
            time.sleep(0.5)
        wait_for(page, "a => (" + CANVAS_STATS + ")(a).sum !== a[1]",
                 [list(DESK_BACKGROUND), before["sum"]], timeout=10000)
        page.evaluate("() => document.getElementById('h-desktop').scrollIntoView()")
        shot(page, "desktop.png")

        # Refusals: a wrong token, a request without a WebSocket, a sandbox with no desktop,
        # no such sandbox, no session.
        csrf = page.get_attribute('meta[name="kiln-csrf"]', "content")
        ws_open = """url => new Promise(done => {
            const ws = new WebSocket(url, ['binary']);
            ws.onopen = () => { ws.close(); done('open'); };
            ws.onerror = () => done('refused');
        })"""
        ws = srv.url.replace("http://", "ws://") + f"/console/vnc/{desk.sandbox_id}?csrf="
        assert page.evaluate(ws_open, ws + "0" * 64) == "refused"
        assert page.evaluate(ws_open, ws + csrf) == "open"
        req = page.request
        vnc = f"{srv.url}/console/vnc/"
        assert req.get(vnc + desk.sandbox_id).status == 403
        r = req.get(f"{vnc}{desk.sandbox_id}?csrf={csrf}")
        assert r.status == 400 and "WebSocket" in r.json()["message"]
        r = req.get(f"{vnc}{plain.sandbox_id}?csrf={csrf}")
        assert r.status == 409 and "has no desktop" in r.json()["message"], r.text()
        assert req.get(f"{vnc}nosuchsandbox?csrf={csrf}").status == 404
        stream = f"{srv.url}/console/desktop/{desk.sandbox_id}/stream"
        assert req.post(stream).status == 403
        r = req.post(f"{srv.url}/console/desktop/{plain.sandbox_id}/stream", headers={"x-csrf-token": csrf})
        assert r.status == 409
        for body in (r.text(),):
            assert "panicked" not in body and "/var/lib" not in body
        ctx = page.context.browser.new_context()
        try:
            assert ctx.request.get(f"{vnc}{desk.sandbox_id}?csrf={csrf}").status == 401
            assert ctx.request.get(f"{srv.url}/console/desktop/{desk.sandbox_id}").status == 401
        finally:
            ctx.close()
    finally:
        for s in (desk, plain):
            try:
                s.kill()
            except Exception:
                pass
