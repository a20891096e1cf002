//! Metrics with real gVisor sandboxes and a real SQLite state database: `memCache` is the
//! sandbox's page cache (it rises when big files are written to its disk and its tmpfs, and
//! falls when they are deleted), and the metrics history of live
//! and paused sandboxes survives a server restart (bounded per sandbox, deleted with the
//! sandbox).

use crate::common;

use std::time::Duration;

use kiln_server::manager::{CreateParams, Manager, MetricSample};
use kiln_server::{LifecycleConfig, Server, ServerConfig};

fn params() -> CreateParams {
    common::params(600)
}

/// A fresh sample of running sandbox `id` (a window without an end samples first when the
/// newest sample is older than the interval).
async fn sample_now(m: &Manager, id: &str) -> MetricSample {
    tokio::time::sleep(Duration::from_millis(120)).await;
    let w = m.metrics_window(id, None, None).await.expect("metrics");
    w.last().cloned().expect("a sample")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mem_cache_rises_when_a_big_file_is_written() {
    if !common::sandboxes_run() {
        return;
    }
    let rig = common::Rig::new(LifecycleConfig {
        metrics_interval: Duration::from_millis(100),
        default_memory_mb: 512,
        ..LifecycleConfig::default()
    });
    let (cleanup, m) = (&rig.cleanup, &rig.manager);
    let a = m.create(params()).await.expect("create");
    cleanup.add(&a.id);
    let before = sample_now(m, &a.id).await;
    let out = m
        .agent(&a.id, a.envd_token.clone())
        .run(
            "head -c 134217728 /dev/zero > /home/user/big && head -c 67108864 /dev/zero > /tmp/big && cat /proc/meminfo",
            Default::default(),
        )
        .await
        .expect("write a big file");
    assert_eq!(out.exit_code, 0, "{}", String::from_utf8_lossy(&out.stderr));
    let after = sample_now(m, &a.id).await;
    eprintln!(
        "memCache before {} MiB, after {} MiB; meminfo:\n{}",
        before.mem_cache >> 20,
        after.mem_cache >> 20,
        String::from_utf8_lossy(&out.stdout)
    );
    // 128 MiB on disk (the host's cache of the sandbox's files) and 64 MiB in tmpfs (the
    // guest's own cache): either alone stays below 160 MiB.
    assert!(
        after.mem_cache >= before.mem_cache + (160 << 20),
        "memCache did not rise by the files' 192 MiB: {} -> {}",
        before.mem_cache,
        after.mem_cache
    );
    assert!(after.mem_cache <= after.mem_total);
    // Deleting the file gives the cache back.
    let out = m
        .agent(&a.id, a.envd_token.clone())
        .run("rm /home/user/big /tmp/big", Default::default())
        .await
        .expect("rm");
    assert_eq!(out.exit_code, 0);
    let freed = sample_now(m, &a.id).await;
    assert!(
        freed.mem_cache + (160 << 20) <= after.mem_cache,
        "memCache stayed at {} after the file was deleted",
        freed.mem_cache
    );
    m.kill(&a.id, "test").await.unwrap();
}

fn server_config(state: &std::path::Path, cap: usize) -> ServerConfig {
    ServerConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        domain: "kiln.test".into(),
        state_dir: state.to_path_buf(),
        lifecycle: LifecycleConfig {
            default_memory_mb: 256,
            metrics_interval: Duration::from_millis(100),
            metrics_capacity: cap,
            ..LifecycleConfig::default()
        },
        metrics_token: None,
        edge: Default::default(),
        audit: Default::default(),
        identity_issuer: None,
        host_ca_dir: None,
        template_builds: Default::default(),
    }
}

fn stored_rows(state: &std::path::Path, id: &str) -> i64 {
    let c = rusqlite::Connection::open(state.join("kiln.db")).unwrap();
    c.query_row(
        "SELECT COUNT(*) FROM metric_samples WHERE sandbox_id = ?1",
        [id],
        |r| r.get(0),
    )
    .unwrap()
}

/// Equal, or equal but for the newest sample (shown while it was the newest even though the
/// ring's stride did not keep it).
fn same_history(before: &[MetricSample], after: &[MetricSample]) -> bool {
    after == before || (after.len() + 1 == before.len() && after == &before[..after.len()])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_survives_a_restart_bounded_and_goes_with_the_sandbox() {
    if !common::sandboxes_run() {
        return;
    }
    let g = common::Ground::new();
    let (state, cleanup) = (&g.state, &g.cleanup);
    let templates = g.templates();
    const CAP: usize = 6;

    // The first server: a live sandbox, one paused after some samples, one killed.
    let s1 = Server::prepare(
        server_config(state.path(), CAP),
        common::driver(state.path()),
        templates.clone(),
    )
    .await
    .expect("prepare");
    s1.recovery.done().await.expect("recovery");
    let m1 = s1.manager.clone();
    let sampler = m1.spawn_sampler();
    let live = m1.create(params()).await.expect("create live");
    cleanup.add(&live.id);
    let paused = m1.create(params()).await.expect("create paused");
    cleanup.add(&paused.id);
    let killed = m1.create(params()).await.expect("create killed");
    cleanup.add(&killed.id);
    // Enough rounds for the rings to thin themselves out (more samples than CAP).
    tokio::time::sleep(Duration::from_millis(2500)).await;
    m1.pause(&paused.id, true).await.expect("pause");
    assert!(stored_rows(state.path(), &killed.id) > 0);
    m1.kill(&killed.id, "test").await.unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(
        stored_rows(state.path(), &killed.id),
        0,
        "a killed sandbox's history is deleted"
    );
    sampler.abort();
    let cut = kiln_server::store::now_ms();
    let before_live = m1.metrics_window(&live.id, None, Some(cut)).await.unwrap();
    let before_paused = m1
        .metrics_window(&paused.id, None, Some(cut))
        .await
        .unwrap();
    assert!(before_live.len() >= 3, "{}", before_live.len());
    assert!(before_paused.len() >= 3, "{}", before_paused.len());
    for id in [&live.id, &paused.id] {
        let n = stored_rows(state.path(), id);
        assert!(
            (1..=CAP as i64).contains(&n),
            "{n} stored samples (bound {CAP})"
        );
    }
    // "Crash": the server goes away without ending its sandboxes.
    drop(s1);
    drop(m1);

    let s2 = Server::prepare(
        server_config(state.path(), CAP),
        common::driver(state.path()),
        templates.clone(),
    )
    .await
    .expect("prepare again");
    s2.recovery.done().await.expect("recovery");
    let m2 = s2.manager.clone();
    let after_live = m2.metrics_window(&live.id, None, Some(cut)).await.unwrap();
    let after_paused = m2
        .metrics_window(&paused.id, None, Some(cut))
        .await
        .unwrap();
    assert!(
        same_history(&before_live, &after_live),
        "live sandbox:\nbefore {before_live:?}\nafter {after_live:?}"
    );
    assert!(
        same_history(&before_paused, &after_paused),
        "paused sandbox:\nbefore {before_paused:?}\nafter {after_paused:?}"
    );
    // New samples join the old ones.
    let now = m2.metrics_window(&live.id, None, None).await.unwrap();
    assert!(now.len() > after_live.len() || now.last().unwrap().timestamp_ms > cut);
    assert!(now[0].timestamp_ms == after_live[0].timestamp_ms);
    // Killing after the restart deletes the stored history too.
    let sampler = m2.spawn_sampler();
    m2.kill(&live.id, "test").await.unwrap();
    m2.kill(&paused.id, "test").await.unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    sampler.abort();
    assert_eq!(stored_rows(state.path(), &live.id), 0);
    assert_eq!(stored_rows(state.path(), &paused.id), 0);
}
