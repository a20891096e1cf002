"""The web console at /console, used as a person would: Debian's Chromium driven by
Playwright signs in with an API key, watches a sandbox made through the e2b SDK appear, opens
its terminal and reads a command's output, watches the CPU plot move under load, sees an audit
record and the kill event arrive; wrong keys, CSRF and keyboard/label basics are checked too.
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
