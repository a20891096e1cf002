"""Teams from the CLI against a running `kiln serve`: `kiln keys create --team`, `kiln team set`
(read by the running server at the next create) and `kiln team list`; a team's key sees only
its own team, and its quota refuses with 429 + Retry-After naming the limit. No sandbox is
started."""

import re
import subprocess

from .conftest import kiln_bin


def kiln(*args):
    return subprocess.run([kiln_bin(), *args], capture_output=True, text=True, timeout=120)


def test_team_keys_and_quotas_from_the_cli(server):
    state = ["--state-dir", server.state_dir]
    r = kiln("keys", "create", "--name", "cli-team", "--team", "sdk-red", *state)
    assert r.returncode == 0, r.stderr
    red = r.stdout.strip()
    assert re.fullmatch(r"e2b_[0-9a-f]{40}", red), r.stdout
    assert "team sdk-red" in r.stderr
    assert kiln("keys", "create", "--team", "Bad Team", *state).returncode != 0

    r = kiln("team", "set", "sdk-red", "--max-sandboxes", "0", "--max-timeout", "60", *state)
    assert r.returncode == 0, r.stderr
    r = kiln("team", "list", *state)
    assert r.returncode == 0, r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith("sdk-red"))
    assert row.split()[1:] == ["1", "0", "60", "default", "default"], r.stdout

    # The running server applies it at once.
    status, body, headers = server.request(
        "POST", "/sandboxes", {"templateID": "base", "timeout": 30}, api_key=red)
    assert status == 429, body
    assert headers["Retry-After"], headers
    assert "team \"sdk-red\"'s sandbox quota (0 at once" in body["message"], body
    status, body, _ = server.request(
        "POST", "/sandboxes", {"templateID": "base", "timeout": 61}, api_key=red)
    assert status == 400 and "maximum of 60s" in body["message"], body
    # Red sees none of the default team's sandboxes, snapshots or their tokens.
    status, body, _ = server.request("GET", "/v2/sandboxes", api_key=red)
    assert (status, body) == (200, [])
    status, body, _ = server.request("GET", "/snapshots", api_key=red)
    assert (status, body) == (200, [])

    # `none` puts a quota back to the server's default.
    r = kiln("team", "set", "sdk-red", "--max-sandboxes", "none", *state)
    assert r.returncode == 0 and "max sandboxes default" in r.stdout, r.stdout
