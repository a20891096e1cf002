"""Network and DNS audit records through the real e2b SDK against a real `kiln serve` and the
test "internet" of internet.py (namespace `ktsdk`, 198.51.100.0/24, its own DNS
server): a DNS lookup, an allowed HTTP fetch (by address, named by its Host header), an allowed
HTTPS fetch (named by SNI), a fetch refused by a denyOut range, a refused connection to a
non-web port and an NXDOMAIN lookup each produce exactly the expected `net`/`dns` records, in
order, with the bytes each way that curl itself counted. With `--audit off` nothing is proxied
that the policy does not need, and the same traffic still works.

Nothing here sends traffic outside this machine. Needs root (namespaces, nftables)."""

import os
import subprocess
import time

import pytest

from .conftest import kiln_bin
from .internet import internet, net_server_in, run  # noqa: F401

RANGE = "10.143.0.0/24"
PY_RESOLVE = "python3 -c \"import socket,sys; print(socket.gethostbyname(sys.argv[1]))\" "
CURL_COUNTS = "curl -s -m 5 -o /dev/null -w '%{http_code} %{size_request} %{size_header} %{size_download}' "


@pytest.fixture(scope="module")
def audit_net_server(internet):  # noqa: F811
    with net_server_in("audit net", RANGE) as srv:
        yield srv

def records(srv, sbx_id, kinds="net,dns"):
    status, page, _ = srv.request("GET", f"/sandboxes/{sbx_id}/audit?kind={kinds}&limit=1000")
    assert status == 200, page
    return page["records"]


def wait_for(srv, sbx_id, n, timeout=15):
    """The sandbox's net/dns records once there are at least `n`."""
    deadline = time.time() + timeout
    while True:
        recs = records(srv, sbx_id)
        if len(recs) >= n or time.time() > deadline:
            return recs
        time.sleep(0.1)


def summary(r):
    b = r["body"]
    if r["kind"] == "dns":
        return ("dns", b["name"], b["type"], b["rcode"], tuple(b["answers"]))
    return ("net", b["event"], b["dst"], b["name"], b["rule"])


def test_connections_and_dns_queries_are_recorded_exactly_in_order(audit_net_server):
    from e2b import Sandbox

    srv = audit_net_server
    sbx = Sandbox.create(timeout=120, **srv.opts(),
                         network={"allow_out": ["198.51.100.10"], "deny_out": ["198.51.100.0/24"]})
    sid = sbx.sandbox_id
    try:
        assert records(srv, sid) == []
        code, out = run(sbx, PY_RESOLVE + "host-a.test")
        assert (code, out.strip()) == (0, "198.51.100.10")
        assert len(wait_for(srv, sid, 1)) == 1

        # Allowed by the allowOut address; named by its Host header. Wait for its close record
        # (written when both sides are done) before the next step, so the order is fixed.
        code, out = run(sbx, CURL_COUNTS + "-H 'Host: host-a.test' http://198.51.100.10/")
        assert code == 0, out
        status, req_bytes, head_bytes, body_bytes = map(int, out.split())
        assert status == 200
        assert len(wait_for(srv, sid, 3)) == 3

        code, out = run(sbx, "curl -sk -m 5 --resolve host-a.test:443:198.51.100.10 https://host-a.test/")
        assert (code, out) == (0, "tls:host-a.test")
        assert len(wait_for(srv, sid, 5)) == 5

        # Refused by the denyOut range (allowOut names only .10), on a web port and another.
        code, _ = run(sbx, "curl -s -m 5 http://198.51.100.11/")
        assert code != 0
        code, out = run(sbx, "python3 -c \"import socket; s=socket.create_connection(('198.51.100.53', 53), timeout=5); "
                             "s.sendall(b'x'); print(len(s.recv(10)))\"")
        assert code != 0 or out.strip() == "0", out

        code, _ = run(sbx, PY_RESOLVE + "nope.test")
        assert code != 0
        recs = wait_for(srv, sid, 8)
    finally:
        sbx.kill()

    assert [summary(r) for r in recs] == [
        ("dns", "host-a.test", "A", "NOERROR", ("198.51.100.10",)),
        ("net", "connect", "198.51.100.10:80", "host-a.test", "allowOut 198.51.100.10"),
        ("net", "close", "198.51.100.10:80", "host-a.test", "allowOut 198.51.100.10"),
        ("net", "connect", "198.51.100.10:443", "host-a.test", "allowOut 198.51.100.10"),
        ("net", "close", "198.51.100.10:443", "host-a.test", "allowOut 198.51.100.10"),
        ("net", "deny", "198.51.100.11:80", "198.51.100.11", "denyOut 198.51.100.0/24"),
        ("net", "deny", "198.51.100.53:53", None, "denyOut 198.51.100.0/24"),
        ("dns", "nope.test", "A", "NXDOMAIN", ()),
    ], recs
    http_close = recs[2]["body"]
    # Bytes each way, as curl counted them (request out; headers and body in).
    assert http_close["bytesOut"] == req_bytes
    assert http_close["bytesIn"] == head_bytes + body_bytes
    assert "error" not in http_close
    tls_close = recs[4]["body"]
    assert tls_close["bytesOut"] > 200 and tls_close["bytesIn"] > 500, tls_close
    for r in recs:
        if r["kind"] == "net":
            assert r["body"]["proto"] == "tcp"
            assert r["body"]["src"].startswith("169.254.0.21:")
        else:
            assert r["body"]["transport"] == "udp"
    # The records are part of the sandbox's verified chain.
    status, v, _ = srv.request("GET", f"/audit/verify?sandboxID={sid}")
    assert status == 200 and v["ok"], v
    # `kind` filters: only dns.
    assert [r["kind"] for r in records(srv, sid, "dns")] == ["dns", "dns"]
    # `kiln audit ID --kind net,dns` prints one line per record.
    env = {**os.environ, "KILN_URL": srv.url, "KILN_API_KEY": srv.api_key}
    out = subprocess.run([kiln_bin(), "audit", sid, "--kind", "net,dns"], capture_output=True,
                         text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 8, out.stdout
    assert "A host-a.test → NOERROR 198.51.100.10" in lines[0]
    assert "deny tcp" in lines[5] and 'rule="denyOut 198.51.100.0/24"' in lines[5]
    assert "close tcp" in lines[2] and f"out={req_bytes} in={head_bytes + body_bytes}" in lines[2]


def test_a_refused_upstream_is_recorded_with_its_error(audit_net_server):
    from e2b import Sandbox

    srv = audit_net_server
    sbx = Sandbox.create(timeout=120, **srv.opts())
    sid = sbx.sandbox_id
    try:
        # Nothing listens on port 81 of the test host: the sandbox sees the refusal.
        code, out = run(sbx, "python3 -c \"import socket; s=socket.create_connection(('198.51.100.10', 81), timeout=5); "
                             "print(len(s.recv(10)))\"")
        assert code != 0 or out.strip() == "0", out
        recs = wait_for(srv, sid, 2)
    finally:
        sbx.kill()
    assert [summary(r) for r in recs] == [
        ("net", "connect", "198.51.100.10:81", None, "default"),
        ("net", "close", "198.51.100.10:81", None, "default"),
    ]
    assert recs[1]["body"]["bytesOut"] == 0 and recs[1]["body"]["bytesIn"] == 0
    assert "refused" in recs[1]["body"]["error"].lower(), recs[1]
