"""The `browser` template: headless Chromium inside a kiln sandbox, its DevTools endpoint reached
from the host through kiln's port routing (port 9222, fronted in the sandbox by `kiln-agent cdp`),
driven by Playwright's `connect_over_cdp` (no browser download: Playwright only speaks CDP)."""

import json
import os
import re
import time

import pytest
from e2b import Sandbox

from .rich_support import (colour_share, ensure_template, png_size, port_request,
                           start_net_server, stop_net_server)

CDP_PORT = 9222
PAGE_COLOUR = (0x12, 0xA0, 0x5C)


@pytest.fixture(scope="module")
def net_server():
    srv, base = start_net_server("kiln-browser-srv-", "10.138.0.0/24")
    try:
        yield srv
    finally:
        stop_net_server(srv, base)


@pytest.fixture(scope="module")
def browser_sbx(net_server):
    tpl = ensure_template(net_server, "browser")
    s = Sandbox.create(template=tpl, timeout=600, **net_server.opts())
    try:
        deadline = time.time() + 90
        while True:
            status, body, _ = port_request(net_server, s.sandbox_id, CDP_PORT, "GET", "/json/version")
            if status == 200:
                break
            assert time.time() < deadline, f"DevTools not reachable through kiln: {status} {body[:300]}"
            time.sleep(1)
        yield s
    finally:
        s.kill()


def domain_of(sbx) -> str:
    return sbx.get_host(CDP_PORT).split(".", 1)[1]


def test_chromium_runs_headless_as_user_with_its_own_profile(browser_sbx):
    ps = browser_sbx.commands.run("ps -o user=,args= -C chromium").stdout
    lines = [l for l in ps.splitlines() if "--remote-debugging-port=9223" in l]
    assert lines, ps
    assert lines[0].split()[0] == "user", lines[0]
    assert "--headless" in lines[0] and "--user-data-dir=/home/user/.cache/kiln-chromium" in lines[0]
    assert browser_sbx.commands.run("test -d /home/user/.cache/kiln-chromium/Default").exit_code == 0


def test_json_urls_name_the_routed_host(net_server, browser_sbx):
    sid = browser_sbx.sandbox_id
    # Addressed by headers: the URLs name the server the client used.
    status, body, _ = port_request(net_server, sid, CDP_PORT, "GET", "/json/version")
    assert status == 200
    v = json.loads(body)
    server_host = net_server.url.split("//", 1)[1]
    assert re.fullmatch(rf"ws://{re.escape(server_host)}/devtools/browser/[\w-]+",
                        v["webSocketDebuggerUrl"]), v
    # Addressed by host name: the URLs name that host.
    host = f"{CDP_PORT}-{sid}.{domain_of(browser_sbx)}"
    import urllib.request
    req = urllib.request.Request(net_server.url + "/json/list", headers={"Host": host})
    with urllib.request.urlopen(req, timeout=60) as r:
        pages = json.loads(r.read())
    assert pages, "Chromium has no page"
    for p in pages:
        if "webSocketDebuggerUrl" in p:
            assert p["webSocketDebuggerUrl"].startswith(f"ws://{host}/devtools/page/"), p
            assert "localhost:9223" not in json.dumps(p), p


def test_playwright_connect_over_cdp_drives_a_page_in_the_sandbox(net_server, browser_sbx):
    from playwright.sync_api import sync_playwright

    sbx = browser_sbx
    html = (f"<html><head><title>inside kiln</title></head><body style='margin:0;"
            f"background:rgb{PAGE_COLOUR}'><h1 id=h>served in the sandbox</h1></body></html>")
    sbx.files.write("/home/user/site/index.html", html)
    srv = sbx.commands.run("python3 -m http.server 8000 --bind 127.0.0.1 --directory /home/user/site",
                           background=True, timeout=0)
    try:
        deadline = time.time() + 30
        while sbx.commands.run("curl -s -o /dev/null -w '%{http_code}' localhost:8000/ || true").stdout != "200":
            assert time.time() < deadline, "the page server did not start"
            time.sleep(0.3)
        headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": str(CDP_PORT)}
        with sync_playwright() as p:
            t0 = time.time()
            browser = p.chromium.connect_over_cdp(net_server.url, headers=headers, timeout=60000)
            connect_s = time.time() - t0
            try:
                ctx = browser.contexts[0] if browser.contexts else browser.new_context()
                page = ctx.new_page()
                page.set_viewport_size({"width": 640, "height": 400})
                # localhost here is the sandbox's: the browser runs inside it.
                page.goto("http://127.0.0.1:8000/", timeout=60000)
                assert page.title() == "inside kiln"
                assert page.inner_text("#h") == "served in the sandbox"
                assert page.evaluate("navigator.userAgent").find("Headless") >= 0
                png = page.screenshot()
                assert png_size(png) == (640, 400)
                assert colour_share(png, PAGE_COLOUR) > 0.5
                page.close()
            finally:
                browser.close()
        assert connect_s < 30, connect_s
    finally:
        srv.kill()


def test_private_devtools_need_the_traffic_access_token(net_server):
    """DevTools is full control of the browser: a sandbox created with
    allow_public_traffic=False answers on 9222 only with its traffic access token, which
    Playwright sends as a header."""
    from playwright.sync_api import sync_playwright

    tpl = ensure_template(net_server, "browser")
    s = Sandbox.create(template=tpl, timeout=300, network={"allow_public_traffic": False},
                       **net_server.opts())
    try:
        token = s.traffic_access_token
        assert token
        auth = {"e2b-traffic-access-token": token}
        deadline = time.time() + 90
        while port_request(net_server, s.sandbox_id, CDP_PORT, "GET", "/json/version", headers=auth,
                           timeout=10)[0] != 200:
            assert time.time() < deadline, "DevTools not reachable with the token"
            time.sleep(1)
        status, body, _ = port_request(net_server, s.sandbox_id, CDP_PORT, "GET", "/json/version")
        assert status == 403, (status, body[:200])
        headers = {"E2b-Sandbox-Id": s.sandbox_id, "E2b-Sandbox-Port": str(CDP_PORT), **auth}
        with sync_playwright() as p:
            browser = p.chromium.connect_over_cdp(net_server.url, headers=headers, timeout=60000)
            try:
                assert browser.version, browser.version
                page = browser.contexts[0].new_page()
                page.set_content("<title>private</title>")
                assert page.title() == "private"
            finally:
                browser.close()
    finally:
        s.kill()


def test_devtools_answer_right_after_create(net_server):
    """Ready means ready: `create` of the browser template returns once DevTools answer
    (its ready command), so `connect_over_cdp` straight after it works. KILN_READY_TRIES
    creates (default 5; the issue's bar is 50, run by hand)."""
    from playwright.sync_api import sync_playwright

    tpl = ensure_template(net_server, "browser")
    tries = int(os.environ.get("KILN_READY_TRIES", "5"))
    with sync_playwright() as p:
        for i in range(tries):
            s = Sandbox.create(template=tpl, timeout=120, **net_server.opts())
            try:
                headers = {"E2b-Sandbox-Id": s.sandbox_id, "E2b-Sandbox-Port": str(CDP_PORT)}
                browser = p.chromium.connect_over_cdp(net_server.url, headers=headers, timeout=30000)
                try:
                    assert browser.version, i
                finally:
                    browser.close()
            finally:
                s.kill()
