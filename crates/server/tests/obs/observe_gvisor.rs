//! Metrics history and lifecycle events with real gVisor sandboxes: the sampler fills a
//! sandbox's history, windows select from it; a sandbox that stops on its own is noticed
//! and recorded as `died`; an expired one as `timed-out`; a killed one as `killed`.

use crate::common;

use common::params;

use std::time::{Duration, Instant};

use kiln_server::store::SandboxState;
use kiln_server::LifecycleConfig;

async fn wait(what: &str, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_windows_and_died_timed_out_killed_events() {
    if !common::sandboxes_run() {
        return;
    }
    let rig = common::Rig::new(LifecycleConfig {
        reap_interval: Duration::from_millis(50),
        metrics_interval: Duration::from_millis(200),
        default_memory_mb: 256,
        ..LifecycleConfig::default()
    });
    let driver = rig.driver.clone();
    let store = rig.store();
    let m = rig.manager.clone();
    let _sampler = m.spawn_sampler();
    let _reaper = m.spawn_reaper();

    let a = m.create(params(600)).await.expect("create a");
    rig.cleanup.add(&a.id);
    let b = m.create(params(600)).await.expect("create b");
    rig.cleanup.add(&b.id);

    // History: samples accumulate; a window holds exactly the samples inside it.
    tokio::time::sleep(Duration::from_millis(2000)).await;
    let all = m.metrics_window(&a.id, None, Some(i64::MAX)).await.unwrap();
    assert!(all.len() >= 4, "only {} samples", all.len());
    assert!(all
        .windows(2)
        .all(|w| w[0].timestamp_ms < w[1].timestamp_ms));
    assert!(all
        .iter()
        .all(|s| s.mem_used > 0 && s.mem_total > 0 && s.cpu_count > 0));
    let (lo, hi) = (all[1].timestamp_ms, all[all.len() - 2].timestamp_ms);
    let win = m.metrics_window(&a.id, Some(lo), Some(hi)).await.unwrap();
    let want: Vec<i64> = all
        .iter()
        .map(|s| s.timestamp_ms)
        .filter(|t| (lo..=hi).contains(t))
        .collect();
    assert_eq!(win.iter().map(|s| s.timestamp_ms).collect::<Vec<_>>(), want);
    let latest = m.latest_metrics(&[a.id.clone(), "nosuch".into()]).await;
    assert_eq!(latest.keys().collect::<Vec<_>>(), vec![&a.id]);

    // b stops behind the server's back: the sampler notices and records `died`.
    driver.stop(&b.id).await.unwrap();
    wait("b to be noticed dead", || m.get(&b.id).is_err()).await;
    let t = Instant::now();
    // The registry lets go first; the store follows once the leftovers are cleaned up.
    while store.get_sandbox(&b.id).await.unwrap().unwrap().state != SandboxState::Killed {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "b never marked ended"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // a times out.
    m.set_timeout(&a.id, 1).await.unwrap();
    wait("a to time out", || m.get(&a.id).is_err()).await;
    let t = Instant::now();
    while store.get_sandbox(&a.id).await.unwrap().unwrap().state != SandboxState::Killed {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "a never marked ended"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // c is killed by request.
    let c = m.create(params(600)).await.expect("create c");
    rig.cleanup.add(&c.id);
    assert!(m.kill(&c.id, "killed by request").await.unwrap());

    let kinds = |id: String| {
        let store = store.clone();
        async move {
            common::event_kinds(store.as_ref(), &id, kiln_server::store::LIFECYCLE_KINDS).await
        }
    };
    assert_eq!(kinds(b.id.clone()).await, ["created", "died"]);
    assert_eq!(kinds(a.id.clone()).await, ["created", "timed-out"]);
    assert_eq!(kinds(c.id.clone()).await, ["created", "killed"]);
    assert!(common::mounts_under(rig.path()).is_empty());
}
