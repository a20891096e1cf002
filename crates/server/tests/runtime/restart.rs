//! Fast restart with real gVisor sandboxes: the server listens at once whatever the number of
//! live sandboxes, re-adopts them in parallel in the background, and a request for a sandbox
//! not yet adopted waits for it instead of answering 404.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use kiln_server::{LifecycleConfig, Server, ServerConfig};

/// Live sandboxes across the restart (what a 2-core CI machine holds comfortably).
const COUNT: usize = 8;

fn lifecycle() -> LifecycleConfig {
    LifecycleConfig {
        default_memory_mb: 256,
        ..LifecycleConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_listens_at_once_and_adopts_in_parallel() {
    if !common::sandboxes_run() {
        return;
    }
    let g = common::Ground::new();
    let (state, driver, cleanup) = (&g.state, g.driver.clone(), &g.cleanup);
    let templates = g.templates();

    // The first "server" starts COUNT sandboxes, then goes away without cleaning up.
    let m1 = common::manager(state.path(), driver.clone(), templates.clone(), lifecycle());
    let creates = (0..COUNT).map(|_| {
        let m = m1.clone();
        tokio::spawn(async move { m.create(common::params(600)).await })
    });
    let mut ids = Vec::new();
    for c in futures::future::join_all(creates).await {
        let rec = c.unwrap().expect("create");
        cleanup.add(&rec.id);
        ids.push(rec.id);
    }
    drop(m1);

    // Restart: prepare (open state, bind, start recovery) must be quick.
    let t = Instant::now();
    let server = Server::prepare(
        ServerConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            domain: "kiln.test".into(),
            state_dir: state.path().to_path_buf(),
            lifecycle: lifecycle(),
            metrics_token: None,
            edge: Default::default(),
            audit: Default::default(),
            identity_issuer: None,
            host_ca_dir: None,
            template_builds: Default::default(),
        },
        common::driver(state.path()),
        templates.clone(),
    )
    .await
    .expect("prepare");
    let ready = t.elapsed();
    assert!(
        ready < Duration::from_secs(2),
        "listening took {ready:?} with {COUNT} live sandboxes"
    );
    let manager = server.manager.clone();
    let recovery = server.recovery.clone();
    let addr = server.local_addr;
    let key = server
        .first_key
        .clone()
        .expect("first start makes a key")
        .secret;
    let app = kiln_server::front::router(Arc::new(kiln_server::api::AppState::new(
        manager.clone(),
        kiln_server::api::ApiConfig {
            domain: "kiln.test".into(),
            metrics_token: None,
        },
    )));
    // A request made while recovery still runs (sandboxes pending) waits and succeeds.
    let pending_before = manager.recovering();
    assert!(
        pending_before > 0,
        "recovery was not running in the background"
    );
    let last = ids.last().unwrap().clone();
    let (status, v) = common::call(
        &app,
        Some(&key),
        "GET",
        &format!("/sandboxes/{last}"),
        None,
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::OK, "pending {pending_before}: {v}");
    assert_eq!(v["sandboxID"].as_str(), Some(last.as_str()), "{v}");

    let serving = tokio::spawn(server.serve());
    tokio::net::TcpStream::connect(addr)
        .await
        .expect("the restarted server accepts connections");

    let t = Instant::now();
    let report = recovery.done().await.expect("recovery");
    eprintln!(
        "restart: listening after {ready:?}, all adopted {:?} later",
        t.elapsed()
    );
    let mut adopted = report.adopted.clone();
    adopted.sort();
    let mut want = ids.clone();
    want.sort();
    assert_eq!(adopted, want, "{report:?}");
    assert!(report.cleaned.is_empty() && report.orphans_removed.is_empty());
    assert_eq!(manager.recovering(), 0);

    // Every sandbox answers, through the API and its agent.
    for id in &ids {
        let (status, v) = common::call(
            &app,
            Some(&key),
            "GET",
            &format!("/sandboxes/{id}"),
            None,
            &[],
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{v}");
        manager
            .agent(id, None)
            .health()
            .await
            .expect("adopted sandbox answers");
    }

    // Killing adopted sandboxes cleans up completely.
    for id in &ids {
        let (status, v) = common::call(
            &app,
            Some(&key),
            "DELETE",
            &format!("/sandboxes/{id}"),
            None,
            &[],
        )
        .await;
        assert_eq!(status, StatusCode::NO_CONTENT, "{v}");
    }
    // A kill answers before its teardown, which finishes in the background.
    assert!(
        manager
            .teardowns_done(std::time::Duration::from_secs(60))
            .await
    );
    assert!(driver.list_on_host().await.unwrap().is_empty());
    // A runtime command started just before a kill (the metrics sampler's `runsc events`)
    // may still be ending; nothing of the sandbox stays.
    for id in &ids {
        let deadline = Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let left = common::processes_mentioning(id);
            if left.is_empty() {
                break;
            }
            assert!(Instant::now() < deadline, "still on the host: {left:?}");
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }
    serving.abort();
}
