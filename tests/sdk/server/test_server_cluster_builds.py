"""E2B's Template API on a kiln cluster (docs/cluster.md, "Template builds"): a one-member
etcd, two `kiln node` processes (n2 started with `--template-builds`) and two `kiln control`
replicas on 127.0.0.1. Through the pinned e2b SDK: `Template.build` through one replica (a
COPY of a local directory, RUN, ENV and WORKDIR steps, its logs streamed) runs on the build
node; the template is seen through the other replica (exists, tags), a `Sandbox.create` of it
through either replica runs on the build node with the built files and defaults, a tag
assigned through one replica is used through the other, another team's key finds nothing, and
a delete through a replica removes it. Without a build node the Template API answers 501
saying what to start. Needs KILN_BIN, the base template, runsc and etcd.
"""

import json
import tempfile
import urllib.request
import uuid

import pytest
from e2b import Sandbox, Template

from .test_server_cluster import Cluster, finish


@pytest.fixture(scope="module")
def cluster():
    base = tempfile.mkdtemp(prefix="kiln-cluster-build-")
    c = None
    try:
        c = Cluster(base)
        c.start_node("n1")
        c.start_node("n2", ["--template-builds"])
        c.start_control("c1")
        c.start_control("c2")
        yield c
    finally:
        finish(c, base)


def team_key(cluster, team: str) -> str:
    """A new API key of `team`, made through a replica with the operator's key."""
    req = urllib.request.Request(cluster.controls["c1"].url + "/api-keys", method="POST",
                                 data=json.dumps({"name": team, "team": team}).encode(),
                                 headers={"X-API-Key": cluster.api_key,
                                          "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())["key"]


def api(cluster, control: str) -> dict:
    return {"api_key": cluster.api_key, "api_url": cluster.controls[control].url}


def test_a_template_built_through_a_replica_runs_on_the_build_node(cluster, tmp_path):
    ctx = tmp_path / "ctx"
    (ctx / "app").mkdir(parents=True)
    (ctx / "app" / "main.py").write_text("print('hi from app')\n")
    name = f"kc-app-{uuid.uuid4().hex[:6]}"
    tpl = (Template(file_context_path=str(ctx))
           .from_template("base")
           .copy("app", "/home/user/app/")
           .set_envs({"GREETING": "hello-env"})
           .run_cmd("echo built-$GREETING; echo $GREETING > /home/user/greet.txt")
           .set_workdir("/home/user/work"))
    logs = []
    info = Template.build(tpl, f"{name}:v1", on_build_logs=logs.append, **api(cluster, "c1"))
    text = "\n".join(str(entry.message) for entry in logs)
    assert "built-hello-env" in text, text
    assert info.name == f"{name}:v1" and "v1" in info.tags, info

    # Seen through the other replica.
    assert Template.exists(name, **api(cluster, "c2"))
    assert not Template.exists(f"nope-{uuid.uuid4().hex[:6]}", **api(cluster, "c2"))
    Template.assign_tags(f"{name}:v1", ["prod"], **api(cluster, "c2"))
    assert {"v1", "prod"} <= {t.tag for t in Template.get_tags(name, **api(cluster, "c1"))}

    # Its sandboxes run on the build node, through either replica, from any of its names.
    for control, ref in (("c1", name), ("c2", f"{name}:v1"), ("c1", f"{name}:prod")):
        sbx = Sandbox.create(ref, timeout=60, **cluster.opts(control))
        try:
            assert cluster.node_of(sbx.sandbox_id) == "n2"
            run = lambda c: sbx.commands.run(c).stdout.strip()  # noqa: E731
            assert run("cat /home/user/app/main.py") == "print('hi from app')"
            assert run("cat /home/user/greet.txt") == "hello-env"
            assert run("pwd") == "/home/user/work"
        finally:
            sbx.kill()

    # Another team sees nothing of it.
    status, _ = cluster.request("c1", "GET", f"/templates/aliases/{name}")
    assert status == 200
    other = team_key(cluster, "build-other")
    with pytest.raises(Exception):
        Sandbox.create(name, timeout=60, api_key=other, api_url=cluster.controls["c2"].url,
                       sandbox_url=cluster.controls["c2"].url)

    # Deleted through a replica: gone, and a create of it is refused.
    status, _ = cluster.request("c2", "DELETE", f"/templates/{info.template_id}")
    assert status == 204
    assert not Template.exists(name, **api(cluster, "c1"))
    with pytest.raises(Exception):
        Sandbox.create(name, timeout=60, **cluster.opts("c1"))


def test_without_a_build_node_the_template_api_says_what_to_start(cluster):
    cluster.nodes["n2"].stop()
    try:
        status, body = cluster.request("c1", "POST", "/template-builds/gc")
        assert status == 501 and "--template-builds" in body["message"], body
        # Snapshots are still deleted through a replica without it.
        status, body = cluster.request("c2", "DELETE", "/templates/snap-nope")
        assert status == 404, body
    finally:
        cluster.start_node("n2", ["--template-builds"])
