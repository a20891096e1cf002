//! kiln-agent as PID 1 (in a new PID namespace via `unshare`): reaps orphaned zombies and shuts
//! down cleanly on SIGTERM.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::agent_bin;
use kiln_envd::{EnvdClient, RunOptions};

#[tokio::test]
async fn pid1_reaps_orphans_and_stops_on_sigterm() {
    if !kiln_testkit::needs()
        .root("PID namespaces")
        .tool("unshare")
        .ok()
    {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("a.sock");
    let mut unshare = Command::new("unshare")
        .args(["--pid", "--fork", "--mount-proc", "--kill-child"])
        .arg(agent_bin())
        .args(["--no-tcp", "--listen-unix"])
        .arg(&sock)
        .env("KILN_AGENT_LOG", "warn")
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    struct Kill<'a>(&'a mut std::process::Child);
    impl Drop for Kill<'_> {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let guard = Kill(&mut unshare);
    let c = EnvdClient::unix(&sock);
    c.wait_ready(Duration::from_secs(10)).await.unwrap();
    let opts = || RunOptions {
        timeout: Some(Duration::from_secs(20)),
        ..Default::default()
    };
    let out = c.run("echo $$; cat /proc/1/comm", opts()).await.unwrap();
    let s = String::from_utf8(out.stdout).unwrap();
    assert!(
        s.contains("kiln-agent"),
        "agent is not PID 1 in the namespace: {s}"
    );
    // leave orphans behind: they are re-parented to the agent and must be reaped
    c.run("for i in 1 2 3 4 5; do (sleep 0.1 &) ; done; true", opts())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(600)).await;
    let z = c
        .run(
            "grep -l '^[0-9]* ([^)]*) Z' /proc/[0-9]*/stat 2>/dev/null | wc -l",
            opts(),
        )
        .await
        .unwrap();
    assert_eq!(
        String::from_utf8(z.stdout).unwrap().trim(),
        "0",
        "zombies were left unreaped"
    );
    // SIGTERM to the agent (the child of unshare) stops it cleanly
    let children = std::fs::read_to_string(format!(
        "/proc/{}/task/{}/children",
        guard.0.id(),
        guard.0.id()
    ))
    .unwrap();
    let agent_pid: i32 = children.split_whitespace().next().unwrap().parse().unwrap();
    // SAFETY: signalling the agent process we started.
    unsafe { libc::kill(agent_pid, libc::SIGTERM) };
    let start = Instant::now();
    loop {
        if let Some(st) = guard.0.try_wait().unwrap() {
            assert!(st.success(), "agent as PID 1 exited with {st:?}");
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "agent as PID 1 did not stop on SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
