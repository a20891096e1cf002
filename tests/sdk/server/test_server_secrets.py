"""Secrets through the pinned `e2b` SDK (`e2b.Secret`) against the shared server: create, list
paging (`x-next-token`), get without the value, new versions, delete; per team (another team's
secret is a 404); E2B's limits (413 for an oversized value, 400 for bad names); the value is
never answered, never in the server log, never in clear in the state database; `kiln secrets`
works from the CLI. No sandbox is started."""

import os
import subprocess
import uuid

import pytest
from e2b import Secret
from e2b.exceptions import SecretException, SecretNotFoundException, InvalidArgumentException

from .conftest import kiln_bin


def kiln(*args, input=None, env=None):
    return subprocess.run([kiln_bin(), *args], capture_output=True, text=True, timeout=60,
                          input=input, env=env)


def test_secrets_api_through_the_sdk(server):
    opts = server.opts()
    tag = uuid.uuid4().hex[:8]
    value = f"sk-live-{uuid.uuid4().hex}"
    s = Secret.create(f"Svc-{tag}", value, metadata={"owner": "ci"}, **opts)
    assert s.secret_id.startswith("sec_") and s.name == f"svc-{tag}", s
    assert s.version == 1 and s.metadata == {"owner": "ci"}
    got = Secret.get_info(s.name, **opts)
    assert (got.secret_id, got.version) == (s.secret_id, 1)
    assert Secret.get_info(s.secret_id, **opts).name == s.name
    assert Secret.exists(f"svc-{tag}", **opts) and not Secret.exists(f"nope-{tag}", **opts)
    with pytest.raises(SecretException):
        Secret.create(f"svc-{tag}", "again", **opts)  # 409: the name is taken

    # New versions: metadata kept unless given, replaced when given.
    u = Secret.update(s.name, value + "-2", **opts)
    assert u.version == 2 and u.metadata == {"owner": "ci"}
    u = Secret.update(s.secret_id, value + "-3", metadata={}, **opts)
    assert u.version == 3 and u.metadata == {}
    with pytest.raises(SecretNotFoundException):
        Secret.update(f"nope-{tag}", "v", **opts)

    # Paging: three more, two per page, every one seen once.
    names = {s.name} | {Secret.create(f"page-{tag}-{i}", "v", **opts).name for i in range(3)}
    seen, pages = [], 0
    p = Secret.list(limit=2, **opts)
    while p.has_next:
        items = p.next_items()
        assert len(items) <= 2
        seen += [i.name for i in items]
        pages += 1
    assert names <= set(seen) and len(seen) == len(set(seen)) and pages >= 2, seen

    # No answer carries the value, and every one says no-store.
    for path in ["/secrets", f"/secrets/{s.secret_id}"]:
        status, body, headers = server.request("GET", path)
        assert status == 200 and value not in str(body), body
        assert headers["Cache-Control"] == "no-store"
    status, body, headers = server.request("POST", f"/secrets/{s.name}", {"value": value})
    assert status == 200 and value not in str(body) and headers["Cache-Control"] == "no-store"

    # Limits and names.
    with pytest.raises(SecretException) as e:
        Secret.create(f"big-{tag}", "x" * (64 * 1024 + 1), **opts)
    assert "64" in str(e.value) or "413" in str(e.value), e.value
    status, body, _ = server.request("POST", "/secrets", {"name": f"big-{tag}", "value": "x" * (64 * 1024 + 1)})
    assert status == 413, body
    status, body, _ = server.request("POST", f"/secrets/{s.name}", {"value": "x" * (64 * 1024 + 1)})
    assert status == 413, body
    for bad in ["", "a{b}", "sec_x", "a/b"]:
        status, body, _ = server.request("POST", "/secrets", {"name": bad, "value": "v"})
        assert status == 400 and body["code"] == 400, (bad, body)
    with pytest.raises(InvalidArgumentException):
        Secret.fill("a{b")
    status, body, _ = server.request(
        "POST", "/secrets", {"name": f"m-{tag}", "value": "v", "metadata": {str(i): "" for i in range(33)}})
    assert status == 400 and "metadata" in body["message"], body
    status, body, _ = server.request("GET", "/secrets?nextToken=zz")
    assert status == 400, body

    # Another team sees none of it.
    r = kiln("keys", "create", "--name", "secrets-blue", "--team", f"blue-{tag}",
             "--state-dir", server.state_dir)
    assert r.returncode == 0, r.stderr
    blue = {**opts, "api_key": r.stdout.strip()}
    assert not Secret.exists(s.secret_id, **blue) and not Secret.exists(s.name, **blue)
    assert Secret.destroy(s.name, **blue) is False
    with pytest.raises(SecretNotFoundException):
        Secret.update(s.secret_id, "stolen", **blue)
    p = Secret.list(**blue)
    assert p.next_items() == [] and not p.has_next
    # The same name in another team is another secret.
    assert Secret.create(s.name, "blue's", **blue).secret_id != s.secret_id

    # Delete.
    assert Secret.destroy(s.secret_id, **opts) is True
    assert Secret.destroy(s.name, **opts) is False
    assert not Secret.exists(s.name, **opts)
    assert Secret.exists(s.name, **blue)

    # The value is nowhere in clear: not in the log, not in the state database.
    assert value not in server.log()
    for f in os.listdir(server.state_dir):
        if f.startswith("kiln.db"):
            with open(os.path.join(server.state_dir, f), "rb") as fh:
                assert value.encode() not in fh.read(), f
    key = os.path.join(server.state_dir, "secrets.key")
    assert os.stat(key).st_mode & 0o777 == 0o600


def test_secrets_cli(server):
    env = {**os.environ, "KILN_URL": server.url, "KILN_API_KEY": server.api_key}
    name = f"cli-{uuid.uuid4().hex[:8]}"
    value = uuid.uuid4().hex
    r = kiln("secrets", "create", name, "--meta", "a=b", input=value + "\n", env=env)
    assert r.returncode == 0, r.stderr
    assert name in r.stdout and value not in r.stdout
    r = kiln("secrets", "update", name, input="new", env=env)
    assert r.returncode == 0 and "v2" in r.stdout, r.stderr
    r = kiln("secrets", "list", env=env)
    assert r.returncode == 0 and name in r.stdout and value not in r.stdout, r.stderr
    r = kiln("secrets", "rm", name, env=env)
    assert r.returncode == 0, r.stderr
    r = kiln("secrets", "rm", name, env=env)
    assert r.returncode != 0 and "not found" in r.stderr, r.stderr
