"""`kiln bench tti`'s client: ComputeSDK's time-to-interactive test through the e2b SDK.

TTI = wall clock from `Sandbox.create()` to the first `commands.run("echo benchmark")`
succeeding (teardown excluded), in three modes: sequential (each sandbox killed before the
next), staggered (launches every STAGGER_MS) and burst (all at once). Then the SDK's
`commands.run("true")` round trip, pause -> resume -> first command, fork -> child's first
command, a sandbox at work (a CPU task run over and over) alone and then while other creates
make the warm pool refill beside it (BUSY_S seconds each), and a set of idle sandboxes held
while the caller measures their memory (it writes "idle-ready N" on stdout and waits for a
line on stdin). Each mode also reports the host's busy
CPU seconds from its start to its last iteration (sequential: kills included) and this
client's own share of them. Prints one JSON object on the last
line of stdout; the e2b SDK reads E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY.
"""

import json
import os
import resource
import sys
import threading
import time

from e2b import Sandbox

N = int(os.environ["TTI_N"])
STAGGER_MS = float(os.environ.get("TTI_STAGGER_MS", "200"))
MODES = os.environ.get("TTI_MODES", "sequential,staggered,burst").split(",")
TEMPLATE = os.environ.get("TTI_TEMPLATE", "base")
RUNS = int(os.environ.get("TTI_RUNS", "40"))
ROUNDS = int(os.environ.get("TTI_ROUNDS", "5"))
IDLE = int(os.environ.get("TTI_IDLE", "10"))
BUSY_S = float(os.environ.get("TTI_BUSY_S", "15"))
# The sandbox at work's task: about 100 ms of CPU in Python.
BUSY_TASK = "python3 -c 'sum(range(2000000))'"
# Creates beside it: one (create, first echo, kill) every this many seconds.
CHURN_EVERY_S = 0.5
TIMEOUT_S = 120


def ms(t0):
    return (time.perf_counter() - t0) * 1000.0


def host_busy_s():
    """The host's busy CPU seconds so far (/proc/stat: every state but idle and iowait)."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_cpu_s():
    """This client's CPU seconds so far (all its threads)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def cpu_spent(busy0, own0):
    """The host's busy seconds and this client's since readings `busy0` and `own0`."""
    return {"hostBusyS": round(host_busy_s() - busy0, 3), "clientS": round(own_cpu_s() - own0, 3)}


def one_tti(out, i, kill_after=True):
    """One iteration: create -> first echo; records {"ttiMs"} or {"ttiMs": 0, "error"}."""
    t0 = time.perf_counter()
    sbx = None
    try:
        sbx = Sandbox.create(TEMPLATE, timeout=TIMEOUT_S)
        r = sbx.commands.run('echo "benchmark"')
        if r.stdout.strip() != "benchmark":
            raise RuntimeError(f"echo printed {r.stdout!r}")
        out[i] = {"ttiMs": round(ms(t0), 2), "_done": time.perf_counter()}
    except Exception as e:  # a failure counts, as in ComputeSDK
        out[i] = {"ttiMs": 0, "error": f"{type(e).__name__}: {e}"[:300]}
    if kill_after and sbx is not None:
        try:
            sbx.kill()
        except Exception:
            pass
    return sbx


def mode_run(mode):
    out = [None] * N
    busy0, own0 = host_busy_s(), own_cpu_s()
    start = time.perf_counter()
    if mode == "sequential":
        for i in range(N):
            one_tti(out, i)
        cpu = cpu_spent(busy0, own0)
    else:
        held = [None] * N

        def go(i):
            held[i] = one_tti(out, i, kill_after=False)

        threads = []
        for i in range(N):
            t = threading.Thread(target=go, args=(i,))
            threads.append(t)
            t.start()
            if mode == "staggered":
                time.sleep(STAGGER_MS / 1000.0)
        for t in threads:
            t.join()
        cpu = cpu_spent(busy0, own0)
        for s in held:
            if s is not None:
                try:
                    s.kill()
                except Exception:
                    pass
    done = [o["_done"] for o in out if "_done" in o]
    wall = (max(done) - start) * 1000.0 if done else 0.0
    first = (min(done) - start) * 1000.0 if done else 0.0
    for o in out:
        o.pop("_done", None)
    return {"mode": mode, "iterations": out, "wallClockMs": round(wall, 2),
            "timeToFirstReadyMs": round(first, 2), "cpu": cpu}


def samples_run_true(sbx):
    sbx.commands.run("true")  # warm-up
    v = []
    for _ in range(RUNS):
        t0 = time.perf_counter()
        sbx.commands.run("true")
        v.append(ms(t0))
    return v


def samples_resume(sbx):
    v = []
    for _ in range(ROUNDS):
        sbx.pause()
        t0 = time.perf_counter()
        again = Sandbox.connect(sbx.sandbox_id, timeout=TIMEOUT_S)
        again.commands.run("true")
        v.append(ms(t0))
    return v


def samples_fork(sbx):
    v = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        children = sbx.fork(count=1, timeout=TIMEOUT_S)
        child = children[0]
        if isinstance(child, Exception):
            raise child
        child.commands.run("true")
        v.append(ms(t0))
        child.kill()
    return v


def samples_busy(sbx):
    """The task's round trips for BUSY_S alone, then for BUSY_S while creates beside it (each
    claiming a pooled sandbox the pool boots again) run; and how many of those ran."""
    def loop(until):
        v = []
        while time.time() < until:
            t0 = time.perf_counter()
            sbx.commands.run(BUSY_TASK)
            v.append(ms(t0))
        return v

    sbx.commands.run(BUSY_TASK)  # warm-up
    alone = loop(time.time() + BUSY_S)
    until = time.time() + BUSY_S
    creates = {}

    def churn():
        while time.time() < until:
            one_tti(creates, len(creates))
            time.sleep(CHURN_EVERY_S)

    t = threading.Thread(target=churn)
    t.start()
    refill = loop(until)
    t.join()
    done = [c for c in creates.values() if not c.get("error")]
    return {"aloneMs": alone, "refillMs": refill, "creates": len(done)}


def main():
    # The single-sandbox samples first, on a server whose pool is still at its floor: after a
    # burst the adaptive pool refills towards the burst's size and keeps every core busy.
    result = {}
    sbx = Sandbox.create(TEMPLATE, timeout=600)
    try:
        result["runTrueMs"] = samples_run_true(sbx)
        result["resumeMs"] = samples_resume(sbx)
        result["forkMs"] = samples_fork(sbx)
        if BUSY_S > 0:
            result["busy"] = samples_busy(sbx)
    finally:
        sbx.kill()
    result["modes"] = [mode_run(m) for m in MODES if m]
    if IDLE > 0:
        idle = [Sandbox.create(TEMPLATE, timeout=600) for _ in range(IDLE)]
        for s in idle:
            s.commands.run("true")
        print(f"idle-ready {IDLE}", flush=True)
        sys.stdin.readline()
        for s in idle:
            s.kill()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
