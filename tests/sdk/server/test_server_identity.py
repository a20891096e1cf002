"""Workload identity tokens (`iam.tokens`, `${e2b.identity.tokens.NAME}`) through the pinned
`e2b` SDK against a networked `kiln serve` and a test internet of our own (namespace `ktidt`,
198.51.100.208/29, its own DNS and its own upstream CA, trusted by the server through
KILN_EGRESS_TRUST):

- a rule's `Authorization: Bearer ${e2b.identity.tokens.svc}` reaches the HTTPS echo host as a
  fresh JWT per request whose ES256 signature verifies against the JWKS kiln serves without
  auth (`/.well-known/jwks.json`), with the requested `aud`, a SPIFFE `sub` naming the team and
  the sandbox, `exp` five minutes after `iat` and a new `jti` each time;
- the token is nowhere in the sandbox (environment, files, /proc) nor in any API answer;
- a fork keeps the rule but mints no token (its request fails closed); `update_network`
  keeps the sandbox's tokens;
- bad input (a placeholder naming no defined token, a blank audience, another token type)
  is a 400 saying what is wrong;
- the identity key survives a restart: tokens minted after it verify against the same JWKS.
Nothing here sends traffic off this machine."""

import json
import os
import re
import shutil
import sys
import tempfile
import time
import urllib.request

import jwt
import pytest
from e2b import Sandbox, Secret

from .conftest import own_server
from .internet import remove_slots_in_range, require_root, run, wait_command
from .test_server_egress_rules import ECHO, SEARCH, curl
from .testnet import NetNs, sh

RANGE = "10.177.0.0/24"
NS, HOST_SIDE, ECHO_ADDR, DNS_ADDR = "ktidt", "198.51.100.209", "198.51.100.210", "198.51.100.211"
HOST = "id.idt.test"
AUD = "https://sts.idt.test"


@pytest.fixture(scope="module")
def idnet():
    """The echo host (a certificate of the test CA) and a DNS server; yields the CA's path."""
    require_root()
    ns = NetNs(NS, "ktidt0", f"{HOST_SIDE}/29", [f"{a}/29" for a in (ECHO_ADDR, DNS_ADDR)],
               HOST_SIDE)
    d = tempfile.mkdtemp(prefix="kiln-idnet-")
    try:
        ns.up()
        ns.dns(DNS_ADDR, {HOST: ECHO_ADDR})
        ca_key, ca = os.path.join(d, "ca.key"), os.path.join(d, "ca.pem")
        sh("openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
           "-nodes", "-keyout", ca_key, "-out", ca, "-days", "2", "-subj", "/CN=kiln idt CA",
           "-addext", "basicConstraints=critical,CA:TRUE",
           "-addext", "keyUsage=critical,keyCertSign,cRLSign")
        key, csr, cert, ext = (os.path.join(d, f"leaf.{x}") for x in ("key", "csr", "pem", "ext"))
        with open(ext, "w") as f:
            f.write(f"subjectAltName=DNS:{HOST}\nbasicConstraints=CA:FALSE\n"
                    "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n")
        sh("openssl", "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
           "-nodes", "-keyout", key, "-out", csr, "-subj", f"/CN={HOST}")
        sh("openssl", "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key,
           "-CAcreateserial", "-out", cert, "-days", "2", "-extfile", ext)
        ns.spawn(sys.executable, "-c", ECHO, ECHO_ADDR, cert, key)
        up = ["curl", "-s", "-m", "2", "--cacert", ca, "--resolve", f"{HOST}:443:{ECHO_ADDR}",
              f"https://{HOST}/up"]
        wait_command(up, "the echo host")
        yield ca
    finally:
        ns.down()
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def srv(idnet):
    with own_server("kiln-idt-",
                    ["--net-range", RANGE, "--net-pool", "2", "--dns-upstream", DNS_ADDR],
                    env={"KILN_EGRESS_TRUST": idnet},
                    after=lambda: remove_slots_in_range(RANGE.rsplit(".", 1)[0] + ".")) as s:
        yield s


def jwks(srv):
    """The JWKS, fetched like an upstream would: no API key."""
    with urllib.request.urlopen(srv.url + "/.well-known/jwks.json", timeout=10) as r:
        return json.loads(r.read())


def verify(srv, token, keys=None):
    """The token's claims, its signature checked against kiln's JWKS (raises otherwise)."""
    keys = keys or jwks(srv)
    header = jwt.get_unverified_header(token)
    assert header["alg"] == "ES256", header
    key = next(k for k in keys["keys"] if k["kid"] == header["kid"])
    return jwt.decode(token, jwt.PyJWK(key).key, algorithms=["ES256"], audience=AUD,
                      options={"require": ["exp", "iat", "sub", "aud", "jti"]})


def bearer(body):
    auth = json.loads(body)["headers"].get("authorization", "")
    assert auth.startswith("Bearer "), body
    return auth[len("Bearer "):]


RULES = {HOST: [{"transform": lambda ctx: {"headers": {
    "Authorization": f"Bearer {ctx.iam.tokens['svc']}", "X-Kiln-Id": "yes"}}}]}
IAM = {"tokens": {"svc": Secret.iam_token(audience=AUD, token_type="JWT-SVID")}}


def test_identity_tokens_are_minted_per_request_and_verify(srv, idnet):
    opts = srv.opts()
    # The JWKS and the OIDC discovery document answer without a key.
    keys = jwks(srv)
    assert [k["kty"] for k in keys["keys"]] == ["EC"] and "d" not in keys["keys"][0], keys
    status, disc, _ = srv.request("GET", "/.well-known/openid-configuration", api_key=None)
    assert status == 200 and disc["jwks_uri"] == disc["issuer"] + "/.well-known/jwks.json", disc

    sbx = Sandbox.create(timeout=180, **opts, iam=IAM, network={"rules": RULES})
    child = None
    try:
        sbx.files.write("/tmp/testca.pem", open(idnet).read())
        code, status, body = curl(sbx, f"-H 'Authorization: mine' https://{HOST}/one")
        assert (code, status) == (0, "200"), body
        token = bearer(body)
        claims = verify(srv, token, keys)
        # The trust domain is the server's --domain (localhost unless the run sets one).
        assert re.fullmatch(rf"spiffe://[a-z0-9._-]+/team/default/sandbox/{sbx.sandbox_id}",
                            claims["sub"]), claims
        assert claims["aud"] == AUD and claims["iss"] == srv.url, claims
        assert claims["exp"] - claims["iat"] == 300 and claims["exp"] > time.time(), claims
        # A new token for each request (keep-alive included).
        code, out = run(sbx, f"curl -s -m 10 https://{HOST}/2 https://{HOST}/3")
        assert code == 0, out
        # The echo's two JSON answers, one after the other.
        seen = [json.loads(p)["headers"]["authorization"]
                for p in out.replace("}{", "}\n{").splitlines() if p.strip()]
        jtis = {verify(srv, t[len("Bearer "):], keys)["jti"] for t in seen}
        assert len(seen) == 2 and len(jtis | {claims["jti"]}) == 3, seen
        # A token signed otherwise, or altered, does not verify.
        head, payload, sig = token.split(".")
        forged = ".".join([head, payload[:-2] + ("AA" if payload[-2:] != "AA" else "BB"), sig])
        with pytest.raises(jwt.InvalidTokenError):
            verify(srv, forged, keys)

        # The token is nowhere in the sandbox, nor in an API answer.
        half = len(token) // 2
        sbx.files.write("/tmp/search.py", SEARCH)
        code, out = run(sbx, f"HALF_A={token[:half]} HALF_B={token[half:]} python3 /tmp/search.py",
                        timeout=120)
        assert code == 0 and out.strip() == "none", out
        status, detail, _ = srv.request("GET", f"/sandboxes/{sbx.sandbox_id}")
        assert status == 200 and token not in json.dumps(detail)
        assert detail["network"]["rules"][HOST][0]["transform"]["headers"]["authorization"] \
            == "Bearer ${e2b.identity.tokens.svc}", detail["network"]

        # An update carries no iam: the sandbox keeps its tokens.
        sbx.update_network({"rules": RULES})
        code, status, body = curl(sbx, f"https://{HOST}/after-update")
        assert (code, status) == (0, "200"), body
        assert verify(srv, bearer(body), keys)["sub"].endswith(sbx.sandbox_id)
        # ... and cannot name a token the sandbox does not define.
        status, err, _ = srv.request("PUT", f"/sandboxes/{sbx.sandbox_id}/network", {"rules": {
            HOST: [{"transform": {"headers": {"A": "${e2b.identity.tokens.nope}"}}}]}})
        assert status == 400 and '"nope"' in err["message"], err

        # A fork inherits the rule but not the tokens: its request fails closed.
        child = sbx.fork()[0]
        assert not isinstance(child, Exception), child
        code, status, body = curl(child, f"https://{HOST}/child")
        assert status == "502" and "no iam tokens" in body, (code, status, body)
        # The parent still gets its own.
        code, status, body = curl(sbx, f"https://{HOST}/parent")
        assert verify(srv, bearer(body), keys)["sub"].endswith(sbx.sandbox_id)
    finally:
        sbx.kill()
        if child is not None and not isinstance(child, Exception):
            child.kill()
    assert token not in srv.log()


def test_tokens_defined_at_create_serve_rules_added_later(srv):
    """A sandbox created with iam and no rules gets rules by an update, which names its tokens."""
    sbx = Sandbox.create(timeout=120, **srv.opts(), iam=IAM)
    try:
        sbx.update_network({"rules": RULES})
        code, status, body = curl(sbx, f"https://{HOST}/later")
        assert (code, status) == (0, "200"), body
        assert verify(srv, bearer(body))["sub"].endswith(f"/sandbox/{sbx.sandbox_id}")
    finally:
        sbx.kill()


def test_bad_identity_input_is_refused(srv):
    def create(iam, rules):
        return srv.request("POST", "/sandboxes", {"templateID": "base", "timeout": 30,
                                                  "iam": iam, "network": {"rules": rules}})
    rule = {HOST: [{"transform": {"headers": {"Authorization": "Bearer ${e2b.identity.tokens.x}"}}}]}
    good = {"tokens": {"svc": {"audience": AUD, "tokenType": "JWT-SVID"}}}
    for iam, rules, says in [
        (good, rule, 'token "x" is not defined'),
        (None, rule, 'token "x" is not defined'),
        ({"tokens": {"x": {"audience": "", "tokenType": "JWT-SVID"}}}, rule, "audience"),
        ({"tokens": {"x": {"audience": "a\nb", "tokenType": "JWT-SVID"}}}, rule, "audience"),
        ({"tokens": {"x": {"audience": AUD, "tokenType": "X509-SVID"}}}, rule, "tokenType"),
        ({"tokens": {"x}": {"audience": AUD, "tokenType": "JWT-SVID"}}}, {}, "token name"),
        (good, {HOST: [{"transform": {"headers": {"A": "${e2b.identity.other}"}}}]},
         "e2b.identity.tokens.NAME"),
    ]:
        status, err, _ = create(iam, rules)
        assert status == 400 and says in err["message"], (iam, rules, err)
    # The SDK refuses a name it does not know before sending anything.
    with pytest.raises(Exception) as e:
        Sandbox.create(timeout=30, **srv.opts(), iam=IAM, network={"rules": {HOST: [{
            "transform": lambda ctx: {"headers": {"A": ctx.iam.tokens["nope"]}}}]}})
    assert "nope" in str(e.value)


def test_identity_key_and_tokens_survive_a_restart(srv):
    """Last in the module: the server restarts (kill -9) on a new port."""
    keys = jwks(srv)
    sbx = Sandbox.create(timeout=300, **srv.opts(), iam=IAM, network={"rules": RULES})
    try:
        code, status, body = curl(sbx, f"https://{HOST}/before")
        assert (code, status) == (0, "200"), body
        verify(srv, bearer(body), keys)
        srv.kill9()
        srv.start()
        assert jwks(srv) == keys
        sbx = Sandbox.connect(sbx.sandbox_id, **srv.opts())
        deadline = time.time() + 30
        while True:
            code, status, body = curl(sbx, f"https://{HOST}/after")
            if (code, status) == (0, "200") and "authorization" in json.loads(body)["headers"]:
                break
            assert time.time() < deadline, (code, status, body, srv.log()[-3000:])
            time.sleep(0.5)
        claims = verify(srv, bearer(body), keys)
        assert claims["sub"].endswith(f"/sandbox/{sbx.sandbox_id}") and claims["iss"] == srv.url
    finally:
        sbx.kill()
