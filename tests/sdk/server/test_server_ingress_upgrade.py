"""A sandbox left running by a kiln from before ingress settings lived in the sandbox record
keeps them across the upgrade: that kiln wrote the traffic access token and the Host mask only
into the sandbox's `net.json` (its database had no columns for them, schema version 17). The
new kiln's recovery carries them into the record, so the sandbox's ports stay private and
masked, and get_info reports them.

The older kiln's state is made from a current one: after a kill -9, the database is taken back
to schema 17 (the two columns dropped) and the sandbox's `net.json` given the two fields as
that kiln wrote them. Needs root (namespaces, nftables)."""

import glob
import json
import os
import shutil
import sqlite3
import tempfile
import time

from e2b import Sandbox

from .conftest import cleanup_state
from .internet import internet, remove_slots_in_range, slot_prefixes_in, start_net_server  # noqa: F401
from .test_server_network import HOST_ECHO, proxied

RANGE = "10.139.0.0/24"
MASK = "app.internal:${PORT}"


def as_older_kiln(state: str, sandbox_id: str, token: str):
    """Makes `state` look as a kiln of schema 17 left it for the running `sandbox_id`."""
    db = sqlite3.connect(os.path.join(state, "kiln.db"))
    try:
        assert db.execute("PRAGMA user_version").fetchone()[0] == 18
        db.execute("ALTER TABLE sandboxes DROP COLUMN traffic_token")
        db.execute("ALTER TABLE sandboxes DROP COLUMN mask_request_host")
        db.execute("PRAGMA user_version = 17")
        db.commit()
    finally:
        db.close()
    [net_json] = glob.glob(os.path.join(state, "**", sandbox_id, "net.json"), recursive=True)
    with open(net_json) as f:
        net = json.load(f)
    assert "trafficToken" not in net, "this kiln keeps ingress out of net.json"
    net.update(trafficToken=token, maskRequestHost=MASK)
    with open(net_json, "w") as f:
        json.dump(net, f)


def wait_ok(srv, sbx_id, port, headers):
    deadline = time.time() + 30
    while True:
        got = proxied(srv, sbx_id, port, extra=headers)
        if got[0] == 200 or time.time() > deadline:
            return got
        time.sleep(0.3)


def test_a_running_sandbox_keeps_its_traffic_token_and_host_mask_across_the_upgrade(internet):
    base = tempfile.mkdtemp(prefix="kiln-ingup-")
    state = os.path.join(base, "state")
    first = second = None
    try:
        first = start_net_server(state, RANGE, extra=["--pool-off"])
        sbx = Sandbox.create(timeout=300, network={"allow_public_traffic": False,
                                                   "mask_request_host": MASK}, **first.opts())
        token = sbx.traffic_access_token
        assert token
        sbx.files.write("/tmp/host_echo.py", HOST_ECHO)
        sbx.commands.run("python3 /tmp/host_echo.py", background=True)
        good = {"e2b-traffic-access-token": token}
        assert wait_ok(first, sbx.sandbox_id, 8001, good) == (200, "app.internal:8001")
        first.kill9()
        as_older_kiln(state, sbx.sandbox_id, token)

        second = start_net_server(state, RANGE, previous=first, extra=["--pool-off"])
        assert wait_ok(second, sbx.sandbox_id, 8001, good) == (200, "app.internal:8001"), \
            second.log()[-3000:]
        status, body = proxied(second, sbx.sandbox_id, 8001)
        assert status == 403 and "traffic access token" in body, (status, body)
        status, _ = proxied(second, sbx.sandbox_id, 8001,
                            extra={"e2b-traffic-access-token": "x" * len(token)})
        assert status == 403
        again = Sandbox.connect(sbx.sandbox_id, **second.opts())
        net = again.get_info().network
        assert net["allow_public_traffic"] is False and net["mask_request_host"] == MASK, net
        assert "ingress settings carried into the sandbox record" in second.log()
        # Once in the record they stay there: a second restart has nothing left to carry.
        second.kill9()
        third = start_net_server(state, RANGE, previous=second, extra=["--pool-off"])
        second = third
        assert wait_ok(third, sbx.sandbox_id, 8001, good) == (200, "app.internal:8001")
        assert proxied(third, sbx.sandbox_id, 8001)[0] == 403
        assert third.log().count("ingress settings carried into the sandbox record") == 1
        db = sqlite3.connect(os.path.join(state, "kiln.db"))
        try:
            row = db.execute("SELECT traffic_token, mask_request_host FROM sandboxes WHERE id = ?",
                             (sbx.sandbox_id,)).fetchone()
        finally:
            db.close()
        assert row == (token, MASK), row
    finally:
        for srv in (second, first):
            if srv:
                srv.kill_all_sandboxes()
                srv.stop()
        cleanup_state(state)
        remove_slots_in_range("10.139.0.")
        shutil.rmtree(base, ignore_errors=True)
    assert not slot_prefixes_in("10.139.0."), "slots left behind"
