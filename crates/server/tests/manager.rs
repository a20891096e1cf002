//! Sandbox lifecycle with real gVisor sandboxes: timeout expiry, and recovery after the server
//! goes away without cleaning up (adopting live sandboxes, cleaning dead ones).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use kiln_server::driver::gvisor::{GvisorConfig, GvisorDriver};
use kiln_server::driver::Driver;
use kiln_server::manager::CreateParams;
use kiln_server::store::{SandboxState, Store};
use kiln_server::templates::{from_dir, FixedTemplates};
use kiln_server::{LifecycleConfig, Manager};

struct Cleanup {
    driver: Arc<GvisorDriver>,
    ids: std::sync::Mutex<Vec<String>>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for id in self.ids.lock().unwrap().iter() {
            let _ = self.driver.stop_blocking(id);
        }
    }
}

fn manager(
    state: &std::path::Path,
    tpl: &std::path::Path,
    driver: Arc<GvisorDriver>,
) -> Arc<Manager> {
    let store = Arc::new(Store::open(&state.join("kiln.db")).unwrap());
    let cfg = LifecycleConfig {
        reap_interval: Duration::from_millis(50),
        default_memory_mb: 256,
        ..LifecycleConfig::default()
    };
    Manager::new(
        cfg,
        store,
        driver,
        Arc::new(FixedTemplates(vec![from_dir("t", tpl)])),
    )
}

fn params(timeout: i64) -> CreateParams {
    CreateParams {
        template_id: "t".into(),
        timeout_secs: Some(timeout),
        secure: true,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeout_expiry_and_restart_recovery() {
    common::require_runsc_root();
    let tpl = tempfile::tempdir().unwrap();
    common::build_rootfs(tpl.path());
    let state = tempfile::tempdir().unwrap();
    let driver = Arc::new(GvisorDriver::new(GvisorConfig::new(state.path())).unwrap());
    let cleanup = Cleanup {
        driver: driver.clone(),
        ids: Default::default(),
    };

    // Expiry: a 1 s sandbox is killed by the reaper and marked so.
    let m1 = manager(state.path(), tpl.path(), driver.clone());
    let reaper = m1.spawn_reaper();
    let short = m1.create(params(1)).await.expect("create");
    cleanup.ids.lock().unwrap().push(short.id.clone());
    assert!(m1.route(&short.id).is_some());
    let t = Instant::now();
    while m1.get_live(&short.id).is_ok() && t.elapsed() < Duration::from_secs(15) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        m1.get_live(&short.id).is_err(),
        "not killed after its timeout"
    );
    let t = Instant::now();
    loop {
        let rec = m1.store().get_sandbox(&short.id).unwrap().unwrap();
        if rec.state == SandboxState::Killed {
            assert_eq!(rec.end_reason.as_deref(), Some("timeout expired"));
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(15), "never marked killed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!driver.is_running(&short.id).await.unwrap());
    reaper.abort();

    // Two long-lived sandboxes; the "server" then disappears without cleaning up.
    let keep = m1.create(params(600)).await.expect("create keep");
    let lost = m1.create(params(600)).await.expect("create lost");
    cleanup
        .ids
        .lock()
        .unwrap()
        .extend([keep.id.clone(), lost.id.clone()]);
    drop(m1);
    // One dies while no server runs.
    driver.stop_blocking(&lost.id).unwrap();

    let m2 = manager(state.path(), tpl.path(), driver.clone());
    let report = m2.recover().await.expect("recover");
    assert_eq!(report.adopted, vec![keep.id.clone()]);
    assert_eq!(report.cleaned, vec![lost.id.clone()]);
    let route = m2.route(&keep.id).expect("adopted sandbox is routable");
    assert!(kiln_server::agent_http::healthy(&route.socket).await);
    assert_eq!(route.envd_token, keep.envd_token);
    assert_eq!(m2.get_live(&keep.id).unwrap().end_at_ms, keep.end_at_ms);
    let lost_rec = m2.store().get_sandbox(&lost.id).unwrap().unwrap();
    assert_eq!(lost_rec.state, SandboxState::Killed);
    assert!(m2.get_live(&lost.id).is_err());

    assert!(m2.kill(&keep.id, "test done").await.unwrap());
    assert!(!m2.kill(&keep.id, "again").await.unwrap());
    assert!(common::mounts_under(state.path()).is_empty());
    assert!(driver.list_on_host().await.unwrap().is_empty());
    assert!(common::processes_mentioning(&keep.id).is_empty());
}
