//! Tenancy through the real router, SQLite store and gVisor sandboxes: two API keys of two
//! teams; every route answers 404 to the team that does not own the sandbox or snapshot (and
//! lists show only the caller's own), per-team quotas refuse with 429 + Retry-After naming the
//! limit, and `Idempotency-Key` turns retried (also concurrent) creates into one sandbox.

use crate::common;

use std::sync::Arc;

use http::{HeaderMap, StatusCode};
use kiln_server::manager::AdmissionConfig;
use kiln_server::store::{now_ms, TeamRecord};
use kiln_server::templates::FixedTemplates;
use kiln_server::tenancy::TeamQuota;
use serde_json::Value;

/// One request with `key`: status, headers, JSON body.
async fn req(
    app: &axum::Router,
    key: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
    headers: &[(&str, &str)],
) -> (StatusCode, HeaderMap, Value) {
    common::request(app, Some(key), method, path, body, headers).await
}

const CREATE: &str = r#"{"templateID":"t","timeout":120,"metadata":{"who":"red"}}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_team_sees_nothing_on_any_route() {
    if !common::sandboxes_run() {
        return;
    }
    let rig = common::Rig::new(common::team_config(AdmissionConfig::default()));
    let (state, driver, cleanup, manager) = (&rig.state, &rig.driver, &rig.cleanup, &rig.manager);
    let (app, _) = common::app(manager.clone(), state.path()).await;
    let red = common::team_key(state.path(), "red").await;
    let blue = common::team_key(state.path(), "blue").await;

    let (s, _, v) = req(&app, &red, "POST", "/sandboxes", Some(CREATE), &[]).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let id = v["sandboxID"].as_str().unwrap().to_string();
    cleanup.add(&id);
    assert_eq!(manager.get(&id).unwrap().team, "red");
    let (s, _, v) = req(
        &app,
        &red,
        "POST",
        &format!("/sandboxes/{id}/snapshots"),
        Some(r#"{"name":"red-snap"}"#),
        &[],
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let snap = v["snapshotID"].as_str().unwrap().to_string();

    // Every route that names the sandbox or the snapshot: 404 for blue.
    let sbx = format!("/sandboxes/{id}");
    let routes: Vec<(&str, String, Option<&str>)> = vec![
        ("GET", sbx.clone(), None),
        ("POST", format!("{sbx}/timeout"), Some(r#"{"timeout":30}"#)),
        ("POST", format!("{sbx}/connect"), Some(r#"{"timeout":30}"#)),
        (
            "POST",
            format!("/v2/sandboxes/{id}/connect"),
            Some(r#"{"timeout":30}"#),
        ),
        ("POST", format!("{sbx}/refreshes"), Some("{}")),
        ("GET", format!("{sbx}/metrics"), None),
        ("GET", format!("{sbx}/events"), None),
        ("GET", format!("{sbx}/audit"), None),
        ("GET", format!("/events?sandboxId={id}"), None),
        ("GET", format!("/audit?sandboxID={id}"), None),
        ("GET", format!("/audit/verify?sandboxID={id}"), None),
        ("GET", format!("{sbx}/logs"), None),
        ("GET", format!("/v2/sandboxes/{id}/logs"), None),
        ("POST", format!("{sbx}/pause"), Some("{}")),
        ("POST", format!("{sbx}/resume"), Some("{}")),
        ("POST", format!("{sbx}/fork"), Some("{}")),
        ("POST", format!("{sbx}/snapshots"), Some("{}")),
        (
            "PUT",
            format!("{sbx}/network"),
            Some(r#"{"allowOut":["1.1.1.1"]}"#),
        ),
        ("DELETE", format!("/templates/{snap}"), None),
        ("DELETE", "/templates/red-snap".to_string(), None),
        ("DELETE", sbx.clone(), None),
    ];
    // Searches over many sandboxes (events, audit) cover the caller's team's: none of red's
    // (tenancy_audit.rs).
    let (s, _, v) = req(&app, &blue, "GET", "/events", None, &[]).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["events"].as_array().map(Vec::len), Some(0), "{v}");
    let (s, _, v) = req(
        &app,
        &blue,
        "GET",
        &format!("/sandboxes/metrics?sandbox_ids={id}"),
        None,
        &[],
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert!(v["sandboxes"].as_object().unwrap().is_empty(), "{v}");
    for (m, p, b) in &routes {
        let (s, _, v) = req(&app, &blue, m, p, *b, &[]).await;
        common::assert_error(s, &v, 404);
        assert!(
            !v.to_string().contains("red-snap") || p.contains("red-snap"),
            "{m} {p}: {v}"
        );
    }
    // Creating from red's snapshot (by id or name) as blue: no such template.
    for t in [snap.as_str(), "red-snap"] {
        let body = format!(r#"{{"templateID":"{t}","timeout":60}}"#);
        let (s, _, v) = req(&app, &blue, "POST", "/sandboxes", Some(&body), &[]).await;
        common::assert_error(s, &v, 404);
    }
    // Lists: blue sees nothing, red sees its own.
    for p in [
        "/sandboxes",
        "/v2/sandboxes",
        "/v2/sandboxes?state=running,paused",
        "/snapshots",
        "/snapshots?name=red-snap",
        "/sandboxes?metadata=who%3Dred",
    ] {
        let (s, _, v) = req(&app, &blue, "GET", p, None, &[]).await;
        assert_eq!(
            (s, v.clone()),
            (StatusCode::OK, Value::Array(vec![])),
            "{p}"
        );
        let (s, _, v) = req(&app, &red, "GET", p, None, &[]).await;
        assert_eq!(s, StatusCode::OK, "{p}");
        assert_eq!(v.as_array().unwrap().len(), 1, "{p}: {v}");
    }
    // Built-in templates are shared.
    let (s, _, v) = req(&app, &blue, "GET", "/templates/t", None, &[]).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    // Nothing blue did touched red's sandbox: it still runs and answers, its snapshot exists.
    let (s, _, v) = req(&app, &red, "GET", &sbx, None, &[]).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["state"], "running");
    let out = manager
        .agent(&id, manager.get(&id).unwrap().envd_token)
        .run("echo alive", Default::default())
        .await
        .expect("red's sandbox answers");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "alive\n");
    // Red may do what blue could not.
    let (s, _, v) = req(&app, &red, "DELETE", "/templates/red-snap", None, &[]).await;
    assert_eq!(s, StatusCode::NO_CONTENT, "{v}");
    let (s, _, v) = req(&app, &red, "DELETE", &sbx, None, &[]).await;
    assert_eq!(s, StatusCode::NO_CONTENT, "{v}");
    assert!(
        manager
            .teardowns_done(std::time::Duration::from_secs(60))
            .await
    );
    assert!(driver.list_on_host().await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quotas_and_idempotent_creates() {
    if !common::sandboxes_run() {
        return;
    }
    let rig = common::Rig::new(common::team_config(AdmissionConfig {
        team_defaults: TeamQuota {
            max_sandboxes: Some(2),
            max_timeout_secs: Some(600),
            creates_per_minute: None,
            max_volumes: None,
        },
        ..Default::default()
    }));
    let (state, driver, cleanup, manager) = (&rig.state, &rig.driver, &rig.cleanup, &rig.manager);
    let (app, _) = common::app(manager.clone(), state.path()).await;
    let red = common::team_key(state.path(), "red").await;
    let blue = common::team_key(state.path(), "blue").await;
    common::store(state.path())
        .upsert_team(&TeamRecord {
            name: "red".into(),
            max_sandboxes: Some(1),
            created_at_ms: now_ms(),
            ..Default::default()
        })
        .await
        .unwrap();

    // Three concurrent creates with one Idempotency-Key: one sandbox, one answer.
    let idem = [("Idempotency-Key", "create-1")];
    let calls = (0..3).map(|_| req(&app, &red, "POST", "/sandboxes", Some(CREATE), &idem));
    let answers = futures::future::join_all(calls).await;
    let first = answers[0].2["sandboxID"].as_str().unwrap().to_string();
    cleanup.add(&first);
    let mut replayed = 0;
    for (s, h, v) in &answers {
        assert_eq!(*s, StatusCode::CREATED, "{v}");
        assert_eq!(v["sandboxID"], first.as_str(), "{v}");
        replayed += usize::from(h.contains_key("idempotent-replayed"));
    }
    assert_eq!(replayed, 2);
    assert_eq!(driver.list_on_host().await.unwrap().len(), 1);
    // A later retry too; the same key with another body is refused.
    let (s, _, v) = req(&app, &red, "POST", "/sandboxes", Some(CREATE), &idem).await;
    assert_eq!(
        (s, v["sandboxID"].as_str()),
        (StatusCode::CREATED, Some(first.as_str()))
    );
    let other = r#"{"templateID":"t","timeout":60}"#;
    let (s, _, v) = req(&app, &red, "POST", "/sandboxes", Some(other), &idem).await;
    common::assert_error(s, &v, 422);
    // After a restart of the API (a new router and key memory; the same state database) the
    // retry still gets the first sandbox, and another body is still refused.
    let (restarted, _) = common::app(manager.clone(), state.path()).await;
    let (s, h, v) = req(&restarted, &red, "POST", "/sandboxes", Some(CREATE), &idem).await;
    assert_eq!(
        (s, v["sandboxID"].as_str()),
        (StatusCode::CREATED, Some(first.as_str())),
        "{v}"
    );
    assert!(h.contains_key("idempotent-replayed"), "{h:?}");
    let (s, _, v) = req(&restarted, &red, "POST", "/sandboxes", Some(other), &idem).await;
    common::assert_error(s, &v, 422);
    assert_eq!(driver.list_on_host().await.unwrap().len(), 1);

    // Red's own quota is 1 sandbox: the next create gets 429 naming it, with Retry-After.
    let (s, h, v) = req(&app, &red, "POST", "/sandboxes", Some(CREATE), &[]).await;
    common::assert_error(s, &v, 429);
    assert!(h.contains_key("retry-after"), "{h:?}");
    let msg = v["message"].as_str().unwrap();
    assert!(
        msg.contains("team \"red\"'s sandbox quota (1 at once"),
        "{msg}"
    );
    // A fork would take red past its quota too (checked before anything is captured).
    let (s, h, v) = req(
        &app,
        &red,
        "POST",
        &format!("/sandboxes/{first}/fork"),
        Some("{}"),
        &[],
    )
    .await;
    common::assert_error(s, &v, 429);
    assert!(h.contains_key("retry-after"), "{h:?}");
    // ...and a refused create with a key is not remembered: after room is made it runs.
    let idem2 = [("Idempotency-Key", "create-2")];
    let (s, _, v) = req(&app, &red, "POST", "/sandboxes", Some(CREATE), &idem2).await;
    common::assert_error(s, &v, 429);
    // Blue (the server default of 2) is not affected by red's use.
    let (s, _, v) = req(&app, &blue, "POST", "/sandboxes", Some(CREATE), &idem).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let blue_id = v["sandboxID"].as_str().unwrap().to_string();
    cleanup.add(&blue_id);
    assert_ne!(blue_id, first, "keys are per team");
    // Timeouts above the team's maximum: 400 on create and on every route that sets one.
    let long = r#"{"templateID":"t","timeout":601}"#;
    let (s, _, v) = req(&app, &blue, "POST", "/sandboxes", Some(long), &[]).await;
    common::assert_error(s, &v, 400);
    assert!(
        v["message"].as_str().unwrap().contains("maximum of 600s"),
        "{v}"
    );
    for (p, b) in [
        ("timeout", r#"{"timeout":601}"#),
        ("connect", r#"{"timeout":601}"#),
        ("refreshes", r#"{"duration":601}"#),
    ] {
        let path = format!("/sandboxes/{blue_id}/{p}");
        let (s, _, v) = req(&app, &blue, "POST", &path, Some(b), &[]).await;
        common::assert_error(s, &v, 400);
    }
    // Room again after a kill: the refused key now runs.
    let (s, _, _) = req(
        &app,
        &red,
        "DELETE",
        &format!("/sandboxes/{first}"),
        None,
        &[],
    )
    .await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    // (The killed sandbox counts until its background teardown is done.)
    assert!(
        manager
            .teardowns_done(std::time::Duration::from_secs(60))
            .await
    );
    let (s, _, v) = req(&app, &red, "POST", "/sandboxes", Some(CREATE), &idem2).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    cleanup.add(v["sandboxID"].as_str().unwrap());
    manager.kill_all("test done").await;
    assert!(driver.list_on_host().await.unwrap().is_empty());
}

/// The create-rate quota needs no sandbox: admitted creates count whether or not they then
/// find their template.
#[tokio::test]
async fn create_rate_quota_answers_429_with_retry_after() {
    let state = common::state_dir();
    let manager = common::manager(
        state.path(),
        common::driver(state.path()),
        Arc::new(FixedTemplates::default()),
        common::team_config(AdmissionConfig {
            team_defaults: TeamQuota {
                creates_per_minute: Some(2),
                ..Default::default()
            },
            ..Default::default()
        }),
    );
    let (app, _) = common::app(manager, state.path()).await;
    let red = common::team_key(state.path(), "red").await;
    let blue = common::team_key(state.path(), "blue").await;
    let body = r#"{"templateID":"nosuch"}"#;
    for _ in 0..2 {
        let (s, _, v) = req(&app, &red, "POST", "/sandboxes", Some(body), &[]).await;
        common::assert_error(s, &v, 404);
    }
    let (s, h, v) = req(&app, &red, "POST", "/sandboxes", Some(body), &[]).await;
    common::assert_error(s, &v, 429);
    let wait: u64 = h["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=60).contains(&wait), "{wait}");
    assert!(
        v["message"]
            .as_str()
            .unwrap()
            .contains("create rate quota (2 per minute)"),
        "{v}"
    );
    let (s, _, v) = req(&app, &blue, "POST", "/sandboxes", Some(body), &[]).await;
    common::assert_error(s, &v, 404);
    // A bad Idempotency-Key is a 400.
    let (s, _, v) = req(
        &app,
        &blue,
        "POST",
        "/sandboxes",
        Some(body),
        &[("Idempotency-Key", "has space")],
    )
    .await;
    common::assert_error(s, &v, 400);
}
