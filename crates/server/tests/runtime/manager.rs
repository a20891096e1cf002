//! Sandbox lifecycle with real gVisor sandboxes: timeout expiry, and recovery after the server
//! goes away without cleaning up (adopting live sandboxes, cleaning dead ones).

use crate::common;

use std::time::{Duration, Instant};

use kiln_server::store::SandboxState;

use common::params;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeout_expiry_and_restart_recovery() {
    if !common::sandboxes_run() {
        return;
    }
    let mut rig = common::Rig::new(common::template_config());
    let driver = rig.driver.clone();
    let store = rig.store();

    // Expiry: a 1 s sandbox is killed by the reaper and marked so.
    let m1 = rig.manager.clone();
    let reaper = m1.spawn_reaper();
    let short = m1.create(params(1)).await.expect("create");
    rig.cleanup.add(&short.id);
    assert!(m1.route(&short.id).is_some());
    let t = Instant::now();
    while m1.get(&short.id).is_ok() && t.elapsed() < Duration::from_secs(15) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(m1.get(&short.id).is_err(), "not killed after its timeout");
    let t = Instant::now();
    loop {
        let rec = store.get_sandbox(&short.id).await.unwrap().unwrap();
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
    rig.cleanup.add(&keep.id);
    rig.cleanup.add(&lost.id);
    drop(m1);
    // One dies while no server runs.
    driver.stop(&lost.id).await.unwrap();

    let m2 = rig.restart();
    let report = m2.recover().await.expect("recover");
    assert_eq!(report.adopted, vec![keep.id.clone()]);
    assert_eq!(report.cleaned, vec![lost.id.clone()]);
    let route = m2.route(&keep.id).expect("adopted sandbox is routable");
    assert!(m2.agent(&keep.id, None).health().await.is_ok());
    assert_eq!(route.envd_token, keep.envd_token);
    assert_eq!(m2.get(&keep.id).unwrap().end_at_ms, keep.end_at_ms);
    let lost_rec = store.get_sandbox(&lost.id).await.unwrap().unwrap();
    assert_eq!(lost_rec.state, SandboxState::Killed);
    assert!(m2.get(&lost.id).is_err());

    assert!(m2.kill(&keep.id, "test done").await.unwrap());
    assert!(!m2.kill(&keep.id, "again").await.unwrap());
    assert!(common::mounts_under(rig.path()).is_empty());
    assert!(driver.list_on_host().await.unwrap().is_empty());
    assert!(common::processes_mentioning(&keep.id).is_empty());
}

/// A sandbox whose boot fails (its template has no agent) is stopped, marked failed with the
/// reason and reported by a `failed` event; nothing of it stays on the host, the client's
/// error names no host path, and the next create works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_boot_is_marked_reported_and_leaves_nothing() {
    if !common::sandboxes_run() {
        return;
    }
    use kiln_server::templates::{from_dir, FixedTemplates};

    let g = common::Ground::new();
    let empty = tempfile::tempdir().unwrap();
    let m = common::manager(
        g.path(),
        g.driver.clone(),
        std::sync::Arc::new(FixedTemplates(vec![
            from_dir("t", g.tpl.path()),
            from_dir("broken", empty.path()),
        ])),
        common::template_config(),
    );
    let (app, key) = common::app(m.clone(), g.path()).await;
    let (status, v) = common::call(
        &app,
        Some(&key),
        "POST",
        "/sandboxes",
        Some(r#"{"templateID":"broken","timeout":60}"#),
        &[],
    )
    .await;
    assert!(status.is_server_error(), "{status}: {v}");
    let msg = v["message"].as_str().unwrap_or_default();
    assert!(msg.contains("rebuild the template"), "{v}");
    assert!(!msg.contains(&*empty.path().to_string_lossy()), "{v}");
    assert!(!msg.contains(&*g.path().to_string_lossy()), "{v}");

    let store = g.store();
    let failed = store.list_sandboxes(&[SandboxState::Failed]).await.unwrap();
    assert_eq!(failed.len(), 1, "{failed:?}");
    let id = failed[0].id.clone();
    assert!(failed[0]
        .end_reason
        .as_deref()
        .is_some_and(|r| r.contains("rebuild the template")));
    let events = common::event_kinds(store.as_ref(), &id, &[]).await;
    assert!(events.iter().any(|k| k == "failed"), "{events:?}");
    assert!(
        m.get(&id).is_err(),
        "a failed sandbox is not listed as live"
    );
    assert!(g.driver.list_on_host().await.unwrap().is_empty());
    assert!(common::mounts_under(g.path()).is_empty());
    assert!(!g.path().join("gvisor/sandboxes").join(&id).exists());

    let ok = m.create(params(60)).await.expect("the next create");
    g.cleanup.add(&ok.id);
    assert_eq!(common::sh(&m, &ok.id, "echo up").await, "up");
    assert!(m.kill(&ok.id, "test done").await.unwrap());
}
