"""The per-team volume cap (`kiln serve --team-max-volumes N`, `kiln team set T --max-volumes N`),
with the pinned e2b SDK against a `kiln serve` of its own allowing two volumes a team: the
third create answers 429 saying the cap and how to raise it, another team has its own count
and its own cap once set, and a deleted volume frees its place. Volumes only: no sandbox
starts."""

import os
import shutil
import subprocess
import tempfile

import pytest
from e2b.volume.volume_sync import Volume

from .conftest import KilnServer, cleanup_state, kiln_bin


@pytest.fixture(scope="module")
def capped():
    base = tempfile.mkdtemp(prefix="kiln-volcap-")
    state = os.path.join(base, "state")
    extra = os.environ.get("KILN_SERVE_EXTRA_ARGS", "").split()
    srv = KilnServer(state, [*extra, "--volume-mb", "16", "--team-max-volumes", "2"]).start()
    try:
        yield srv
    finally:
        srv.stop()
        log = srv.log()
        cleanup_state(state)
        shutil.rmtree(base, ignore_errors=True)
        assert "panicked" not in log, log[-8000:]


def test_a_team_holds_at_most_the_cap(capped):
    opts = {"api_key": capped.api_key, "api_url": capped.url}
    a = Volume.create("cap-a", **opts)
    Volume.create("cap-b", **opts)
    status, body, _ = capped.request("POST", "/volumes", {"name": "cap-c"})
    assert status == 429, body
    msg = body["message"]
    assert "holds 2 volumes" in msg and "(2)" in msg and "--team-max-volumes" in msg, msg
    assert "kiln team set default --max-volumes N" in msg, msg
    # Through the SDK too, with the same message.
    with pytest.raises(Exception) as e:
        Volume.create("cap-c", **opts)
    assert "--team-max-volumes" in str(e.value), e.value
    assert sorted(v.name for v in Volume.list(**opts)) == ["cap-a", "cap-b"]

    # Another team counts its own volumes.
    r = subprocess.run([kiln_bin(), "keys", "create", "--team", "cap-other", "--state-dir",
                        capped.state_dir], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    other = {"api_key": r.stdout.strip(), "api_url": capped.url}
    Volume.create("cap-a", **other)
    Volume.create("cap-b", **other)
    status, body, _ = capped.request("POST", "/volumes", {"name": "cap-c"}, api_key=other["api_key"])
    assert status == 429 and "cap-other" in body["message"], body
    # The team's own cap, read by the running server at the next create.
    r = subprocess.run([kiln_bin(), "team", "set", "cap-other", "--max-volumes", "3", "--state-dir",
                        capped.state_dir], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "max volumes 3" in r.stdout, (r.stdout, r.stderr)
    Volume.create("cap-c", **other)
    status, body, _ = capped.request("POST", "/volumes", {"name": "cap-d"}, api_key=other["api_key"])
    assert status == 429 and "holds 3 volumes" in body["message"], body
    status, teams, _ = capped.request("GET", "/teams", api_key=other["api_key"])
    assert status == 200 and [t["quota"]["maxVolumes"] for t in teams] == [3], teams
    # The default team still has the server's.
    assert capped.request("POST", "/volumes", {"name": "cap-d"})[0] == 429

    # A deleted volume frees its place.
    assert Volume.destroy(a.volume_id, **opts) is True
    c = Volume.create("cap-c", **opts)
    assert sorted(v.name for v in Volume.list(**opts)) == ["cap-b", "cap-c"]
    # A name the team has is still a conflict, not the cap, once there is room.
    assert Volume.destroy(c.volume_id, **opts) is True
    status, body, _ = capped.request("POST", "/volumes", {"name": "cap-b"})
    assert status == 409, body
