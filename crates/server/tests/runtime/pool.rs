//! The adaptive warm pool with real gVisor sandboxes: a never-used template has no pool; a
//! burst of creates grows it, claims are refilled, idleness shrinks it to one sandbox, an
//! orderly shutdown stops it; `pool.off` means no pool at all; a create that finds no pooled
//! sandbox and no boot slot within the create queue's time is refused with 503's error and a
//! retry hint, not left hanging.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use kiln_server::manager::PoolPolicy;
use kiln_server::{Error, LifecycleConfig, Manager};

use common::sh;

/// Waits until `template`'s pool holds exactly `n` sandboxes.
async fn wait_pool(m: &Manager, n: usize, why: &str) {
    let t = Instant::now();
    while m.pool_ready("t") != n {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "{why}: the pool holds {} sandboxes, not {n}",
            m.pool_ready("t")
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn config(pool: PoolPolicy) -> LifecycleConfig {
    LifecycleConfig {
        default_memory_mb: 256,
        pool,
        ..LifecycleConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pool_grows_with_a_burst_refills_claims_and_shrinks_when_idle() {
    if !common::sandboxes_run() {
        return;
    }
    // Long enough for three boots on a loaded 2-core host, short enough for the suite.
    let idle = Duration::from_secs(10);
    let rig = common::Rig::new(config(PoolPolicy {
        idle,
        max_per_template: 3,
        ..PoolPolicy::default()
    }));
    let (m, driver) = (rig.manager.clone(), rig.driver.clone());
    let tender = m.spawn_pools().expect("pools are on by default");
    // A template never used keeps no pool.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(m.pool_ready("t"), 0);
    assert!(driver.list_on_host().await.unwrap().is_empty());

    // A burst of three creates: the pool grows to three.
    let burst_at = Instant::now();
    let burst: Vec<_> = (0..3)
        .map(|_| {
            let m = m.clone();
            tokio::spawn(async move { m.create(common::params(600)).await })
        })
        .collect();
    for b in burst {
        let r = b.await.unwrap().expect("a create of the burst");
        rig.cleanup.add(&r.id);
        assert!(m.kill(&r.id, "burst done").await.unwrap());
    }
    wait_pool(&m, 3, "after a burst of three").await;
    for h in driver.list_on_host().await.unwrap() {
        rig.cleanup.add(&h.id);
    }

    // A claim takes a pooled sandbox and is refilled.
    let sbx = m.create(common::params(600)).await.expect("pooled create");
    rig.cleanup.add(&sbx.id);
    let logs = m.logs(&sbx.id, "default").await.unwrap();
    assert!(
        logs.events.iter().any(|e| e.detail.contains("warm pool")),
        "not taken from the pool: {:?}",
        logs.events
    );
    assert_eq!(sh(&m, &sbx.id, "echo pooled").await, "pooled");
    wait_pool(&m, 3, "refilled after a claim").await;
    for h in driver.list_on_host().await.unwrap() {
        rig.cleanup.add(&h.id);
    }
    assert!(m.kill(&sbx.id, "test done").await.unwrap());

    // No burst for longer than the idle period: one sandbox stays (the template was used).
    wait_pool(&m, 1, "after the idle period").await;
    assert!(
        burst_at.elapsed() >= idle,
        "shrunk {:?} after the burst, before the idle period was over",
        burst_at.elapsed()
    );
    // The surplus stops right after it leaves the pool.
    let t = Instant::now();
    while driver.list_on_host().await.unwrap().len() != 1 {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the surplus never stopped"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(idle / 2).await;
    assert_eq!(m.pool_ready("t"), 1, "the floor of a used template is one");

    // Shutdown: the pooled sandbox stops with the server.
    tender.abort();
    m.drain_pools().await;
    assert_eq!(m.pool_ready("t"), 0);
    assert!(driver.list_on_host().await.unwrap().is_empty());
    assert!(common::mounts_under(rig.path()).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_off_means_no_pool_and_a_full_queue_is_refused_with_a_retry_hint() {
    if !common::sandboxes_run() {
        return;
    }
    let rig = common::Rig::new(config(PoolPolicy {
        off: true,
        queue: Duration::from_millis(1),
        ..PoolPolicy::default()
    }));
    let (m, driver) = (rig.manager.clone(), rig.driver.clone());
    assert!(m.spawn_pools().is_none(), "--pool-off starts no pool");
    // More creates at once than there are boot slots, with (almost) no time to queue: those
    // that get no slot at once are refused, naming the queue and when to retry.
    let slots = std::thread::available_parallelism().map_or(2, |n| n.get().max(2));
    let creates: Vec<_> = (0..slots + 2)
        .map(|_| {
            let m: Arc<Manager> = m.clone();
            tokio::spawn(async move { m.create(common::params(600)).await })
        })
        .collect();
    let (mut made, mut refused) = (Vec::new(), 0);
    for c in creates {
        match c.await.unwrap() {
            Ok(r) => {
                rig.cleanup.add(&r.id);
                made.push(r.id);
            }
            Err(Error::Capacity {
                limit,
                retry_after_secs,
                quota,
            }) => {
                assert!(limit.contains("create queue"), "{limit}");
                assert!(retry_after_secs > 0 && !quota);
                refused += 1;
            }
            Err(e) => panic!("unexpected error: {e}"),
        }
    }
    assert!(refused >= 2, "{refused} refused, {} created", made.len());
    assert!(!made.is_empty());
    for id in &made {
        assert_eq!(sh(&m, id, "echo cold").await, "cold");
        assert!(m.kill(id, "test done").await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(m.pool_ready("t"), 0);
    assert!(driver.list_on_host().await.unwrap().is_empty());
}
