//! The gVisor driver against real runsc: kiln-agent as init over an overlay of a template
//! rootfs, reachable through a host Unix socket with the sandbox network off, limits applied,
//! and nothing left behind after stop.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use kiln_agent::client::{AgentClient, RunOptions};
use kiln_server::driver::gvisor::{GvisorConfig, GvisorDriver};
use kiln_server::driver::{AgentEndpoint, Driver, SandboxSpec};

struct Guard<'a> {
    driver: &'a GvisorDriver,
    ids: Vec<String>,
}

impl Drop for Guard<'_> {
    fn drop(&mut self) {
        for id in &self.ids {
            let _ = self.driver.stop_blocking(id);
        }
    }
}

fn spec(id: &str, rootfs: &std::path::Path) -> SandboxSpec {
    SandboxSpec {
        id: id.into(),
        template_name: "test".into(),
        rootfs: rootfs.to_path_buf(),
        env: BTreeMap::from([("KILN_TEST_ENV".into(), "from-template".into())]),
        cpu_count: 1,
        memory_mb: 256,
        pids_limit: 512,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gvisor_sandbox_runs_agent_and_tears_down_completely() {
    common::require_runsc_root();
    let tpl = tempfile::tempdir().unwrap();
    common::build_rootfs(tpl.path());
    let state = tempfile::tempdir().unwrap();
    let driver = GvisorDriver::new(GvisorConfig::new(state.path())).unwrap();
    let id = format!("drvtest{}", std::process::id());
    let mut guard = Guard {
        driver: &driver,
        ids: vec![id.clone()],
    };

    driver.create(&spec(&id, tpl.path())).await.expect("create");
    driver.start(&id).await.expect("start");
    assert!(driver.is_running(&id).await.unwrap());
    let AgentEndpoint::Unix(sock) = driver.agent_endpoint(&id);
    let agent = AgentClient::unix(&sock);
    agent
        .wait_ready(Duration::from_secs(30))
        .await
        .unwrap_or_else(|e| {
            panic!(
                "agent not ready: {e}\nconsole:\n{}",
                kiln_server::driver::gvisor::tail(
                    &state
                        .path()
                        .join(format!("gvisor/sandboxes/{id}/console.log")),
                    4000
                )
            )
        });

    // Commands run inside, see the template env, and writes land in the per-sandbox layer only.
    let out = agent
        .run(
            "echo hello; cat /proc/1/environ; echo; echo data > /root/written; cat /proc/net/dev",
            RunOptions {
                user: Some("root".into()),
                ..Default::default()
            },
        )
        .await
        .expect("run");
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(
        out.exit_code,
        0,
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines[0], "hello");
    assert!(
        lines[1].contains("KILN_TEST_ENV=from-template"),
        "init env: {}",
        lines[1]
    );
    // --network=none: loopback only.
    let ifaces: Vec<&str> = lines[2..]
        .iter()
        .filter_map(|l| l.split_once(':').map(|(n, _)| n.trim()))
        .filter(|n| !n.contains('|'))
        .collect();
    assert_eq!(ifaces, ["lo"], "network interfaces: {stdout}");
    let upper = state
        .path()
        .join(format!("gvisor/sandboxes/{id}/upper/root/written"));
    assert_eq!(std::fs::read_to_string(&upper).unwrap(), "data\n");
    assert!(
        !tpl.path().join("root/written").exists(),
        "template must stay untouched"
    );

    // Memory limit applied to the sandbox's cgroup (v1 memory controller or v2 unified).
    let stats = driver.stats(&id).await.expect("stats");
    assert_eq!(stats.mem_limit_bytes, 256 << 20, "stats: {stats:?}");
    assert!(stats.mem_used_bytes > 0);
    let listed = driver.list_on_host().await.unwrap();
    assert!(listed.iter().any(|h| h.id == id && h.running));

    // Stop: no runsc container, no mount, no files, no cgroup, no process.
    driver.stop(&id).await.expect("stop");
    guard.ids.clear();
    assert!(!driver.is_running(&id).await.unwrap());
    assert!(driver.list_on_host().await.unwrap().is_empty());
    assert!(common::mounts_under(state.path()).is_empty());
    assert!(!state.path().join(format!("gvisor/sandboxes/{id}")).exists());
    for ctl in ["memory", "pids", "cpu", ""] {
        let p = std::path::Path::new("/sys/fs/cgroup")
            .join(ctl)
            .join("kiln")
            .join(&id);
        assert!(!p.exists(), "cgroup {} left behind", p.display());
    }
    assert!(common::processes_mentioning(&id).is_empty());
    // Stopping again is a no-op.
    driver.stop(&id).await.expect("second stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_failure_leaves_nothing_behind() {
    common::require_runsc_root();
    let empty = tempfile::tempdir().unwrap(); // no agent inside: refused before anything starts
    let state = tempfile::tempdir().unwrap();
    let driver = GvisorDriver::new(GvisorConfig::new(state.path())).unwrap();
    let err = driver
        .create(&spec("drvfail", empty.path()))
        .await
        .expect_err("a rootfs without the agent is refused");
    assert!(err.to_string().contains("kiln-agent"), "{err}");
    assert!(common::mounts_under(state.path()).is_empty());
    assert!(!state.path().join("gvisor/sandboxes/drvfail").exists());
}
