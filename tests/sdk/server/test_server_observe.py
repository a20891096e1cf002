"""Observability through the real e2b SDK and plain HTTP: `get_metrics(start, end)` returns the
samples inside the window (kept while paused); the Prometheus `/metrics` text parses with
prometheus-client's parser and needs its own token; lifecycle events (created, paused,
resumed, network-policy-changed, killed, timed-out) appear in the events API in order with
cursors, and reach a webhook receiver on 127.0.0.1 that checks each HMAC-SHA256 signature and
answers 500 to the first delivery, which is then retried."""

import datetime
import hashlib
import hmac
import http.server
import json
import os
import threading
import time

import pytest
from e2b import Sandbox
from prometheus_client.parser import text_string_to_metric_families

from .conftest import own_server

TOKEN = "obs-metrics-token-0123"
SECRET = "obs-webhook-secret-0123456789"
LIFECYCLE = {"created", "paused", "resumed", "killed", "timed-out", "oom", "pids-limit",
             "host-limit", "died",
             "network-policy-changed"}


@pytest.fixture(scope="module")
def srv():
    with own_server("kiln-obs-", [
            "--metrics-token", TOKEN, "--metrics-interval", "0.5", "--webhook-retry-base", "0.5",
            # The test's receivers listen on 127.0.0.1 (refused by default: SSRF filter).
            "--webhook-allow-private"]) as s:
        yield s


def ts_of(m) -> float:
    return m.timestamp.timestamp()


def test_get_metrics_returns_the_samples_inside_the_window(srv):
    sbx = Sandbox.create(timeout=120, **srv.opts())
    try:
        time.sleep(4.5)
        every = sbx.get_metrics()
        assert len(every) >= 5, every
        stamps = [ts_of(m) for m in every]
        assert stamps == sorted(stamps) and len(set(stamps)) == len(stamps)
        assert all(m.cpu_count == 2 and m.mem_total > 0 and m.mem_used > 0 for m in every)
        # A window strictly inside the history: whole seconds (the SDK sends Unix seconds).
        start = int(stamps[0]) + 1
        end = int(stamps[-1]) - 1
        assert end >= start, stamps
        window = sbx.get_metrics(start=datetime.datetime.fromtimestamp(start, datetime.timezone.utc),
                                 end=datetime.datetime.fromtimestamp(end, datetime.timezone.utc))
        got = [ts_of(m) for m in window]
        want = [t for t in stamps if start <= t < end + 1]
        assert got == want and got, (got, want, stamps)
        # Same through the class method with an id, and a window in the future is empty.
        future = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1)
        assert Sandbox.get_metrics(sbx.sandbox_id, start=future, **srv.opts()) == []

        # Kept while paused: the same history, and no new samples.
        sbx.pause()
        paused = [ts_of(m) for m in Sandbox.get_metrics(sbx.sandbox_id, **srv.opts())]
        assert len(paused) >= len(stamps) and paused[:len(stamps)] == stamps
        time.sleep(1.5)
        assert [ts_of(m) for m in Sandbox.get_metrics(sbx.sandbox_id, **srv.opts())] == paused
        sbx = Sandbox.connect(sbx.sandbox_id, **srv.opts())
        time.sleep(1.2)
        after = [ts_of(m) for m in sbx.get_metrics()]
        assert after[:len(paused)] == paused and len(after) > len(paused)

        # Bulk: the newest sample of each sandbox named.
        status, bulk, _ = srv.request("GET", f"/sandboxes/metrics?sandbox_ids={sbx.sandbox_id}")
        assert status == 200 and bulk["sandboxes"][sbx.sandbox_id]["timestampUnix"] >= int(after[-1])
    finally:
        sbx.kill()


def scrape(srv, token=TOKEN):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return srv.request("GET", "/metrics", headers=headers, api_key=None)


def test_prometheus_text_parses_and_needs_its_token(srv):
    assert scrape(srv, token=None)[0] == 401
    assert scrape(srv, token="wrong")[0] == 401
    sbx = Sandbox.create(timeout=120, **srv.opts())
    try:
        assert sbx.commands.run("echo hi").stdout == "hi\n"
        sbx.pause()
        sbx = Sandbox.connect(sbx.sandbox_id, **srv.opts())
        time.sleep(1.0)
        status, text, headers = scrape(srv)
        assert status == 200 and headers["Content-Type"].startswith("text/plain"), text
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        sandboxes = {(s.labels["state"], s.labels["template"]): s.value
                     for s in fams["kiln_sandboxes"].samples}
        assert sandboxes.get(("running", "base"), 0) >= 1, sandboxes
        hist = fams["kiln_lifecycle_duration_seconds"]
        assert hist.type == "histogram"
        counts = {s.labels["op"]: s.value for s in hist.samples if s.name.endswith("_count")}
        assert counts["create"] >= 1 and counts["pause"] >= 1 and counts["resume"] >= 1, counts
        proxy = fams["kiln_proxy_requests"]
        assert proxy.type == "counter" and proxy.samples[0].value > 0
        assert [s for s in fams["kiln_proxy_response_bytes"].samples if s.value > 0]
        assert fams["kiln_sandbox_memory_used_bytes"].samples[0].value > 0
        verdicts = {s.labels["verdict"] for s in fams["kiln_egress_connections"].samples}
        assert verdicts == {"allowed", "denied"}
        assert "kiln_agent_errors" in fams and "kiln_state_disk_free_bytes" in fams
    finally:
        sbx.kill()


class Receiver(http.server.BaseHTTPRequestHandler):
    got = []  # (event type, sandboxID, event id, signature valid, status answered)
    lock = threading.Lock()

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        sig = dict(p.split("=", 1) for p in self.headers.get("Kiln-Signature", "").split(","))
        mac = hmac.new(SECRET.encode(), sig.get("t", "").encode() + b"." + body, hashlib.sha256)
        valid = hmac.compare_digest(mac.hexdigest(), sig.get("v1", "")) and \
            abs(time.time() - int(sig.get("t", "0"))) < 300
        payload = json.loads(body)
        with Receiver.lock:
            status = 500 if not Receiver.got else 200
            ev = payload.get("event", {})
            Receiver.got.append((payload["type"], ev.get("sandboxID"), ev.get("id"), valid, status))
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def wait_for(pred, what, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")


def test_events_and_signed_webhooks_with_retry(srv):
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/hook"
        status, hook, _ = srv.request("POST", "/webhooks", body={"url": url, "secret": SECRET})
        assert status == 201, hook
        hid = hook["id"]

        sbx = Sandbox.create(timeout=120, **srv.opts())
        a = sbx.sandbox_id
        sbx.pause()
        sbx = Sandbox.connect(a, **srv.opts())
        status, body, _ = srv.request("PUT", f"/sandboxes/{a}/network",
                                      body={"denyOut": ["198.51.100.0/24"]})
        assert status == 204, body
        sbx.kill()
        short = Sandbox.create(timeout=1, **srv.opts())
        b = short.sandbox_id

        want_a = ["created", "paused", "resumed", "network-policy-changed", "killed"]
        want_b = ["created", "timed-out"]

        # The events API, one per page, following the cursor.
        def lifecycle_of(sid):
            seen, cursor = [], ""
            for _ in range(50):
                status, page, _ = srv.request(
                    "GET", f"/sandboxes/{sid}/events?limit=1&cursor={cursor}")
                assert status == 200, page
                seen += [e["type"] for e in page["events"] if e["type"] in LIFECYCLE]
                cursor = page["nextCursor"] or ""
                if not page["events"]:
                    break
            return seen

        assert lifecycle_of(a) == want_a
        wait_for(lambda: lifecycle_of(b) == want_b, "the timed-out event")
        status, page, _ = srv.request("GET", f"/events?type=timed-out&sandboxId={b}")
        assert status == 200 and [e["sandboxID"] for e in page["events"]] == [b]

        # Webhooks: every lifecycle event of both sandboxes, signed, the first retried.
        def delivered():
            with Receiver.lock:
                ok = [(t, s) for (t, s, _, _, st) in Receiver.got if st == 200]
            # Deliveries run side by side (and a retried one comes later): compare as sets.
            return sorted(t.removeprefix("sandbox.") for (t, s) in ok if s == a) == sorted(want_a) \
                and sorted(t.removeprefix("sandbox.") for (t, s) in ok if s == b) == sorted(want_b)

        wait_for(delivered, "webhook deliveries")
        with Receiver.lock:
            got = list(Receiver.got)
        assert all(valid for (_, _, _, valid, _) in got), got
        first = got[0]
        assert first[4] == 500
        assert [g for g in got[1:] if g[2] == first[2] and g[4] == 200], "the 500 was not retried"

        status, log, _ = srv.request("GET", f"/webhooks/{hid}/deliveries?limit=100")
        assert status == 200
        retried = [d for d in log["deliveries"] if d["eventID"] == first[2]]
        assert retried and retried[0]["attempts"] == 2 and retried[0]["status"] == "delivered"
        status, t, _ = srv.request("POST", f"/webhooks/{hid}/test")
        assert status == 200 and t["status"] == "delivered", t
        assert srv.request("DELETE", f"/webhooks/{hid}")[0] == 204
    finally:
        httpd.shutdown()


def test_cli_events_and_webhooks(srv):
    import subprocess

    def kiln(*args):
        r = subprocess.run([os.environ["KILN_BIN"], *args, "--url", srv.url, "--api-key", srv.api_key],
                           capture_output=True, text=True, timeout=60)
        return r.returncode, r.stdout, r.stderr

    sbx = Sandbox.create(timeout=120, **srv.opts())
    sbx.kill()
    rc, out, err = kiln("events", "--sandbox", sbx.sandbox_id, "--type", "created,killed")
    assert rc == 0, err
    lines = out.splitlines()
    assert [line.split()[3] for line in lines] == ["created", "killed"], out
    rc, out, err = kiln("events", "--sandbox", sbx.sandbox_id, "--json")
    assert rc == 0 and all(json.loads(line)["sandboxID"] == sbx.sandbox_id for line in out.splitlines())

    rc, out, err = kiln("webhooks", "add", "http://127.0.0.1:9/none", "--event", "killed")
    assert rc == 0, err
    hid = out.splitlines()[0]
    assert out.splitlines()[1].startswith("secret: whsec_")
    rc, out, _ = kiln("webhooks", "ls")
    assert rc == 0 and f"{hid} http://127.0.0.1:9/none killed" in out
    # Nothing listens on port 9: the test delivery fails (exit 1) and stays queued for a retry.
    rc, out, _ = kiln("webhooks", "test", hid)
    assert rc == 1 and "pending" in out, out
    rc, out, _ = kiln("webhooks", "deliveries", hid)
    assert rc == 0 and "webhook.test" not in out and "test" in out
    assert kiln("webhooks", "rm", hid)[0] == 0
    rc, _, err = kiln("webhooks", "rm", hid)
    assert rc == 1 and "not found" in err
