//! Admission control with real gVisor sandboxes: a host filled to a configured cap refuses the
//! next create up front (429, `Retry-After`, the limit named) while every running sandbox keeps
//! answering; after a kill a create succeeds again. A create the host cannot hold is refused
//! with 503 before anything is started.

use crate::common;

use kiln_host::capacity::SandboxCost;
use kiln_server::manager::AdmissionConfig;
use kiln_server::LifecycleConfig;

const CREATE: &str = r#"{"templateID":"t","timeout":120}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_host_refuses_up_front_and_recovers_after_a_kill() {
    if !common::sandboxes_run() {
        return;
    }
    let rig = common::Rig::new(LifecycleConfig {
        default_memory_mb: 256,
        admission: AdmissionConfig {
            max_sandboxes: Some(2),
            ..AdmissionConfig::default()
        },
        ..LifecycleConfig::default()
    });
    let (state, driver, cleanup, manager) = (&rig.state, &rig.driver, &rig.cleanup, &rig.manager);
    let (app, key) = common::app(manager.clone(), state.path()).await;
    let mut ids = Vec::new();
    for _ in 0..2 {
        let (s, v) = common::call(&app, Some(&key), "POST", "/sandboxes", Some(CREATE), &[]).await;
        assert_eq!(s.as_u16(), 201, "{v}");
        let id = v["sandboxID"].as_str().unwrap().to_string();
        cleanup.add(&id);
        ids.push(id);
    }
    // Full: refused up front, with the limit named and a Retry-After.
    let req = http::Request::builder()
        .method("POST")
        .uri("/sandboxes")
        .header("X-API-Key", &key)
        .header("content-type", "application/json")
        .body(axum::body::Body::from(CREATE))
        .unwrap();
    let resp = tower::ServiceExt::oneshot(app.clone(), req).await.unwrap();
    assert_eq!(resp.status().as_u16(), 429);
    assert_eq!(
        resp.headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok()),
        Some("5")
    );
    let body = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .unwrap()
        .to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    common::assert_error(http::StatusCode::TOO_MANY_REQUESTS, &v, 429);
    assert!(
        v["message"].as_str().unwrap().contains("--max-sandboxes 2"),
        "{v}"
    );
    // Nothing was started for the refused create, and both sandboxes still answer.
    assert_eq!(driver.list_on_host().await.unwrap().len(), 2);
    for id in &ids {
        let out = manager
            .agent(id, manager.get(id).unwrap().envd_token)
            .run("echo alive", Default::default())
            .await
            .expect("running sandbox answers");
        assert_eq!(String::from_utf8_lossy(&out.stdout), "alive\n");
    }
    // After a kill there is room again.
    let (s, _) = common::call(
        &app,
        Some(&key),
        "DELETE",
        &format!("/sandboxes/{}", ids[0]),
        None,
        &[],
    )
    .await;
    assert_eq!(s.as_u16(), 204);
    // The killed sandbox holds its resources until its background teardown is done.
    assert!(
        manager
            .teardowns_done(std::time::Duration::from_secs(60))
            .await
    );
    let (s, v) = common::call(&app, Some(&key), "POST", "/sandboxes", Some(CREATE), &[]).await;
    assert_eq!(s.as_u16(), 201, "{v}");
    cleanup.add(v["sandboxID"].as_str().unwrap());
    manager.kill_all("test done").await;
    assert!(driver.list_on_host().await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_the_host_cannot_hold_gets_503_and_starts_nothing() {
    if !common::sandboxes_run() {
        return;
    }
    let rig = common::Rig::new(LifecycleConfig {
        admission: AdmissionConfig {
            // More memory per sandbox than any host has available.
            cost: SandboxCost {
                mem_bytes: u64::MAX / 4,
                ..SandboxCost::default()
            },
            ..AdmissionConfig::default()
        },
        ..LifecycleConfig::default()
    });
    let (state, driver) = (&rig.state, &rig.driver);
    let (app, key) = rig.app().await;
    let (s, v) = common::call(&app, Some(&key), "POST", "/sandboxes", Some(CREATE), &[]).await;
    common::assert_error(s, &v, 503);
    let msg = v["message"].as_str().unwrap();
    assert!(msg.contains("host capacity: memory"), "{msg}");
    assert!(driver.list_on_host().await.unwrap().is_empty());
    assert!(common::mounts_under(state.path()).is_empty());
    let (s, v) = common::call(&app, Some(&key), "GET", "/sandboxes", None, &[]).await;
    assert_eq!(s.as_u16(), 200);
    assert_eq!(v, serde_json::json!([]));
}
