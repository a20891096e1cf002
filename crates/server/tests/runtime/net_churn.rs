//! Sandbox networking under churn, with real gVisor sandboxes, namespaces and nftables (needs
//! root): many concurrent creates and kills — each kill racing a second stop of the same
//! sandbox, as a failed create's cleanup does — never take the network slot of another
//! sandbox away (the race once seen as "opening /run/netns/…: No such file" on create and
//! "entity not found" on a port connect), and leave no namespace, veth or nftables table
//! behind.
//!
//! KILN_NET_CHURN sets the rounds per worker (default 6; 4 workers).

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use kiln_gvisor::net_config::prefix_for_state;
use kiln_gvisor::{GvisorConfig, GvisorDriver};
use kiln_server::driver::{Driver, DriverError};
use kiln_server::manager::CreateParams;
use kiln_server::templates::{from_dir, FixedTemplates};
use kiln_server::{LifecycleConfig, Manager};

const WORKERS: usize = 4;

fn params() -> CreateParams {
    CreateParams {
        template_id: "t".into(),
        timeout_secs: Some(600),
        secure: false,
        ..Default::default()
    }
}

/// The sandbox's slot is alive: a connect to a closed port inside is refused by the sandbox
/// (any other failure means its namespaces are gone).
async fn assert_slot_alive(driver: &dyn Driver, id: &str, when: &str) {
    match driver.connect(id, 1).await {
        Err(DriverError::Unreachable { reason, .. }) if reason.contains("nothing is listening") => {
        }
        Err(e) => panic!("{when}: sandbox {id} lost its network slot: {e}"),
        Ok(_) => panic!("{when}: port 1 of sandbox {id} accepted a connection"),
    }
}

fn leftovers(prefix: &str) -> Vec<String> {
    let mut out: Vec<String> = std::fs::read_dir("/run/netns")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&format!("{prefix}-")))
        .collect();
    out.extend(
        std::fs::read_dir("/sys/class/net")
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(&format!("{prefix}h"))),
    );
    out
}

fn host_table_exists(prefix: &str) -> bool {
    std::process::Command::new("nft")
        .args(["list", "table", "ip", &format!("kiln_{prefix}")])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_create_kill_never_takes_a_live_sandbox_slot() {
    if !common::sandboxes_run() {
        return;
    }
    let rounds: usize = std::env::var("KILN_NET_CHURN")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6);
    let tpl = tempfile::tempdir().unwrap();
    common::build_rootfs(tpl.path());
    let state = common::state_dir();
    let prefix = prefix_for_state(state.path());
    // A free range of this host (other test servers may be running).
    let range = kiln_net::range::pick_range(&prefix, None).await.unwrap();
    let mut settings = common::driver_config().gvisor;
    settings.network = Some(kiln_net::NetConfig {
        range,
        pool_size: 2,
        prefix: prefix.clone(),
        operator_allow: Vec::new(),
        dns_upstreams: Vec::new(),
        max_connections: 0,
        egress_mib_per_sec: 0,
        proxy_all_tcp: false,
    });
    let gvisor =
        Arc::new(GvisorDriver::new(GvisorConfig::from_settings(&settings, state.path())).unwrap());
    let driver: Arc<dyn Driver> = gvisor.clone();
    let cleanup = common::Cleanup::new(driver.clone());
    let cfg = LifecycleConfig {
        default_memory_mb: 256,
        ..LifecycleConfig::default()
    };
    let m: Arc<Manager> = common::manager(
        state.path(),
        driver.clone(),
        Arc::new(FixedTemplates(vec![from_dir("t", tpl.path())])),
        cfg,
    );

    // A sandbox that lives through the whole churn.
    let keeper = m.create(params()).await.expect("create the keeper").id;
    cleanup.add(&keeper);
    assert_slot_alive(driver.as_ref(), &keeper, "at start").await;

    let t = std::time::Instant::now();
    let mut workers = Vec::new();
    for w in 0..WORKERS {
        let (m, driver, keeper) = (m.clone(), driver.clone(), keeper.clone());
        workers.push(tokio::spawn(async move {
            for r in 0..rounds {
                let id = m
                    .create(params())
                    .await
                    .unwrap_or_else(|e| panic!("worker {w} round {r}: create: {e}"))
                    .id;
                assert_slot_alive(driver.as_ref(), &id, "after create").await;
                // The kill races a second stop of the same sandbox.
                let (killed, stopped) = tokio::join!(m.kill(&id, "churn"), driver.stop(&id));
                killed.expect("kill");
                let _ = stopped;
                assert_slot_alive(driver.as_ref(), &keeper, "during churn").await;
            }
        }));
    }
    for w in workers {
        w.await.expect("a worker panicked");
    }
    eprintln!(
        "{} creates and kills by {WORKERS} workers in {:?}",
        WORKERS * rounds,
        t.elapsed()
    );
    // Creates still work, and every slot handed out is whole.
    for _ in 0..3 {
        let id = m.create(params()).await.expect("create after churn").id;
        assert_slot_alive(driver.as_ref(), &id, "after churn").await;
        m.kill(&id, "done").await.unwrap();
    }
    assert_slot_alive(driver.as_ref(), &keeper, "at the end").await;
    m.kill(&keeper, "done").await.unwrap();

    // Nothing left once the ready slots go too.
    gvisor.shutdown_network().await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !leftovers(&prefix).is_empty() || host_table_exists(&prefix) {
        assert!(
            std::time::Instant::now() < deadline,
            "left behind: {:?}, host table {}",
            leftovers(&prefix),
            host_table_exists(&prefix)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
