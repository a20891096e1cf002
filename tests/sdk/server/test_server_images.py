"""A template made from a container image, end to end: the test builds a small image from files
of the base template's rootfs (bash and the C library, an /etc without the user `user`, a
marker layer), pushes it with skopeo to Debian's docker-registry on loopback, runs `kiln
template build --from-image` with `--registry-mirror docker.io=…` (so a Docker Hub-style name
resolves to the local registry), and the real e2b SDK runs commands in `Sandbox.create(name)`.
"""

import gzip
import hashlib
import io
import json
import os
import shutil
import socket
import subprocess
import tarfile
import tempfile
import time

import pytest
from e2b import Sandbox

from .conftest import kiln_bin

TEMPLATE = "kiln-test-image"


def need(*programs):
    missing = [p for p in programs if shutil.which(p) is None]
    if missing:
        pytest.fail(f"{', '.join(missing)} not installed (scripts/test.sh installs docker-registry and skopeo)")


def base_rootfs() -> str:
    cache = os.environ.get("KILN_CACHE_DIR") or "/var/lib/kiln/cache"
    p = os.path.join(cache, "templates", "base", "current", "rootfs")
    if not os.path.isdir(p):
        pytest.fail(f"the base template is not built ({p}): run `kiln template build base` first")
    return p


@pytest.fixture(scope="module")
def registry():
    need("docker-registry", "skopeo")
    d = tempfile.mkdtemp(prefix="kiln-registry-")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    addr = "127.0.0.1:%d" % s.getsockname()[1]
    s.close()
    cfg = os.path.join(d, "config.yml")
    with open(cfg, "w") as f:
        f.write(f"version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {d}/data\n"
                f"http:\n  addr: {addr}\n")
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


def test_sandbox_from_a_registry_image(server, registry, tmp_path):
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

    layers = [layer(system), layer(marker)]
    config = {"architecture": "amd64", "os": "linux",
              "config": {"Env": ["PATH=/usr/bin:/bin", "FOO=bar"], "WorkingDir": "/srv/app"},
              "rootfs": {"type": "layers", "diff_ids": [d for _, d in layers]}}
    layout = str(tmp_path / "layout")
    write_layout(layout, layers, config, "1")
    push = subprocess.run(["skopeo", "--insecure-policy", "copy", "--quiet", "--dest-tls-verify=false",
                           f"oci:{layout}:1", f"docker://{registry}/library/kiln-e2e:1"],
                          capture_output=True, text=True, timeout=120)
    assert push.returncode == 0, push.stderr

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
