"""Bad input, auth, errors and proxy behaviour of `kiln serve`, over raw HTTP."""

import json
import urllib.request

import pytest
from e2b import Sandbox


def assert_error(status, body, want_status):
    assert status == want_status, body
    assert isinstance(body, dict), body
    assert body["code"] == want_status, body
    assert isinstance(body["message"], str) and body["message"], body


def test_auth_missing_invalid_key(server):
    status, body, _ = server.request("GET", "/sandboxes", api_key=None)
    assert_error(status, body, 401)
    assert "X-API-Key" in body["message"]
    status, body, _ = server.request("GET", "/sandboxes", api_key="e2b_" + "0" * 40)
    assert_error(status, body, 401)
    status, body, _ = server.request("POST", "/sandboxes", body={"templateID": "base"}, api_key=None)
    assert_error(status, body, 401)
    # The SDK surfaces it as an authentication error.
    with pytest.raises(Exception) as ei:
        Sandbox.create(api_key="e2b_" + "1" * 40)
    assert "401" in str(ei.value) or "invalid api key" in str(ei.value).lower()
    # No auth for health and the OpenAPI document.
    status, _, _ = server.request("GET", "/health", api_key=None)
    assert status == 200
    status, doc, _ = server.request("GET", "/openapi.json", api_key=None)
    assert status == 200 and "/sandboxes" in doc["paths"]


def test_bad_create_requests(server):
    status, body, _ = server.request("POST", "/sandboxes", body={"templateID": "no-such-template"})
    assert_error(status, body, 404)
    assert "no-such-template" in body["message"]
    for timeout in (-5, 0, 10**12):
        status, body, _ = server.request("POST", "/sandboxes", body={"templateID": "base", "timeout": timeout})
        assert_error(status, body, 400)
        assert "timeout" in body["message"]
    status, body, _ = server.request("POST", "/sandboxes", body={"templateID": "base", "timeout": 10**30})
    assert_error(status, body, 400)
    status, body, _ = server.request(
        "POST", "/sandboxes", raw=b'{"templateID": "base",', headers={"Content-Type": "application/json"})
    assert_error(status, body, 400)
    assert "JSON" in body["message"]
    status, body, _ = server.request("POST", "/sandboxes", body={"timeout": 10})
    assert_error(status, body, 400)
    status, body, _ = server.request("POST", "/sandboxes", body=["not", "an", "object"])
    assert_error(status, body, 400)
    status, body, _ = server.request("POST", "/sandboxes", body={"templateID": "base", "envVars": {"A=B": "x"}})
    assert_error(status, body, 400)
    # Nothing was left running by the refused requests.
    status, lst, _ = server.request("GET", "/sandboxes")
    assert status == 200
    assert all(s["templateID"] == "base" for s in lst)


def test_unknown_and_killed_sandbox(server):
    for method, path, body in [
        ("GET", "/sandboxes/doesnotexist", None),
        ("DELETE", "/sandboxes/doesnotexist", None),
        ("POST", "/sandboxes/doesnotexist/timeout", {"timeout": 30}),
        ("POST", "/sandboxes/doesnotexist/connect", {"timeout": 30}),
        ("POST", "/sandboxes/doesnotexist/refreshes", {"duration": 30}),
        ("GET", "/sandboxes/doesnotexist/metrics", None),
        ("GET", "/sandboxes/doesnotexist/logs", None),
    ]:
        status, resp, _ = server.request(method, path, body=body)
        assert_error(status, resp, 404)
    status, resp, _ = server.request("POST", "/sandboxes/doesnotexist/timeout", body={"timeout": -1})
    assert_error(status, resp, 400)

    sbx = Sandbox.create(timeout=60)
    sid = sbx.sandbox_id
    token = sbx._envd_access_token
    # Proxy: the envd token is enforced.
    status, resp, _ = server.request("GET", "/health", api_key=None,
                                     headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983"})
    assert_error(status, resp, 401)
    status, _, _ = server.request("GET", "/health", api_key=None,
                                  headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983",
                                           "X-Access-Token": token})
    assert status in (200, 204)
    # Host-based routing reaches the same agent.
    status, _, _ = server.request("GET", "/health", api_key=None,
                                  headers={"Host": f"49983-{sid}.localhost", "X-Access-Token": token})
    assert status in (200, 204)
    # The agent's /kiln/ control paths (detach before a checkpoint, forwarding) are the
    # server's alone: a client gets 404 even with the token, and the agent stays attached.
    for method in ("POST", "GET"):
        status, resp, _ = server.request(method, "/kiln/detach", api_key=None,
                                         headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983",
                                                  "X-Access-Token": token})
        assert_error(status, resp, 404)
    assert sbx.commands.run("echo attached").stdout == "attached\n"
    # Other ports: nothing listens there (or the server has no sandbox network), a clear 502
    # naming the port.
    status, resp, _ = server.request("GET", "/", api_key=None,
                                     headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "8080",
                                              "X-Access-Token": token})
    assert_error(status, resp, 502)
    assert "8080" in resp["message"] and ("nothing is listening" in resp["message"]
                                          or "network" in resp["message"]), resp
    # Metrics and logs of a live sandbox.
    status, metrics, _ = server.request("GET", f"/sandboxes/{sid}/metrics")
    assert status == 200 and metrics[0]["memUsed"] > 0 and metrics[0]["memTotal"] > 0
    status, logs, _ = server.request("GET", f"/sandboxes/{sid}/logs")
    assert status == 200 and any("created" in line["line"] for line in logs["logs"])
    status, logs2, _ = server.request("GET", f"/v2/sandboxes/{sid}/logs")
    assert status == 200 and any(e["fields"].get("event") == "created" and e["level"] == "info"
                                 for e in logs2["logs"])
    # The SDK reads the same metrics.
    sdk_metrics = sbx.get_metrics()
    assert sdk_metrics and sdk_metrics[0].mem_used > 0 and sdk_metrics[0].cpu_count == 2
    # Bulk metrics: the newest sample of each sandbox named; none named is a 400.
    status, resp, _ = server.request("GET", f"/sandboxes/metrics?sandbox_ids={sid},nosuch")
    assert status == 200 and list(resp["sandboxes"]) == [sid], resp
    assert resp["sandboxes"][sid]["memUsed"] > 0
    status, resp, _ = server.request("GET", "/sandboxes/metrics")
    assert_error(status, resp, 400)
    # A template request without its name is a 400; an E2B route kiln does not implement is a
    # 501 naming it.
    status, resp, _ = server.request("POST", "/v3/templates", body={})
    assert_error(status, resp, 400)
    assert "name" in resp["message"], resp
    status, resp, _ = server.request("GET", "/access-tokens")
    assert_error(status, resp, 501)
    assert "/access-tokens" in resp["message"], resp

    sbx.kill()
    status, resp, _ = server.request("GET", f"/sandboxes/{sid}")
    assert_error(status, resp, 404)
    status, resp, _ = server.request("DELETE", f"/sandboxes/{sid}")
    assert_error(status, resp, 404)
    status, resp, _ = server.request("GET", "/health", api_key=None,
                                     headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983",
                                              "X-Access-Token": token})
    assert_error(status, resp, 502)
    with pytest.raises(Exception):
        sbx.commands.run("echo should-fail")
    # Logs stay readable after the end.
    status, logs, _ = server.request("GET", f"/sandboxes/{sid}/logs")
    assert status == 200 and any("killed" in line["line"] for line in logs["logs"])


def test_v2_list_pagination_and_state_filter(server):
    a = Sandbox.create(timeout=60, metadata={"page": "yes"})
    b = Sandbox.create(timeout=60, metadata={"page": "yes"})
    try:
        status, page1, headers = server.request("GET", "/v2/sandboxes?limit=1&metadata=page%3Dyes")
        assert status == 200 and len(page1) == 1
        token = headers.get("x-next-token")
        assert token
        status, page2, headers2 = server.request(
            "GET", f"/v2/sandboxes?limit=1&metadata=page%3Dyes&nextToken={token}")
        assert status == 200 and len(page2) == 1
        assert {page1[0]["sandboxID"], page2[0]["sandboxID"]} == {a.sandbox_id, b.sandbox_id}
        assert not headers2.get("x-next-token")
        status, paused, _ = server.request("GET", "/v2/sandboxes?state=paused&metadata=page%3Dyes")
        assert status == 200 and paused == []
        status, resp, _ = server.request("GET", "/v2/sandboxes?state=bogus")
        assert_error(status, resp, 400)
        status, resp, _ = server.request("GET", "/v2/sandboxes?limit=0")
        assert_error(status, resp, 400)
    finally:
        a.kill()
        b.kill()
