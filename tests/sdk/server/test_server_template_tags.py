"""E2B's tag history through the pinned `e2b` SDK's generated client (the high-level SDK does
not call these routes): `GET /templates/{id}/tags/groups` (tags with a ready build, each with
its latest assignments; sort, search, `assignmentLimit`/`hasMore`, keyset pages over tags) and
`GET /templates/{id}/tags/{tag}/assignments` (newest first, keyset pages). Two builds and
re-assigned tags make the history; another team gets 404; bad parameters 400."""

import subprocess
import uuid

from .conftest import kiln_bin


def _client():
    from e2b.api import ApiClient
    from e2b.connection_config import ConnectionConfig

    return ApiClient(ConnectionConfig())


def test_tag_groups_and_assignments(server):
    from e2b import Template
    from e2b.api.client.api.tags import (
        get_templates_template_id_tags_groups as groups_api,
        get_templates_template_id_tags_tag_assignments as assignments_api,
    )
    from e2b.api.client.models import GetTemplatesTemplateIDTagsGroupsSort as Sort

    name = f"kt-tags-{uuid.uuid4().hex[:6]}"
    b1 = Template.build(Template().from_template("base").run_cmd("echo 1 > /home/user/n.txt"),
                        f"{name}:v1")
    b2 = Template.build(Template().from_template("base").run_cmd("echo 2 > /home/user/n.txt"),
                        f"{name}:v2")
    Template.assign_tags(f"{name}:v1", ["prod"])
    Template.assign_tags(f"{name}:v2", ["prod"])
    tid = b1.template_id
    c = _client()

    def groups(**kw):
        r = groups_api.sync_detailed(tid, client=c, **kw)
        assert r.status_code == 200, r.content
        return r.parsed

    # By name: every tag with its assignments, newest first.
    g = groups(sort=Sort.NAME_ASC)
    assert [t.tag for t in g.tags] == ["prod", "v1", "v2"], g
    by = {t.tag: t for t in g.tags}
    assert [str(a.build_id) for a in by["prod"].assignments] == [b2.build_id, b1.build_id]
    assert [str(a.build_id) for a in by["v1"].assignments] == [b1.build_id]
    a = by["v2"].assignments[0]
    assert a.build_finished_at is not None and a.build_created_at <= a.build_finished_at
    assert a.assigned_at >= a.build_created_at
    assert g.next_cursor is None and not any(t.has_more for t in g.tags)

    # The latest assignment first: prod (moved to v2 last), then v2's tags.
    assert groups().tags[0].tag == "prod"
    assert [t.tag for t in groups(sort=Sort.LATEST_ASC).tags][0] == "v1"
    assert [t.tag for t in groups(sort=Sort.NAME_DESC).tags] == ["v2", "v1", "prod"]

    # assignmentLimit cuts each group; search matches part of the name.
    g = groups(sort=Sort.NAME_ASC, assignment_limit=1)
    assert [(t.tag, len(t.assignments), t.has_more) for t in g.tags] == [
        ("prod", 1, True), ("v1", 1, False), ("v2", 1, False)]
    assert [t.tag for t in groups(search="V", sort=Sort.NAME_ASC).tags] == ["v1", "v2"]

    # Pages over tags with the cursor.
    p1 = groups(sort=Sort.NAME_ASC, tags_limit=2)
    assert [t.tag for t in p1.tags] == ["prod", "v1"] and p1.next_cursor
    p2 = groups(sort=Sort.NAME_ASC, tags_limit=2, tags_cursor=p1.next_cursor)
    assert [t.tag for t in p2.tags] == ["v2"] and p2.next_cursor is None
    l1 = groups(tags_limit=2)
    l2 = groups(tags_limit=2, tags_cursor=l1.next_cursor)
    assert [t.tag for t in l1.tags + l2.tags] == [t.tag for t in groups().tags]

    # One tag's assignments, paged.
    r = assignments_api.sync_detailed(tid, "prod", client=c, limit=1)
    assert r.status_code == 200, r.content
    assert [str(a.build_id) for a in r.parsed.data] == [b2.build_id] and r.parsed.next_cursor
    r2 = assignments_api.sync_detailed(tid, "prod", client=c, limit=1, cursor=r.parsed.next_cursor)
    assert [str(a.build_id) for a in r2.parsed.data] == [b1.build_id]
    assert r2.parsed.next_cursor is None
    assert r.parsed.data[0].assignment_id != r2.parsed.data[0].assignment_id
    r = assignments_api.sync_detailed(name, "nope", client=c)
    assert r.status_code == 200 and r.parsed.data == [], r.content

    # A removed tag leaves the groups.
    Template.remove_tags(name, ["prod"])
    assert [t.tag for t in groups(sort=Sort.NAME_ASC).tags] == ["v1", "v2"]

    # Bad parameters; another team's template.
    for q in ("sort=sideways", "tagsLimit=0", "assignmentLimit=1000", "tagsCursor=%21%21"):
        status, body, _ = server.request("GET", f"/templates/{tid}/tags/groups?{q}")
        assert status == 400, (q, body)
    status, body, _ = server.request("GET", f"/templates/{tid}/tags/bad%20tag/assignments")
    assert status == 400, body
    status, body, _ = server.request("GET", f"/templates/{tid}/tags/v1/assignments?cursor=xyz")
    assert status == 400, body
    r = subprocess.run([kiln_bin(), "keys", "create", "--team", "kt-tags-other", "--state-dir",
                        server.state_dir], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    other = r.stdout.strip()
    for path in (f"/templates/{tid}/tags/groups", f"/templates/{tid}/tags/v1/assignments"):
        status, body, _ = server.request("GET", path, api_key=other)
        assert status == 404, (path, body)

    assert server.request("DELETE", f"/templates/{name}")[0] == 204
