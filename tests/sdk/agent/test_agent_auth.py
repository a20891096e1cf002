import os
import urllib.request

import pytest

from e2b.exceptions import AuthenticationException, SandboxException


def test_no_token_by_default(sbx):
    assert sbx.commands.run("echo open").stdout == "open\n"
    assert sbx.is_running()


def test_token_required_after_init(agent):
    agent.init(accessToken="tok-123")
    anon = agent.sandbox()
    with pytest.raises((AuthenticationException, SandboxException)):
        anon.commands.run("true")
    with pytest.raises(AuthenticationException):
        anon.files.read("/etc/hostname")
    # /health needs no token
    assert agent.http("GET", "/health")[0] == 204
    good = agent.sandbox(token="tok-123")
    assert good.commands.run("echo authed").stdout == "authed\n"
    p = os.path.join(agent.workdir, "a.txt")
    good.files.write(p, "with token")
    assert good.files.read(p) == "with token"
    bad = agent.sandbox(token="wrong")
    with pytest.raises(AuthenticationException):
        bad.files.read(p)


def test_signed_urls(agent):
    agent.init(accessToken="sig-tok")
    s = agent.sandbox(token="sig-tok")
    p = os.path.join(agent.workdir, "signed.txt")
    s.files.write(p, "signed content")
    url = s.download_url(p)
    assert "signature=" in url
    with urllib.request.urlopen(url) as r:
        assert r.read() == b"signed content"
    url = s.download_url(p, use_signature_expiration=60)
    with urllib.request.urlopen(url) as r:
        assert r.read() == b"signed content"
    up = s.upload_url(os.path.join(agent.workdir, "up.txt"))
    req = urllib.request.Request(up, data=b"uploaded", method="POST", headers={"Content-Type": "application/octet-stream"})
    with urllib.request.urlopen(req) as r:
        assert r.status == 200
    assert open(os.path.join(agent.workdir, "up.txt")).read() == "uploaded"
    tampered = url.replace("signature=v1_", "signature=v1_x")
    with pytest.raises(urllib.error.HTTPError) as ei:
        urllib.request.urlopen(tampered)
    assert ei.value.code == 401


def test_bad_requests_keep_agent_serving(agent, sbx):
    import json

    st, body = agent.http("POST", "/process.Process/Start", b"\x00\x00\x00\x00\x05{bad}", {"Content-Type": "application/connect+json"})
    assert st == 200 and b"invalid_argument" in body
    st, body = agent.http("POST", "/filesystem.Filesystem/Stat", b"{oops", {"Content-Type": "application/json"})
    assert st == 400 and json.loads(body)["code"] == "invalid_argument"
    st, body = agent.http("POST", "/filesystem.Filesystem/Frobnicate", b"{}", {"Content-Type": "application/json"})
    assert json.loads(body)["code"] == "unimplemented"
    st, body = agent.http("POST", "/init", b"not json", {"Content-Type": "application/json"})
    assert st == 400
    st, _ = agent.http("GET", "/files")
    assert st == 400
    assert sbx.commands.run("echo alive").stdout == "alive\n"


def test_metrics(agent):
    import json

    st, body = agent.http("GET", "/metrics")
    m = json.loads(body)
    assert st == 200
    assert m["cpu_count"] >= 1 and m["mem_total"] > 0 and m["disk_total"] > 0
    assert 0 <= m["cpu_used_pct"] <= 100
