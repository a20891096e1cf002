"""A template made from a container image, end to end: the test builds a small image from files
of the base template's rootfs (bash and the C library, an /etc without the user `user`, a
marker layer), pushes it with skopeo to Debian's docker-registry on loopback, runs `kiln
template build --from-image` with `--registry-mirror docker.io=…` (so a Docker Hub-style name
resolves to the local registry), and the real e2b SDK runs commands in `Sandbox.create(name)`.

The same images pulled by the server itself in Template API builds: a server started with
`--registry-mirror docker.io=…`, the SDK's `Template().from_image(...)` with RUN steps (two
builds of one image at once pull it once), an unknown tag, and a registry behind Basic auth
with `from_image(..., username=, password=)` and a wrong password.
"""

import contextlib
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import socket
import subprocess
import tarfile
import tempfile
import threading
import time
import uuid

import pytest
from e2b import Sandbox, Template
from e2b.exceptions import BuildException
from framework.skip import need_tools

from .conftest import kiln_bin, own_server

TEMPLATE = "kiln-test-image"


def need(*programs):
    need_tools(*programs, hint="scripts/test.sh installs docker-registry and skopeo")


def base_rootfs() -> str:
    cache = os.environ.get("KILN_CACHE_DIR") or "/var/lib/kiln/cache"
    p = os.path.join(cache, "templates", "base", "current", "rootfs")
    if not os.path.isdir(p):
        pytest.fail(f"the base template is not built ({p}): run `kiln template build base` first")
    return p


@contextlib.contextmanager
def run_registry(creds=None):
    """Debian's docker-registry on a free loopback port; with `creds` (a list of (user,
    password)) every request needs one of them (Basic auth, bcrypt htpasswd entries)."""
    need("docker-registry", "skopeo", *(["htpasswd"] if creds else []))
    d = tempfile.mkdtemp(prefix="kiln-registry-")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    addr = "127.0.0.1:%d" % s.getsockname()[1]
    s.close()
    auth = ""
    if creds:
        with open(os.path.join(d, "htpasswd"), "w") as f:
            for c in creds:
                pw = subprocess.run(["htpasswd", "-Bbn", *c], capture_output=True, text=True, check=True)
                f.write(pw.stdout.strip() + "\n")
        auth = f"auth:\n  htpasswd:\n    realm: kiln-test\n    path: {d}/htpasswd\n"
    cfg = os.path.join(d, "config.yml")
    with open(cfg, "w") as f:
        f.write(f"version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {d}/data\n"
                f"http:\n  addr: {addr}\n" + auth)
    proc = subprocess.Popen(["docker-registry", "serve", cfg], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    try:
        deadline = time.time() + 15
        while True:
            try:
                socket.create_connection(addr.split(":"), timeout=1).close()
                break
            except OSError:
                assert time.time() < deadline, "docker-registry did not start"
                time.sleep(0.02)
        yield addr
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def registry():
    with run_registry() as addr:
        yield addr


def layer(build) -> tuple:
    """(gzip blob, diff_id) of the tar `build(tarfile)` writes."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as t:
        build(t)
    data = raw.getvalue()
    return gzip.compress(data, compresslevel=1), "sha256:" + hashlib.sha256(data).hexdigest()


def add_bytes(t: tarfile.TarFile, name: str, data: bytes, mode=0o644):
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), mode, 1_700_000_000
    t.addfile(info, io.BytesIO(data))


def write_layout(d: str, layers: list, config: dict, tag: str):
    os.makedirs(os.path.join(d, "blobs", "sha256"), exist_ok=True)

    def blob(data: bytes, media: str) -> dict:
        h = hashlib.sha256(data).hexdigest()
        with open(os.path.join(d, "blobs", "sha256", h), "wb") as f:
            f.write(data)
        return {"mediaType": media, "digest": "sha256:" + h, "size": len(data)}

    cfg = blob(json.dumps(config).encode(), "application/vnd.oci.image.config.v1+json")
    ls = [blob(b, "application/vnd.oci.image.layer.v1.tar+gzip") for b, _ in layers]
    manifest = blob(json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                                "config": cfg, "layers": ls}).encode(),
                    "application/vnd.oci.image.manifest.v1+json")
    manifest["annotations"] = {"org.opencontainers.image.ref.name": tag}
    with open(os.path.join(d, "index.json"), "w") as f:
        json.dump({"schemaVersion": 2, "manifests": [manifest]}, f)
    with open(os.path.join(d, "oci-layout"), "w") as f:
        f.write('{"imageLayoutVersion":"1.0.0"}')


def small_image(layout: str, tag: str, ident: str = ""):
    """An OCI layout at `layout` of a two-layer image made from the base template's rootfs:
    bash and the C library, an /etc without the user `user` and a marker whited out by the
    second layer, which adds /srv/app/marker (and /srv/app/id with `ident`, so a fresh image
    has a layer no cache holds); Env FOO=bar, WorkingDir /srv/app."""
    root = base_rootfs()
    libs = "usr/lib/x86_64-linux-gnu"
    wanted = ["bin", "lib", "lib64", "usr/bin/bash", "usr/lib64", f"{libs}/ld-linux-x86-64.so.2"] + [
        f"{libs}/{n}" for n in sorted(os.listdir(os.path.join(root, libs)))
        if n.startswith(("libc.so.6", "libtinfo.so.6"))]

    def system(t):
        for p in wanted:
            if os.path.lexists(os.path.join(root, p)):
                t.add(os.path.join(root, p), arcname=p)
        add_bytes(t, "etc/passwd", b"root:x:0:0:root:/root:/bin/bash\n")
        add_bytes(t, "etc/group", b"root:x:0:\n")
        add_bytes(t, "etc/image-marker", b"lower\n")

    def marker(t):
        add_bytes(t, "etc/.wh.image-marker", b"")
        add_bytes(t, "srv/app/marker", b"from-registry\n")
        if ident:
            add_bytes(t, "srv/app/id", ident.encode() + b"\n")

    layers = [layer(system), layer(marker)]
    config = {"architecture": "amd64", "os": "linux",
              "config": {"Env": ["PATH=/usr/bin:/bin", "FOO=bar"], "WorkingDir": "/srv/app"},
              "rootfs": {"type": "layers", "diff_ids": [d for _, d in layers]}}
    write_layout(layout, layers, config, tag)


def push(layout: str, tag: str, dest: str, creds=None):
    """skopeo copy of the layout's `tag` to `docker://dest`."""
    cmd = ["skopeo", "--insecure-policy", "copy", "--quiet", "--dest-tls-verify=false"]
    if creds:
        cmd.append("--dest-creds=%s:%s" % creds)
    r = subprocess.run(cmd + [f"oci:{layout}:{tag}", f"docker://{dest}"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_sandbox_from_a_registry_image(server, registry, tmp_path):
    layout = str(tmp_path / "layout")
    small_image(layout, "1")
    push(layout, "1", f"{registry}/library/kiln-e2e:1")

    build = subprocess.run([kiln_bin(), "template", "build", "--from-image", "kiln-e2e:1",
                            "--registry-mirror", f"docker.io=http://{registry}", "--name", TEMPLATE, "--force"],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stdout + build.stderr
    assert "docker.io/library/kiln-e2e:1" in build.stderr, build.stderr

    sbx = Sandbox.create(TEMPLATE, timeout=120)
    try:
        r = sbx.commands.run('echo "$(< marker) $FOO $EUID $PWD"; [ -e /etc/image-marker ] || echo whiteout-applied')
        assert r.stdout.split("\n")[:2] == ["from-registry bar 1000 /srv/app", "whiteout-applied"], r.stdout
        r = sbx.commands.run("sudo bash -c 'echo $EUID'")
        assert r.stdout.strip() == "0", (r.stdout, r.stderr)
    finally:
        sbx.kill()


# ---- images pulled by Template API builds ----

CREDS = ("kiln", "s3cret-pass")
# A Google service account key as `from_gcp_registry` sends it; Google's registries take it as
# the password of user `_json_key` (htpasswd's bcrypt compares its first 72 bytes).
GCP_KEY = {"type": "service_account", "project_id": "kiln-test", "private_key_id": "0123456789abcdef"}
GCP_CREDS = ("_json_key", json.dumps(GCP_KEY))


@pytest.fixture(scope="module")
def auth_registry():
    with run_registry([CREDS, GCP_CREDS]) as addr:
        yield addr


@pytest.fixture(scope="module")
def pull_server(registry, auth_registry):
    """A server whose Docker Hub is the test registry (and no automatic store collection: it
    shares the host's template cache)."""
    try:
        with own_server("kiln-img-pull-", ["--registry-mirror", f"docker.io=http://{registry}",
                                           "--template-gc-store", "off"]) as s:
            yield s
    finally:
        # The images' kiln templates these tests made (random tags: never reused) leave the
        # host's shared template cache with the module.
        cache = os.path.join(os.environ.get("KILN_CACHE_DIR") or "/var/lib/kiln/cache", "templates")
        for name in os.listdir(cache) if os.path.isdir(cache) else []:
            if re.fullmatch(r"kiln-sdk-(pull|public|auth|gcp)-[0-9a-f]{8}", name):
                shutil.rmtree(os.path.join(cache, name), ignore_errors=True)


def _build(srv, tpl, name):
    logs = []
    try:
        Template.build(tpl, name, on_build_logs=logs.append, **srv.opts())
    finally:
        text = "\n".join(str(l.message) for l in logs)
    return text


def test_sdk_from_image_pulls_through_the_mirror(pull_server, registry, tmp_path):
    ident = uuid.uuid4().hex[:8]
    layout = str(tmp_path / "layout")
    small_image(layout, ident, ident)
    push(layout, ident, f"{registry}/library/kiln-sdk-pull:{ident}")

    def tpl():
        return (Template().from_image(f"kiln-sdk-pull:{ident}")
                .run_cmd("echo built-as-root > /srv/app/root.txt", user="root")
                .run_cmd("echo $EUID > ~/who.txt"))

    # Two builds of the image at once: one pulls it, the other waits and uses the result.
    names = [f"kt-pull-{ident}-a", f"kt-pull-{ident}-b"]
    out, errors = {}, []

    def run(n):
        try:
            out[n] = _build(pull_server, tpl(), n)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"{n}: {e!r}")

    threads = [threading.Thread(target=run, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    pulls = [n for n in names if f"Pulling image docker.io/library/kiln-sdk-pull:{ident}" in out[n]]
    assert len(pulls) == 1, out
    text = out[pulls[0]]
    assert "layer sha256:" in text and "fetched" in text, text
    assert f"kiln-sdk-pull-{ident}" in text, text

    for n in names:
        sbx = Sandbox.create(n, timeout=120, **pull_server.opts())
        try:
            # The image has bash and no coreutils: bash's own `$(< f)` reads the files.
            r = sbx.commands.run("for f in /srv/app/marker /srv/app/id /srv/app/root.txt ~/who.txt; "
                                 "do echo \"$(< $f)\"; done")
            assert r.stdout.split("\n")[:4] == ["from-registry", ident, "built-as-root", "1000"], r.stdout
        finally:
            sbx.kill()


def test_sdk_from_image_unknown_tag_names_the_image(pull_server):
    with pytest.raises(BuildException) as e:
        _build(pull_server, Template().from_image("kiln-sdk-pull:no-such-tag").run_cmd("true"),
               f"kt-pull-missing-{uuid.uuid4().hex[:6]}")
    msg = str(e.value)
    assert "docker.io/library/kiln-sdk-pull:no-such-tag" in msg, msg
    assert "MANIFEST_UNKNOWN" in msg or "NAME_UNKNOWN" in msg, msg


def test_sdk_from_image_with_registry_credentials(pull_server, auth_registry, tmp_path):
    ident = uuid.uuid4().hex[:8]
    layout = str(tmp_path / "layout")
    small_image(layout, ident, ident)
    image = f"{auth_registry}/private/kiln-sdk-auth:{ident}"
    push(layout, ident, image, CREDS)

    def tpl(password):
        return (Template().from_image(image, username=CREDS[0], password=password)
                .run_cmd("echo private > ~/p.txt"))

    with pytest.raises(BuildException) as e:
        _build(pull_server, tpl("wrong-pass"), f"kt-auth-bad-{ident}")
    msg = str(e.value)
    assert image.split("/", 1)[1] in msg and "refused" in msg and '"kiln"' in msg, msg

    name = f"kt-auth-{ident}"
    text = _build(pull_server, tpl(CREDS[1]), name)
    sbx = Sandbox.create(name, timeout=120, **pull_server.opts())
    try:
        r = sbx.commands.run('echo "$(< /srv/app/id)"; echo "$(< ~/p.txt)"')
        assert r.stdout.split("\n")[:2] == [ident, "private"], r.stdout
    finally:
        sbx.kill()

    # The image's own kiln template, named directly: a create carries no credentials, so the
    # registry is asked anonymously and refuses — 404 for every team, the builder's included
    # (it reaches the image through its build's name, above).
    m = re.search(r"is kiln template (\S+)", text)
    assert m, text
    image_tpl = m.group(1)
    status, body, _ = pull_server.request("POST", "/sandboxes", {"templateID": image_tpl})
    assert status == 404 and "private image" in str(body), (status, body)
    other = team_key(pull_server, "kt-img-other")
    status, body, _ = pull_server.request("POST", "/sandboxes", {"templateID": image_tpl}, api_key=other)
    assert status == 404, (status, body)

    # The template now exists; wrong credentials still fail (the registry is asked).
    with pytest.raises(BuildException) as e:
        _build(pull_server, tpl("wrong-again"), f"kt-auth-bad2-{ident}")
    assert "refused" in str(e.value), str(e.value)

    # Nor does a build without credentials get the private image through the template made
    # with them (it could be another team's): the registry is asked anonymously and refuses.
    with pytest.raises(BuildException) as e:
        _build(pull_server, Template().from_image(image).run_cmd("true"), f"kt-auth-anon-{ident}")
    msg = str(e.value)
    assert "refused anonymous access" in msg, msg


def team_key(srv, team: str) -> str:
    r = subprocess.run([kiln_bin(), "keys", "create", "--team", team, "--state-dir", srv.state_dir],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_sdk_from_image_public_template_is_created_by_its_own_name(pull_server, registry, tmp_path):
    """A public image's kiln template is no secret: any team creates it by its own name."""
    ident = uuid.uuid4().hex[:8]
    layout = str(tmp_path / "layout")
    small_image(layout, ident, ident)
    push(layout, ident, f"{registry}/library/kiln-sdk-public:{ident}")
    text = _build(pull_server, Template().from_image(f"kiln-sdk-public:{ident}").run_cmd("true"),
                  f"kt-public-{ident}")
    m = re.search(r"is kiln template (\S+)", text)
    assert m and m.group(1) == f"kiln-sdk-public-{ident}", text
    other = team_key(pull_server, "kt-img-public")
    status, body, _ = pull_server.request("POST", "/sandboxes", {"templateID": m.group(1), "timeout": 60},
                                          api_key=other)
    assert status == 201, (status, body)
    pull_server.request("DELETE", f"/sandboxes/{body['sandboxID']}", api_key=other)


def test_sdk_from_gcp_registry_logs_in_with_the_service_account_key(pull_server, auth_registry, tmp_path):
    ident = uuid.uuid4().hex[:8]
    layout = str(tmp_path / "layout")
    small_image(layout, ident, ident)
    image = f"{auth_registry}/private/kiln-sdk-gcp:{ident}"
    push(layout, ident, image, CREDS)
    name = f"kt-gcp-{ident}"
    _build(pull_server, Template().from_gcp_registry(image, service_account_json=GCP_KEY).run_cmd("true"), name)
    sbx = Sandbox.create(name, timeout=120, **pull_server.opts())
    try:
        assert sbx.commands.run('echo "$(< /srv/app/id)"').stdout.strip() == ident
    finally:
        sbx.kill()
    bad = dict(GCP_KEY, project_id="another-project")
    with pytest.raises(BuildException) as e:
        _build(pull_server, Template().from_gcp_registry(image, service_account_json=bad).run_cmd("true"),
               f"kt-gcp-bad-{ident}")
    assert "refused" in str(e.value) and "_json_key" in str(e.value), str(e.value)


def test_sdk_from_aws_registry_says_what_to_do_instead(pull_server, auth_registry):
    """kiln does not call AWS: a clear 400 naming the registry login that works instead."""
    tpl = Template().from_aws_registry(f"{auth_registry}/private/kiln-sdk-aws:1", access_key_id="AKIAKILNTEST",
                                       secret_access_key="not-a-secret", region="us-east-1").run_cmd("true")
    with pytest.raises(Exception) as e:
        _build(pull_server, tpl, f"kt-aws-{uuid.uuid4().hex[:6]}")
    msg = str(e.value)
    assert "not supported" in msg and "aws ecr get-login-password" in msg and 'username="AWS"' in msg, msg
