"""E2B's Template API driven by the pinned `e2b` SDK against the suite's `kiln serve`: a build
from the `base` template that copies a local directory (honouring `.dockerignore`), runs
commands as `user` and as root with ENV and WORKDIR, streams its logs, gets tags; then
`Sandbox.create(name)` and `Sandbox.create("name:tag")` run commands in the result. A rebuild
with the last step changed takes the earlier steps from the cache; a background build is
polled; delete. Bad input: a failing RUN (step number and output tail, nothing cached), an
unknown image, an upload over the cap (413), an archive naming `..`, another team's template
(404 / alias 403), a build started twice (409)."""

import io
import os
import subprocess
import tarfile
import time
import uuid

import http.client
import urllib.parse

import pytest

from .conftest import kiln_bin, runsc_processes_for


def _ctx(tmp_path):
    ctx = tmp_path / "ctx"
    (ctx / "app" / "sub").mkdir(parents=True)
    (ctx / "app" / "main.py").write_text("print('hi from app')\n")
    (ctx / "app" / "sub" / "data.txt").write_text("data\n")
    (ctx / "app" / "secret.txt").write_text("do not copy\n")
    (ctx / ".dockerignore").write_text("app/secret.txt\n")
    return ctx


def _template(ctx, last="echo v1 > /opt/kt/last.txt"):
    from e2b import Template

    return (
        Template(file_context_path=str(ctx))
        .from_template("base")
        .copy("app", "/home/user/app/")
        .set_envs({"GREETING": "hello-env"})
        .run_cmd("echo built-$GREETING; echo $GREETING > /home/user/greet.txt; whoami > /home/user/who.txt")
        .set_workdir("/home/user/work")
        .run_cmd("pwd > where.txt && whoami >> where.txt")
        .run_cmd(f"mkdir -p /opt/kt && id -un > /opt/kt/root.txt && {last}", user="root")
    )


def _build(tpl, name, **kw):
    from e2b import Template

    logs = []
    t0 = time.time()
    info = Template.build(tpl, name, on_build_logs=logs.append, **kw)
    return info, [str(l.message) for l in logs], time.time() - t0


def test_template_build_copy_run_tags_cache_and_create(server, tmp_path):
    from e2b import Sandbox, Template

    ctx = _ctx(tmp_path)
    name = f"kt-app-{uuid.uuid4().hex[:6]}"
    info, logs, cold = _build(_template(ctx), f"{name}:v1")
    text = "\n".join(logs)
    assert info.name == f"{name}:v1" and "v1" in info.tags, info
    assert "built-hello-env" in text, text  # a RUN step's output, streamed
    assert f"Template created with ID: {info.template_id}" in text, text
    assert "CACHED" not in text, text

    for ref in (name, f"{name}:v1"):
        sbx = Sandbox.create(ref, timeout=60)
        try:
            run = lambda c: sbx.commands.run(c).stdout.strip()
            assert run("cat /home/user/app/main.py") == "print('hi from app')"
            assert run("cat /home/user/app/sub/data.txt") == "data"
            assert run("test -e /home/user/app/secret.txt && echo yes || echo no") == "no"
            assert run("stat -c %U /home/user/app/main.py") == "user"
            assert run("cat /home/user/greet.txt") == "hello-env"
            assert run("cat /home/user/who.txt") == "user"
            assert run("cat /home/user/work/where.txt").split() == ["/home/user/work", "user"]
            assert run("cat /opt/kt/root.txt /opt/kt/last.txt").split() == ["root", "v1"]
            assert run("pwd") == "/home/user/work"  # the last WORKDIR is the default
            assert run("whoami") == "user"
        finally:
            sbx.kill()

    assert Template.exists(name)
    assert Template.exists("base")
    assert not Template.exists(f"nope-{uuid.uuid4().hex[:6]}")
    Template.assign_tags(f"{name}:v1", ["prod"])
    tags = {t.tag for t in Template.get_tags(name)}
    assert {"v1", "prod"} <= tags, tags
    Template.remove_tags(name, ["prod"])
    assert "prod" not in {t.tag for t in Template.get_tags(name)}

    # The last step changed: the others come from the cache.
    info2, logs2, warm = _build(_template(ctx, last="echo v2 > /opt/kt/last.txt"), name)
    text2 = "\n".join(logs2)
    assert text2.count("CACHED") == 3, text2  # COPY and two RUNs; ENV and WORKDIR make no layer
    assert "built-hello-env" not in text2, text2
    sbx = Sandbox.create(name, timeout=60)
    try:
        assert sbx.commands.run("cat /opt/kt/last.txt").stdout.strip() == "v2"
    finally:
        sbx.kill()
    print(f"cold build {cold:.1f}s, rebuild of the last step {warm:.1f}s")

    # Background build, polled.
    bg = Template.build_in_background(
        Template().from_template("base").run_cmd("echo bg > /home/user/bg.txt"), f"{name}-bg")
    deadline, offset, seen = time.time() + 120, 0, []
    while True:
        st = Template.get_build_status(bg, logs_offset=offset)
        offset += len(st.log_entries)
        seen += [e.message for e in st.log_entries]
        if st.status.value in ("ready", "error") or time.time() > deadline:
            break
        time.sleep(0.2)
    assert st.status.value == "ready", (st, seen)
    assert any("echo bg" in m for m in seen), seen

    # Delete: the name no longer creates.
    for n in (name, f"{name}-bg"):
        status, body, _ = server.request("DELETE", f"/templates/{n}")
        assert status == 204, body
    assert not Template.exists(name)
    with pytest.raises(Exception):
        Sandbox.create(name, timeout=30)


def test_template_build_bad_input(server, tmp_path):
    from e2b import Template
    from e2b.exceptions import BuildException

    name = f"kt-bad-{uuid.uuid4().hex[:6]}"
    failing = (Template().from_template("base")
               .run_cmd("echo first-ok")
               .run_cmd("echo about-to-fail; exit 7"))
    for attempt in range(2):
        logs = []
        with pytest.raises(BuildException) as e:
            Template.build(failing, name, on_build_logs=logs.append)
        msg = str(e.value)
        assert "step 2" in msg and "exited with code 7" in msg and "about-to-fail" in msg, msg
        text = "\n".join(str(l.message) for l in logs)
        # Nothing was cached from the failing step (the first one is, on the second try).
        assert "CACHED [2/2]" not in text, text
        assert ("CACHED [1/2]" in text) == (attempt == 1), text

    with pytest.raises(BuildException) as e:
        Template.build(Template().from_image("kiln-test/nosuch-image:1"), f"{name}-img")
    assert "kiln-test/nosuch-image:1" in str(e.value), str(e.value)

    # A build is requested, then started twice with the same buildID.
    status, req, _ = server.request("POST", "/v3/templates", {"name": f"{name}-twice"})
    assert status == 202, req
    start = {"fromTemplate": "base", "force": False, "steps": []}
    path = f"/v2/templates/{req['templateID']}/builds/{req['buildID']}"
    status, body, _ = server.request("POST", path, start)
    assert status == 202, body
    status, body, _ = server.request("POST", path, start)
    assert status == 409, body

    # Uploads: over the cap (413, before any byte is read), an archive naming '..' (400).
    h = "ab" * 32
    status, link, _ = server.request("GET", f"/templates/{req['templateID']}/files/{h}")
    assert status == 201 and link["present"] is False, link
    u = urllib.parse.urlsplit(link["url"])
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.putrequest("PUT", u.path)
    conn.putheader("Content-Length", str(64 << 30))
    conn.endheaders()
    r = conn.getresponse()
    assert r.status == 413, r.read()
    conn.close()
    status, link, _ = server.request("GET", f"/templates/{req['templateID']}/files/{h}")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        ti = tarfile.TarInfo("../escape.txt")
        ti.size = 2
        tar.addfile(ti, io.BytesIO(b"hi"))
    u = urllib.parse.urlsplit(link["url"])
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("PUT", u.path, body=buf.getvalue())
    r = conn.getresponse()
    assert r.status == 400 and b"'..'" in r.read()
    conn.close()
    # The URL was single use.
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("PUT", u.path, body=b"x")
    assert conn.getresponse().status == 403
    conn.close()

    # Another team sees none of it.
    r = subprocess.run([kiln_bin(), "keys", "create", "--team", "kt-other", "--state-dir", server.state_dir],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    other = r.stdout.strip()
    status, body, _ = server.request("GET", f"/templates/{req['templateID']}/tags", api_key=other)
    assert status == 404, body
    status_path = f"/templates/{req['templateID']}/builds/{req['buildID']}/status"
    status, body, _ = server.request("GET", status_path, api_key=other)
    assert status == 404, body
    status, body, _ = server.request("GET", f"/templates/aliases/{name}-twice", api_key=other)
    assert status == 403, body
    status, body, _ = server.request("POST", "/sandboxes", {"templateID": f"{name}-twice"}, api_key=other)
    assert status == 404, body


def test_template_from_dockerfile_with_a_start_command(server, tmp_path):
    """A Dockerfile (the SDK turns it into steps) through the same pipeline; the start command
    runs during the build until the ready command passes, and the template is snapshotted
    running: the service answers as soon as `Sandbox.create` returns."""
    from e2b import Sandbox, Template

    ctx = _ctx(tmp_path)
    dockerfile = (
        "FROM base\n"
        "ENV SITE=/srv/site\n"
        "WORKDIR /srv/site\n"
        "COPY app/main.py ./\n"
        "RUN echo page-$SITE > index.html && chown -R user /srv/site\n"
        "USER user\n"
    )
    tpl = (Template(file_context_path=str(ctx)).from_dockerfile(dockerfile)
           .set_start_cmd("python3 -m http.server 8123 --bind 127.0.0.1",
                          "curl -sf http://127.0.0.1:8123/index.html"))
    name = f"kt-df-{uuid.uuid4().hex[:6]}"
    _, logs, took = _build(tpl, name)
    assert any("ready after" in m for m in logs), logs
    sbx = Sandbox.create(name, timeout=60)
    try:
        # No wait: the server was already running in the snapshot.
        r = sbx.commands.run("curl -s http://127.0.0.1:8123/index.html; cat main.py; pwd; whoami")
        assert r.stdout.split("\n")[:4] == ["page-/srv/site", "print('hi from app')", "/srv/site", "user"], r.stdout
    finally:
        sbx.kill()
    print(f"dockerfile build with a start command {took:.1f}s")
    assert server.request("DELETE", f"/templates/{name}")[0] == 204


def test_a_build_running_at_a_restart_ends_as_error(state_dir):
    """`kill -9` of the server mid-build: the restarted server reports the build as `error`
    with a clear reason (never a hung `building`) and removes its build sandbox (seen as its
    processes: build sandboxes are not in the team's sandbox list)."""
    from .conftest import KilnServer

    srv = KilnServer(state_dir, ["--network", "off", "--pool-off"]).start()
    try:
        status, req, _ = srv.request("POST", "/v3/templates", {"name": "kt-restart"})
        assert status == 202, req
        status_path = f"/templates/{req['templateID']}/builds/{req['buildID']}/status"
        start = {"fromTemplate": "base", "force": False,
                 "steps": [{"type": "RUN", "args": ["sleep 600"], "force": False}]}
        status, body, _ = srv.request(
            "POST", f"/v2/templates/{req['templateID']}/builds/{req['buildID']}", start)
        assert status == 202, body
        deadline = time.time() + 60
        while time.time() < deadline:
            if runsc_processes_for(state_dir):
                break
            time.sleep(0.2)
        else:
            pytest.fail("no build sandbox started")
        _, sbxs, _ = srv.request("GET", "/sandboxes")
        assert sbxs == [], sbxs
        _, st, _ = srv.request("GET", status_path)
        assert st["status"] == "building", st
        srv.kill9()
        srv.start()
        _, st, _ = srv.request("GET", status_path)
        assert st["status"] == "error", st
        assert "restarted while this build was running" in st["reason"]["message"], st
        deadline = time.time() + 60
        while time.time() < deadline:
            if not runsc_processes_for(state_dir):
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"the build sandbox was left running: {runsc_processes_for(state_dir)}")
    finally:
        srv.kill_all_sandboxes()
        srv.stop()
