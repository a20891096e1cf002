"""`kiln template build -f Dockerfile` against the suite's server, through its Template API:
FROM, ARG, ENV, WORKDIR, COPY (with `--chown`, `.dockerignore` honoured), RUN, USER and CMD
as the start command (the template starts running); the build log on stdout; a second run
takes every step from the cache; a failing RUN exits 1 naming its step. The SDK then starts
the template by `name:tag`."""

import os
import subprocess
import uuid

from .conftest import kiln_bin

DOCKERFILE = """\
ARG GREETING=hi
FROM base
ENV APP=/srv/app
WORKDIR $APP
COPY --chown=user app/ ./
RUN echo $GREETING-$APP > built.txt && \\
    chown -R user /srv/app
USER user
CMD ["python3", "-m", "http.server", "8124", "--bind", "127.0.0.1"]
"""


def _kiln(server, *args):
    env = {**os.environ, "KILN_URL": server.url, "KILN_API_KEY": server.api_key}
    return subprocess.run([kiln_bin(), "template", "build", *args], capture_output=True,
                          text=True, timeout=600, env=env)


def test_dockerfile_build_from_the_cli(server, tmp_path):
    from e2b import Sandbox

    ctx = tmp_path / "site"
    (ctx / "app").mkdir(parents=True)
    (ctx / "app" / "index.html").write_text("hello from the cli\n")
    (ctx / "app" / "secret.txt").write_text("keep out\n")
    (ctx / ".dockerignore").write_text("app/secret.txt\n")
    (ctx / "Dockerfile").write_text(DOCKERFILE)
    name = f"kt-cli-{uuid.uuid4().hex[:6]}"
    args = ["-f", str(ctx / "Dockerfile"), "--name", name, "--tag", "t1",
            "--ready-cmd", "curl -sf http://127.0.0.1:8124/index.html"]
    r = _kiln(server, *args)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"template {name} (" in r.stdout and "ready after" in r.stdout, r.stdout
    assert "CACHED" not in r.stdout, r.stdout

    sbx = Sandbox.create(f"{name}:t1", timeout=60)
    try:
        run = lambda c: sbx.commands.run(c).stdout.strip()
        # The start command is already serving.
        assert run("curl -s http://127.0.0.1:8124/index.html") == "hello from the cli"
        assert run("cat built.txt") == "hi-/srv/app"
        assert run("pwd; whoami").split() == ["/srv/app", "user"]
        assert run("stat -c %U index.html") == "user"
        assert run("test -e secret.txt && echo yes || echo no") == "no"
    finally:
        sbx.kill()

    # The same Dockerfile again: every layer from the cache.
    r = _kiln(server, *args)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("CACHED") >= 2, r.stdout

    (ctx / "Dockerfile").write_text("FROM base\nRUN echo nearly\nRUN echo broken; exit 3\n")
    r = _kiln(server, "-f", str(ctx / "Dockerfile"), "--name", f"{name}-bad")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "step" in r.stderr and "exited with code 3" in r.stderr, r.stderr
    assert "broken" in r.stdout, r.stdout

    (ctx / "Dockerfile").write_text("FROM base\nFROM base\n")
    r = _kiln(server, "-f", str(ctx / "Dockerfile"), "--name", f"{name}-bad")
    assert r.returncode != 0 and "multi-stage" in r.stderr, r.stderr

    for n in (name, f"{name}-bad"):
        assert server.request("DELETE", f"/templates/{n}")[0] == 204
