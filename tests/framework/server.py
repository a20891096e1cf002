"""A real `kiln serve` for end-to-end tests: on a random port with a temporary state dir, real
gVisor sandboxes, the e2b SDK pointed at it through E2B_* variables. Everything a server started
is removed afterwards, even when a test fails: its sandboxes through the API, then any runsc
container, mount, network slot or directory left under its state dir.

Needs KILN_BIN (the kiln binary; scripts/test.sh builds it and the templates).
"""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

import pytest


def kiln_bin() -> str:
    b = os.environ.get("KILN_BIN")
    if not b:
        pytest.fail("KILN_BIN is not set: point it at the built `kiln` binary (scripts/test.sh does)")
    if not os.path.exists(b):
        pytest.fail(f"KILN_BIN={b} does not exist")
    return b


def cleanup_state(state_dir: str) -> None:
    """Removes every runsc container, mount and file a kiln server left under state_dir (its
    disk pool and volumes included: the server is gone, so nothing there is in use)."""
    root = os.path.join(state_dir, "gvisor", "runsc")
    runsc = shutil.which("runsc") or "/usr/bin/runsc"
    if os.path.isdir(root):
        try:
            out = subprocess.run(
                [runsc, f"--root={root}", "list", "--format=json"],
                capture_output=True, text=True, timeout=30,
            ).stdout
            for c in json.loads(out or "[]") or []:
                subprocess.run(
                    [runsc, f"--root={root}", "--network=none", "--host-uds=create",
                     "delete", "--force", c["id"]],
                    capture_output=True, timeout=60,
                )
        except Exception as e:  # keep cleaning up
            print(f"cleanup: runsc: {e}")
    for mp in sorted(mounts_under(state_dir, pool=True), reverse=True):
        subprocess.run(["umount", "-l", mp], capture_output=True)
    remove_net_slots(state_dir)
    shutil.rmtree(state_dir, ignore_errors=True)


def net_prefix(state_dir: str) -> str:
    """The name prefix of the network slots of the server with `state_dir` (kiln_net's
    prefix_for over `<state>/gvisor`: FNV-1a, low 16 bits)."""
    h = 0x811C9DC5
    for b in os.path.join(state_dir, "gvisor").encode():
        h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
    return "k%04x" % (h & 0xFFFF)


def remove_net_slots(state_dir: str) -> None:
    """Removes the namespaces, veths and host table a (killed) server left behind."""
    p = net_prefix(state_dir)
    for ns in os.listdir("/run/netns") if os.path.isdir("/run/netns") else []:
        if ns.startswith(p + "-"):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    for dev in os.listdir("/sys/class/net"):
        if dev.startswith(p + "h"):
            subprocess.run(["ip", "link", "del", dev], capture_output=True)
    subprocess.run(["nft", "delete", "table", "ip", f"kiln_{p}"], capture_output=True)


def mounts_under(path: str, pool: bool = False) -> list:
    """What is mounted at or under path; the gVisor driver's pool of ready disks
    (gvisor/disk-pool, mounted while the server runs) and its volumes (gvisor/volumes, which
    outlive sandboxes) only with pool=True."""
    skip = (os.path.join(path, "gvisor", "disk-pool"), os.path.join(path, "gvisor", "volumes"))
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split(" ")[4]
            if mp.startswith(path) and (pool or not mp.startswith(skip)):
                out.append(mp)
    return out


def runsc_processes_for(state_dir: str) -> list:
    """Command lines of processes that belong to sandboxes of this state dir."""
    procs = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if state_dir in cmd and "runsc" in cmd:
            procs.append(cmd)
    return procs


# Every KilnServer of the session, so that a failed test's server logs can be kept.
_SERVERS = []


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.kiln_servers_before = len(_SERVERS)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's server logs (the servers it used, and those started while it ran) are
    copied to $KILN_TEST_LOGS/<test name>.log (default /tmp/kiln-test-logs)."""
    rep = (yield).get_result()
    if not rep.failed:
        return
    used = [v for v in getattr(item, "funcargs", {}).values() if isinstance(v, KilnServer)]
    servers = used + [s for s in _SERVERS[getattr(item, "kiln_servers_before", 0):] if s not in used]
    logs = [(s.log_path, s.log()) for s in servers]
    logs = [(p, text) for p, text in logs if text]
    if not logs:
        return
    out_dir = os.environ.get("KILN_TEST_LOGS") or "/tmp/kiln-test-logs"
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, re.sub(r"[^A-Za-z0-9_.-]+", "_", item.name) + ".log")
    with open(out, "a") as f:
        for p, text in logs:
            f.write(f"==== {p} ({rep.when}) ====\n{text}\n")
    print(f"kiln server log of the failed test: {out}")
    rep.sections.append(("kiln server log", f"copied to {out}"))


class KilnServer:
    """One `kiln serve` process."""

    def __init__(self, state_dir: str, extra_args=(), prepare: bool = False):
        """prepare: start without `--no-prepare` (kiln prepares the host as `kiln serve` does
        for a user)."""
        _SERVERS.append(self)
        self.prepare = prepare
        self.state_dir = state_dir
        self.log_path = os.path.join(os.path.dirname(state_dir), os.path.basename(state_dir) + ".log")
        self.extra_args = list(extra_args)
        self.proc = None
        self.url = None
        self.api_key = None

    def start(self, timeout: float = 60) -> "KilnServer":
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen(
            [kiln_bin(), "serve", *([] if self.prepare else ["--no-prepare"]), "--listen", "127.0.0.1:0",
             "--state-dir", self.state_dir, *self.extra_args],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            # The template store is the host's shared cache: test servers leave its collection
            # to `kiln template gc` (KILN_TEMPLATE_GC_STORE=on in the environment turns it on).
            env={**os.environ, "KILN_LOG": os.environ.get("KILN_LOG", "info"), "NO_COLOR": "1",
                 "KILN_TEMPLATE_GC_STORE": os.environ.get("KILN_TEMPLATE_GC_STORE", "off")},
        )
        deadline = time.time() + timeout
        offset = os.path.getsize(self.log_path) if self.url else 0
        while time.time() < deadline:
            text = open(self.log_path).read()[offset:]
            m = re.search(r"listening on (http://[0-9.:]+)", text)
            if m and "SDK settings" in text:
                self.url = m.group(1)
                k = re.search(r"first API key \(shown once, store it now\): (e2b_[0-9a-f]+)", text)
                if k:
                    self.api_key = k.group(1)
                return self
            if self.proc.poll() is not None:
                pytest.fail(f"kiln serve exited with {self.proc.returncode}:\n{text}")
            time.sleep(0.05)
        pytest.fail(f"kiln serve did not start within {timeout}s:\n{open(self.log_path).read()}")

    def log(self) -> str:
        try:
            return open(self.log_path).read()
        except OSError:
            return ""

    def kill9(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill9()

    def opts(self) -> dict:
        """Connection options for e2b SDK calls against this server."""
        return {"api_key": self.api_key, "api_url": self.url, "sandbox_url": self.url}

    def request(self, method: str, path: str, body=None, headers=None, raw: bytes = None,
                api_key: object = "default"):
        """A raw HTTP request; returns (status, parsed JSON or text, headers)."""
        h = dict(headers or {})
        if api_key == "default":
            api_key = self.api_key
        if api_key is not None:
            h["X-API-Key"] = api_key
        data = raw
        if body is not None:
            data = json.dumps(body).encode()
            h["Content-Type"] = "application/json"
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=h)
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                status, payload, rh = r.status, r.read(), r.headers
        except urllib.error.HTTPError as e:
            status, payload, rh = e.code, e.read(), e.headers
        try:
            parsed = json.loads(payload) if payload else None
        except ValueError:
            parsed = payload.decode(errors="replace")
        return status, parsed, rh

    def kill_all_sandboxes(self):
        if not self.url or not self.proc or self.proc.poll() is not None:
            return
        try:
            status, lst, _ = self.request("GET", "/sandboxes")
            if status == 200:
                for s in lst:
                    self.request("DELETE", f"/sandboxes/{s['sandboxID']}")
        except Exception as e:
            print(f"cleanup: listing sandboxes: {e}")


@contextlib.contextmanager
def own_server(prefix: str, args=(), env=None, after=None):
    """A `kiln serve` of a test module's own, on a fresh state dir: started with `args` and
    KILN_SERVE_EXTRA_ARGS, with `env` in this process's environment while it runs (the server
    inherits it); afterwards its sandboxes are killed, it stops, its log's tail is printed,
    its state is removed, `after` runs (e.g. removing network slots), and a panic in its log
    fails the module."""
    base = tempfile.mkdtemp(prefix=prefix)
    env = env or {}
    s, log = None, ""
    os.environ.update(env)
    try:
        s = KilnServer(os.path.join(base, "state"),
                       list(args) + os.environ.get("KILN_SERVE_EXTRA_ARGS", "").split())
        s.start()
        yield s
    finally:
        for k in env:
            os.environ.pop(k, None)
        if s:
            s.kill_all_sandboxes()
            s.stop()
            log = s.log()
            print(f"---- kiln serve ({prefix}) log (tail) ----\n" + log[-6000:])
            cleanup_state(s.state_dir)
        if after:
            after()
        shutil.rmtree(base, ignore_errors=True)
        assert "panicked" not in log, log[-8000:]
