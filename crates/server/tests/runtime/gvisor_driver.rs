//! The gVisor driver against real runsc: kiln-agent as init over an overlay of a template
//! rootfs, reachable through a host Unix socket with the sandbox network off, limits applied,
//! and nothing left behind after stop.

use crate::common;

use std::collections::BTreeMap;
use std::time::Duration;

use kiln_envd::RunOptions;
use kiln_server::driver::{self, DriverError, SandboxSpec};

/// [`common::driver_spec`] with an environment variable from the "template".
fn spec(id: &str, rootfs: &std::path::Path) -> SandboxSpec {
    SandboxSpec {
        env: BTreeMap::from([("KILN_TEST_ENV".into(), "from-template".into())]),
        ..common::driver_spec(id, rootfs)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gvisor_sandbox_runs_agent_and_tears_down_completely() {
    if !common::sandboxes_run() {
        return;
    }
    let g = common::Ground::new();
    let (state, tpl, driver) = (&g.state, &g.tpl, g.driver.clone());
    let id = format!("drvtest{}", std::process::id());
    g.cleanup.add(&id);

    driver.create(&spec(&id, tpl.path())).await.expect("create");
    driver.start(&id).await.expect("start");
    assert!(driver.is_running(&id).await.unwrap());
    let agent = driver::agent_client(&driver, &id);
    if let Err(e) = agent.wait_ready(Duration::from_secs(30)).await {
        let console = driver.console_log(&id, 4000).await.unwrap_or_default();
        panic!("agent not ready: {e}\nconsole:\n{console}");
    }
    // Any other port needs the sandbox network, which is off: a clear error naming the port,
    // and no host path in it.
    match driver.connect(&id, 8080).await {
        Err(e @ DriverError::Unreachable { port: 8080, .. }) => {
            let text = e.to_string();
            assert!(!text.contains(&*state.path().to_string_lossy()), "{text}");
        }
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("port 8080 must not be reachable with the network off"),
    }

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
    if !common::sandboxes_run() {
        return;
    }
    let empty = tempfile::tempdir().unwrap(); // no agent inside: refused before anything starts
    let state = common::state_dir();
    let driver = common::driver(state.path());
    let err = driver
        .create(&spec("drvfail", empty.path()))
        .await
        .expect_err("a rootfs without the agent is refused");
    assert!(err.to_string().contains("kiln-agent"), "{err}");
    assert!(common::mounts_under(state.path()).is_empty());
    assert!(!state.path().join("gvisor/sandboxes/drvfail").exists());
    // Ids that would build paths outside the driver's directory are refused as such.
    let err = driver
        .create(&spec("../escape", empty.path()))
        .await
        .expect_err("traversal id");
    assert!(matches!(err, DriverError::InvalidId(_)), "{err}");
}
