"""The audit log on a kiln cluster (docs/cluster.md, "The audit log"), on the cluster of
test_server_cluster.py (a one-member etcd, nodes n1 and n2, replicas c1 and c2):

- what an agent does through a replica (the API calls naming the sandbox, commands and file
  operations through the gateway) lands on the chain the sandbox's node keeps, beside the
  node's own lifecycle records: in that node's database, not the other node's;
- one sandbox's records read through either replica, paged by cursor and followed live;
  its chain and the team's chains verify through a replica, and a record edited in the
  node's database is caught;
- every sandbox's records at once (`GET /audit`) and the rule engine's alerts (`GET /alerts`)
  read through either replica from both nodes, page by page with the cluster's cursor (each
  node's position): each record once, a poller at the end sees only what is new, followed
  live too; a number is not a cluster's cursor (400).

Needs KILN_BIN, the base template, runsc, and etcd (Debian's etcd-server, or KILN_ETCD).
"""

import http.client
import json
import os
import secrets
import socket
import sqlite3
import threading
import time
import urllib.parse

from .conftest import kill_all
from .test_server_cluster import cluster  # noqa: F401  (the module's cluster fixture)
from .test_server_cluster_snapshots import on_node


def records(cluster, control: str, sid: str, query: str = "") -> dict:
    status, body = cluster.request(control, "GET", f"/sandboxes/{sid}/audit{query}")
    assert status == 200, body
    return body


def wait_records(cluster, control: str, sid: str, done, timeout: float = 30) -> list:
    """The sandbox's records once `done(records)` holds (the replica hands its records to the
    node in batches, a moment after the call they record)."""
    deadline = time.time() + timeout
    while True:
        recs = records(cluster, control, sid, "?limit=1000")["records"]
        if done(recs) or time.time() > deadline:
            return recs
        time.sleep(0.3)


def node_rows(cluster, node: str, sid: str) -> list:
    """(kind, body) of the audit rows `node`'s own database holds for `sid`."""
    db = sqlite3.connect(f"file:{os.path.join(cluster.nodes[node].state_dir, 'kiln.db')}?mode=ro",
                         uri=True, timeout=10)
    try:
        return db.execute("SELECT kind, body FROM audit WHERE sandbox_id = ?", (sid,)).fetchall()
    finally:
        db.close()


def mentions(recs: list, kind: str, text: str) -> bool:
    return any(r["kind"] == kind and text in json.dumps(r["body"]) for r in recs)


class Follower:
    """The JSON lines of a `follow=true` read through replica `control`, read as they come."""

    def __init__(self, cluster, control: str, path: str):
        url = urllib.parse.urlsplit(cluster.controls[control].url)
        self.conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
        self.conn.request("GET", path, headers={"X-API-Key": cluster.api_key})
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200, self.resp.read()
        self.lines = []
        self.reader = threading.Thread(target=self.read, daemon=True)
        self.reader.start()

    def read(self):
        while True:
            try:
                line = self.resp.readline()
            except Exception:  # the connection is shut under it on the way out
                return
            if not line:
                return
            self.lines.append(json.loads(line))

    def until(self, done, timeout: float = 20) -> list:
        """The lines read once `done(lines)` holds (or the time is up); the read ends."""
        deadline = time.time() + timeout
        while not done(self.lines) and time.time() < deadline:
            time.sleep(0.2)
        self.conn.sock.shutdown(socket.SHUT_RDWR)
        self.conn.close()
        self.reader.join(10)
        return self.lines


def test_a_sandboxs_records_are_kept_by_its_node_and_read_through_any_replica(cluster):
    made = []
    try:
        here = on_node(cluster, "n1", "c1", made)
        there = on_node(cluster, "n2", "c2", made)
        marks = {}
        for s in (here, there):
            mark = secrets.token_hex(6)
            marks[s.sandbox_id] = mark
            assert s.commands.run(f"echo {mark}").stdout.strip() == mark
            s.files.write(f"/tmp/{mark}.txt", "audited")
        sid, mark = here.sandbox_id, marks[here.sandbox_id]

        def whole(recs):
            return mentions(recs, "process", mark) and mentions(recs, "file", mark)

        recs = wait_records(cluster, "c2", sid, whole)
        assert whole(recs), recs
        kinds = {r["kind"] for r in recs}
        assert {"api", "lifecycle", "process", "file"} <= kinds, kinds
        assert all(r["sandboxID"] == sid for r in recs)
        # One chain: the replica's records and the node's own, in seq order without gaps.
        assert [r["seq"] for r in recs] == list(range(1, len(recs) + 1)), recs
        # The create's API record (made by replica c1) names the key that created it.
        create = [r for r in recs if r["kind"] == "api" and r["body"]["method"] == "POST"
                  and r["body"]["route"] in ("/sandboxes", "/v2/sandboxes")]
        assert create and create[0]["body"]["key"], recs
        # Kept by the node that runs the sandbox, and by it alone.
        rows = node_rows(cluster, "n1", sid)
        assert any(k == "process" and mark in b for k, b in rows), rows
        assert not node_rows(cluster, "n2", sid)
        other = there.sandbox_id
        wait_records(cluster, "c1", other, lambda r: mentions(r, "process", marks[other]))
        assert any(k == "process" and marks[other] in b for k, b in node_rows(cluster, "n2", other))
        assert not node_rows(cluster, "n1", other)

        # Paged by cursor through the other replica: the pages add up to the whole.
        pages, cursor = [], None
        while True:
            q = "?limit=3" + (f"&cursor={cursor}" if cursor else "")
            page = records(cluster, "c1", sid, q)
            if not page["records"]:
                break
            pages.extend(page["records"])
            cursor = page["nextCursor"]
        assert [r["hash"] for r in pages[:len(recs)]] == [r["hash"] for r in recs]
        # Kinds narrow it.
        only = records(cluster, "c1", sid, "?kind=process&limit=1000")["records"]
        assert only and {r["kind"] for r in only} == {"process"}

        # Verified through a replica, one chain and the team's.
        status, v = cluster.request("c1", "GET", f"/audit/verify?sandboxID={sid}")
        assert status == 200 and v["ok"] and v["chains"][0]["records"] >= len(recs), v
        status, v = cluster.request("c2", "GET", "/audit/verify")
        assert status == 200 and v["ok"], v
        assert {sid, other} <= {c["sandboxID"] for c in v["chains"]}, v
    finally:
        kill_all(made)


def test_following_a_sandboxs_records_through_a_replica_sees_new_ones(cluster):
    made = []
    try:
        s = on_node(cluster, "n2", "c1", made)
        f = Follower(cluster, "c2", f"/sandboxes/{s.sandbox_id}/audit?follow=true&kind=process")
        mark = secrets.token_hex(6)
        assert s.commands.run(f"echo {mark}").exit_code == 0
        lines = f.until(lambda lines: mentions(lines, "process", mark))
        assert mentions(lines, "process", mark), lines
        assert {r["kind"] for r in lines} == {"process"}
        cursors = [int(r["cursor"]) for r in lines]
        assert cursors == sorted(set(cursors)), "each record once, in order"
    finally:
        kill_all(made)


def test_an_edited_record_in_a_nodes_database_fails_verification_through_a_replica(cluster):
    made = []
    try:
        s = on_node(cluster, "n1", "c2", made)
        mark = secrets.token_hex(6)
        s.commands.run(f"echo {mark}")
        wait_records(cluster, "c1", s.sandbox_id, lambda r: mentions(r, "process", mark))
        db = sqlite3.connect(os.path.join(cluster.nodes["n1"].state_dir, "kiln.db"), timeout=10)
        try:
            with db:
                n = db.execute(
                    "UPDATE audit SET body = replace(body, ?, 'edited') "
                    "WHERE sandbox_id = ? AND kind = 'process' AND body LIKE ?",
                    (mark, s.sandbox_id, f"%{mark}%")).rowcount
        finally:
            db.close()
        assert n >= 1
        status, v = cluster.request("c1", "GET", f"/audit/verify?sandboxID={s.sandbox_id}")
        assert status == 200 and v["ok"] is False, v
        assert v["chains"][0]["firstBadSeq"] >= 1 and v["chains"][0]["reason"], v
    finally:
        kill_all(made)


def every_page(cluster, control: str, path: str, query: str, key: str) -> tuple:
    """Every item of `path?query` through `control`, page by page; the cursor after the last."""
    out, cursor = [], None
    while True:
        q = query + (f"&cursor={cursor}" if cursor else "")
        status, page = cluster.request(control, "GET", f"{path}?{q}")
        assert status == 200, page
        cursor = page["nextCursor"]
        if not page[key]:
            return out, cursor
        out.extend(page[key])


def test_every_sandboxs_records_are_read_through_a_replica_page_by_page(cluster):
    made = []
    try:
        here = on_node(cluster, "n1", "c1", made)
        there = on_node(cluster, "n2", "c2", made)
        marks = {}
        for s in (here, there):
            marks[s.sandbox_id] = secrets.token_hex(6)
            assert s.commands.run(f"echo {marks[s.sandbox_id]}").exit_code == 0
        for s in (here, there):
            wait_records(cluster, "c1", s.sandbox_id,
                         lambda r, m=marks[s.sandbox_id]: mentions(r, "process", m))

        # Pages of two from both nodes through the other replica: each record once, the same
        # records as each sandbox's own reads.
        recs, end = every_page(cluster, "c2", "/audit", "kind=process&limit=2", "records")
        keys = [(r["sandboxID"], r["seq"]) for r in recs]
        assert len(keys) == len(set(keys)), "each record once"
        for s in (here, there):
            assert mentions(recs, "process", marks[s.sandbox_id]), recs
            own = records(cluster, "c1", s.sandbox_id, "?kind=process&limit=1000")["records"]
            assert sorted(seq for sid, seq in keys if sid == s.sandbox_id) == [r["seq"] for r in own]

        # A poller at the end, through the other replica, sees only what is new, on either node.
        new = {s.sandbox_id: secrets.token_hex(6) for s in (here, there)}
        for s in (here, there):
            assert s.commands.run(f"echo {new[s.sandbox_id]}").exit_code == 0
        fresh, deadline = [], time.time() + 30
        while time.time() < deadline and not all(mentions(fresh, "process", m) for m in new.values()):
            status, page = cluster.request("c1", "GET", f"/audit?kind=process&cursor={end}")
            assert status == 200, page
            fresh.extend(page["records"])
            end = page["nextCursor"]
            time.sleep(0.3)
        assert all(mentions(fresh, "process", m) for m in new.values()), fresh
        assert not {(r["sandboxID"], r["seq"]) for r in fresh} & set(keys), "nothing read twice"

        # Followed live across both nodes.
        f = Follower(cluster, "c2", f"/audit?follow=true&kind=process&cursor={end}")
        live = {s.sandbox_id: secrets.token_hex(6) for s in (here, there)}
        for s in (here, there):
            assert s.commands.run(f"echo {live[s.sandbox_id]}").exit_code == 0
        lines = f.until(lambda lines: all(mentions(lines, "process", m) for m in live.values()))
        assert all(mentions(lines, "process", m) for m in live.values()), lines
        seen = [(r["sandboxID"], r["seq"]) for r in lines]
        assert len(seen) == len(set(seen)), "each record once"

        # A number is not a cluster's cursor: the answer says what to pass.
        status, body = cluster.request("c1", "GET", "/audit?cursor=12")
        assert status == 400 and "nextCursor" in body["message"], body
    finally:
        kill_all(made)


def test_alerts_raised_on_either_node_are_read_through_a_replica(cluster):
    made = []
    try:
        here = on_node(cluster, "n1", "c1", made)
        there = on_node(cluster, "n2", "c2", made)
        ids = {here.sandbox_id, there.sandbox_id}
        for s in (here, there):
            # The built-in rules' credential grab (each node's rule engine reads its chains).
            s.commands.run("cat /etc/shadow > /dev/null 2>&1 || true")
        deadline, got = time.time() + 30, []
        while time.time() < deadline:
            got, _ = every_page(cluster, "c1", "/alerts", "rule=read_shadow&limit=1", "alerts")
            if ids <= {a["sandboxID"] for a in got}:
                break
            time.sleep(0.5)
        mine = [a for a in got if a["sandboxID"] in ids]
        assert sorted(a["sandboxID"] for a in mine) == sorted(ids), got
        assert {a["rule"] for a in mine} == {"read_shadow"}
        # Narrowed to one sandbox, through the other replica.
        status, page = cluster.request("c2", "GET", f"/alerts?sandboxID={there.sandbox_id}")
        assert status == 200, page
        assert [a["rule"] for a in page["alerts"]] == ["read_shadow"], page
        # Each alert names the audit record that triggered it, on its sandbox's chain.
        recs = records(cluster, "c2", there.sandbox_id, "?limit=1000")["records"]
        by_cursor = {r["cursor"]: r for r in recs}
        (trigger,) = page["alerts"][0]["records"]
        assert by_cursor[trigger]["kind"] == "process", by_cursor.get(trigger)
        status, body = cluster.request("c2", "GET", "/alerts?cursor=3")
        assert status == 400 and "nextCursor" in body["message"], body
        # Each is an `alert` event of the cluster (the events API, and so webhooks).
        for s in (here, there):
            status, ev = cluster.request("c1", "GET", f"/events?sandboxId={s.sandbox_id}&type=alert")
            assert status == 200, ev
            assert [e["type"] for e in ev["events"]] == ["alert"], ev
            assert "read_shadow" in ev["events"][0]["detail"], ev
    finally:
        kill_all(made)


def test_a_replica_with_the_audit_log_off_records_nothing_and_serves_no_audit(cluster):
    from e2b import Sandbox

    if "c3" not in cluster.controls:
        cluster.start_control("c3", extra=["--audit", "off"])
    made = []
    try:
        s = on_node(cluster, "n1", "c1", made)
        try:
            quiet = Sandbox.connect(s.sandbox_id, **cluster.opts("c3"))
        except Exception as e:
            # What each replica shows of it, for the failure's report.
            seen = {c: cluster.request(c, "GET", f"/sandboxes/{s.sandbox_id}") for c in ("c1", "c3")}
            raise AssertionError(f"connect through c3: {e!r}; GET /sandboxes/{{id}}: {seen}") from e
        mark, seen = secrets.token_hex(6), secrets.token_hex(6)
        assert quiet.commands.run(f"echo {mark}").exit_code == 0
        assert s.commands.run(f"echo {seen}").exit_code == 0
        recs = wait_records(cluster, "c1", s.sandbox_id, lambda r: mentions(r, "process", seen))
        assert mentions(recs, "process", seen), recs
        assert not mentions(recs, "process", mark), "c3 records nothing"
        status, body = cluster.request("c3", "GET", f"/sandboxes/{s.sandbox_id}/audit")
        assert status == 501, body
    finally:
        kill_all(made)
