"""The console's management pages and who gets in, in Debian's Chromium driven by Playwright:
the Keys and teams page (a key made there works with the e2b SDK, its secret is shown once,
revoking it shuts it out, quotas and use of the team), a team template's build and its log as
the build runs (made through the e2b SDK's Template API), `kiln keys` through the API, the
sign-in rate limit (429 with Retry-After) and a session that survives a server restart.
"""

import json
import os
import re
import subprocess
import uuid

from .conftest import KilnServer, kiln_bin
# Fixtures and helpers shared with the console's main test.
from .test_server_console import (  # noqa: F401
    browser, page, shot, sign_in_by_keyboard, unlabelled_inputs, wait_for,
)


def kiln(server, *args, key=None):
    env = {**os.environ, "KILN_URL": server.url, "KILN_API_KEY": key or server.api_key}
    return subprocess.run([kiln_bin(), *args], capture_output=True, text=True, env=env, timeout=120)


def test_keys_page_creates_shows_once_and_revokes(server, page):
    from e2b import Sandbox

    team = f"web-{uuid.uuid4().hex[:6]}"
    r = kiln(server, "keys", "create", "--name", "console-web", "--team", team)
    assert r.returncode == 0, r.stderr
    team_key = r.stdout.strip()
    # Quotas of the team, set on the host, shown on its page.
    assert subprocess.run([kiln_bin(), "team", "set", team, "--max-sandboxes", "3",
                           "--state-dir", server.state_dir], capture_output=True).returncode == 0

    sign_in_by_keyboard(page, server, team_key)
    page.get_by_role("navigation", name="Main").get_by_role("link", name="Keys and teams").click()
    page.wait_for_selector(f"#acct-team:text-is('{team}')")
    row = page.locator(f"#teams tr[data-team='{team}']")
    row.wait_for()
    assert row.locator(".q-max").inner_text() == "3"
    assert row.locator(".usage").inner_text().startswith("0 ")
    # Only the team's own key is listed, by prefix.
    page.wait_for_selector("#keys tbody tr")
    listed = page.locator("#keys tbody").inner_text()
    assert "console-web" in listed and team_key[:10] in listed and team_key[10:] not in listed
    assert page.locator("#keys tbody tr").count() == 1
    # Not the operator's team: no team field.
    assert page.locator("#key-team").count() == 0
    assert unlabelled_inputs(page) == []

    # Create a key: the secret is shown once, and it works with the e2b SDK.
    page.get_by_label("Key name").fill("made-in-console")
    page.get_by_role("button", name="Create key").click()
    secret_box = page.get_by_label(re.compile("copy it now"))
    secret_box.wait_for()
    secret = secret_box.input_value()
    assert re.fullmatch(r"e2b_[0-9a-f]{40}", secret), secret
    shot(page, "keys.png")
    listed = lambda: page.locator("#keys tbody").inner_text()
    wait_for(page, "() => document.querySelectorAll('#keys tbody tr').length === 2")
    assert "made-in-console" in listed() and secret[10:] not in listed()
    page.get_by_role("button", name="Done").click()
    assert page.get_by_label(re.compile("copy it now")).count() == 0, "the secret is not shown again"
    sbx = Sandbox.create(timeout=60, api_key=secret)
    try:
        assert sbx.commands.run("echo made-in-console").stdout.strip() == "made-in-console"
        # The team's use follows.
        wait_for(page, "t => document.querySelector(`#teams tr[data-team='${t}'] .usage`)"
                       ".innerText.startsWith('1 ')", team, timeout=15000)
    finally:
        sbx.kill()

    # Revoke it (asks once more); the key is shut out.
    key_id = page.locator("#keys tbody tr", has_text="made-in-console").get_attribute("data-key")
    page.get_by_role("button", name=f"Revoke made-in-console ({key_id})").click()
    page.get_by_role("button", name="Confirm revoke made-in-console").click()
    page.wait_for_selector(f"#keys tr[data-key='{key_id}'] .status:has-text('revoked')")
    status, body, _ = server.request("GET", "/sandboxes", api_key=secret)
    assert status == 401 and "revoked" in body["message"], body
    # The operator's key sees the team's keys too; the team's key cannot see the operator's.
    status, keys, _ = server.request("GET", f"/api-keys?team={team}")
    assert status == 200 and {k["name"] for k in keys} == {"console-web", "made-in-console"}
    status, _, _ = server.request("GET", "/api-keys?team=default", api_key=team_key)
    assert status == 403


def test_kiln_keys_goes_through_the_api(server):
    team = f"cli-{uuid.uuid4().hex[:6]}"
    r = kiln(server, "keys", "create", "--name", "cli-api", "--team", team)
    assert r.returncode == 0, r.stderr
    key = r.stdout.strip()
    assert f"team {team}" in r.stderr
    # As the team's key: its own keys, through /api-keys.
    r = kiln(server, "keys", "list", "--json", key=key)
    assert r.returncode == 0, r.stderr
    keys = json.loads(r.stdout)
    assert [k["team"] for k in keys] == [team] and "createdAt" in keys[0], keys
    r = kiln(server, "keys", "create", "--name", "second", key=key)
    assert r.returncode == 0 and f"team {team}" in r.stderr, r.stderr
    second = r.stdout.strip()
    # Not another team's key, not the operator's list.
    r = kiln(server, "keys", "create", "--team", "default", key=key)
    assert r.returncode != 0 and "403" in r.stderr, r.stderr
    r = kiln(server, "keys", "list", "--team", "default", key=key)
    assert r.returncode != 0 and "403" in r.stderr, r.stderr
    listing = kiln(server, "keys", "list", key=key).stdout
    assert "second" in listing and second not in listing
    second_id = next(line.split()[0] for line in listing.splitlines() if " second " in line)
    assert kiln(server, "keys", "revoke", second_id, key=key).returncode == 0
    status, _, _ = server.request("GET", "/sandboxes", api_key=second)
    assert status == 401
    r = kiln(server, "keys", "revoke", second_id, key=key)
    assert r.returncode == 1 and "409" in r.stderr, r.stderr


def test_a_template_build_and_its_log_in_the_console(server, page):
    from e2b import Template

    name = f"kt-console-{uuid.uuid4().hex[:6]}"
    tpl = (Template().from_template("base")
           .run_cmd("for i in 1 2 3; do echo console-step-$i; sleep 1; done; echo console-built-$((6*7))"))
    info = Template.build_in_background(tpl, name)
    sign_in_by_keyboard(page, server, server.api_key)
    page.get_by_role("navigation", name="Main").get_by_role("link", name="Templates").click()
    page.get_by_role("button", name=f"Builds of {name}").click()
    # kiln's own templates are built on the host: no builds to show.
    base = page.locator("#templates tr[data-template='base']")
    assert "built on the host" in base.inner_text() and base.locator("button").count() == 0
    build = page.locator(f"tr[data-build='{info.build_id}']")
    build.wait_for(timeout=15000)
    assert unlabelled_inputs(page) == []
    log = page.locator(f"#log-{info.build_id}")
    log.wait_for()
    # The log fills while the build runs, then the build is ready.
    wait_for(page, "id => document.querySelector(`#log-${id} ol`).innerText.includes('console-step-1')",
             info.build_id, timeout=120000)
    wait_for(page, "id => document.querySelector(`#log-${id} .build-status`).dataset.status === 'ready'",
             info.build_id, timeout=240000)
    text = log.locator("ol").inner_text()
    assert "console-built-42" in text and text.index("console-step-1") < text.index("console-step-3"), text
    build.locator(".build-status:text-is('ready')").wait_for(timeout=10000)
    shot(page, "template-build.png")
    # A failing build shows its reason.
    bad = Template.build_in_background(
        Template().from_template("base").run_cmd("echo about-to-fail; exit 3"), name)
    page.locator(f"tr[data-build='{bad.build_id}']").wait_for(timeout=15000)
    page.get_by_role("button", name=f"Show the log of build {bad.build_id}").click()
    wait_for(page, "id => document.querySelector(`#log-${id} .build-status`)?.dataset.status === 'error'",
             bad.build_id, timeout=240000)
    # The panel shows the status the builds list had (under load the build may have failed
    # before it opened); its lines arrive with its first read of the log.
    wait_for(page, "id => document.querySelector(`#log-${id} ol`).innerText.includes('about-to-fail')",
             bad.build_id, timeout=15000)
    assert "exit" in page.locator(f"#log-{bad.build_id} [role=alert]").inner_text().lower()
    server.request("DELETE", f"/templates/{name}")


def test_sign_in_rate_limit_and_sessions_surviving_a_restart(state_dir, page):
    srv = KilnServer(state_dir).start()
    try:
        sign_in_by_keyboard(page, srv, srv.api_key)
        page.wait_for_selector("#main h1")
        csrf = page.get_attribute('meta[name="kiln-csrf"]', "content")
        srv.stop()
        srv.start()
        # The same browser, the same cookie: still signed in, with the same token, after the
        # restart (the port changed; cookies are not per port).
        page.goto(srv.url + "/console")
        page.wait_for_selector("#main h1")
        assert page.get_attribute('meta[name="kiln-csrf"]', "content") == csrf
        assert page.request.get(srv.url + "/console/api/sandboxes").status == 200

        # Failed sign-ins from this address: five, then 429 with Retry-After, whatever the key.
        ctx = page.context.browser.new_context()
        try:
            other = ctx.new_page()
            for i in range(5):
                other.goto(srv.url + "/console")
                other.get_by_label("API key").fill("e2b_" + "1" * 40)
                with other.expect_response(lambda r: r.url.endswith("/console/login")) as resp:
                    other.get_by_role("button", name="Sign in").click()
                assert resp.value.status == 401, i
            other.goto(srv.url + "/console")
            other.get_by_label("API key").fill(srv.api_key)
            with other.expect_response(lambda r: r.url.endswith("/console/login")) as resp:
                other.get_by_role("button", name="Sign in").click()
            assert resp.value.status == 429
            wait = int(resp.value.headers["retry-after"])
            assert 1 <= wait <= 60, wait
            assert "Too many failed sign-ins" in other.get_by_role("alert").inner_text()
            assert other.get_by_label("API key").is_visible()
            shot(other, "sign-in-limited.png")
        finally:
            ctx.close()
        # A session already open is not affected.
        assert page.request.get(srv.url + "/console/api/sandboxes").status == 200
    finally:
        srv.stop()
