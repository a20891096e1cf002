//! Team-wide searches through the real router, SQLite store and gVisor sandboxes: a team's key
//! searches the audit log (`GET /audit`, also `follow=true`), verifies its chains (`GET
//! /audit/verify`) and reads the lifecycle events (`GET /events`) of its own sandboxes and
//! nothing of another team's; the operator's team sees all.

use crate::common;

use std::time::Duration;

use http::StatusCode;
use http_body_util::BodyExt;
use kiln_server::audit::{AuditConfig, AuditLog};
use kiln_server::manager::AdmissionConfig;
use serde_json::Value;
use tower::ServiceExt;

const CREATE: &str = r#"{"templateID":"t","timeout":120}"#;

/// The sandboxes the records of `GET path` name.
async fn sandboxes_in(app: &axum::Router, key: &str, path: &str) -> Vec<String> {
    let (s, v) = common::call(app, Some(key), "GET", path, None, &[]).await;
    assert_eq!(s, StatusCode::OK, "{path}: {v}");
    let mut ids: Vec<String> = v["records"]
        .as_array()
        .unwrap_or_else(|| panic!("{path}: {v}"))
        .iter()
        .map(|r| r["sandboxID"].as_str().unwrap().to_string())
        .collect();
    ids.sort();
    ids.dedup();
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_team_searches_and_verifies_its_own_sandboxes_records_only() {
    if !common::sandboxes_run() {
        return;
    }
    let rig = common::Rig::new(common::team_config(AdmissionConfig::default()));
    let audit = AuditLog::open(&rig.path().join("kiln.db"), &AuditConfig::default()).unwrap();
    rig.manager.set_audit(audit);
    let (app, operator) = rig.app().await;
    let red = common::team_key(rig.path(), "red").await;
    let blue = common::team_key(rig.path(), "blue").await;
    let mut ids = Vec::new();
    for key in [&red, &blue] {
        let (s, v) = common::call(&app, Some(key), "POST", "/sandboxes", Some(CREATE), &[]).await;
        assert_eq!(s, StatusCode::CREATED, "{v}");
        let id = v["sandboxID"].as_str().unwrap().to_string();
        rig.cleanup.add(&id);
        ids.push(id);
    }
    let (r, b) = (ids[0].clone(), ids[1].clone());

    assert_eq!(sandboxes_in(&app, &blue, "/audit").await, [b.as_str()]);
    assert_eq!(
        sandboxes_in(&app, &red, "/audit?kind=lifecycle").await,
        [r.as_str()]
    );
    let mut both = vec![r.clone(), b.clone()];
    both.sort();
    assert_eq!(sandboxes_in(&app, &operator, "/audit").await, both);
    // The lifecycle events, likewise.
    for (key, want) in [
        (&blue, vec![b.clone()]),
        (&red, vec![r.clone()]),
        (&operator, both.clone()),
    ] {
        let (s, v) = common::call(&app, Some(key), "GET", "/events", None, &[]).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        let mut got: Vec<String> = v["events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["sandboxID"].as_str().unwrap().to_string())
            .collect();
        got.sort();
        got.dedup();
        assert_eq!(got, want, "{v}");
    }
    // Naming another team's sandbox: as if it did not exist.
    let (s, v) = common::call(
        &app,
        Some(&blue),
        "GET",
        &format!("/audit?sandboxID={r}"),
        None,
        &[],
    )
    .await;
    common::assert_error(s, &v, 404);

    let (s, v) = common::call(&app, Some(&blue), "GET", "/audit/verify", None, &[]).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let chains: Vec<&str> = v["chains"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["sandboxID"].as_str().unwrap())
        .collect();
    assert_eq!(chains, [b.as_str()], "{v}");
    assert_eq!(v["ok"], true, "{v}");

    // Following: what red's sandbox records next never reaches blue; blue's own does.
    let req = http::Request::get("/audit?follow=true&kind=api")
        .header("X-API-Key", &blue)
        .body(axum::body::Body::empty())
        .unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body();
    for (key, id) in [(&red, &r), (&blue, &b)] {
        let path = format!("/sandboxes/{id}/timeout");
        let (s, v) = common::call(
            &app,
            Some(key),
            "POST",
            &path,
            Some(r#"{"timeout":90}"#),
            &[],
        )
        .await;
        assert_eq!(s, StatusCode::NO_CONTENT, "{v}");
    }
    let mut seen = String::new();
    while !seen.contains("/timeout") {
        let frame = tokio::time::timeout(Duration::from_secs(20), body.frame())
            .await
            .expect("blue's own record never arrived")
            .unwrap()
            .unwrap();
        if let Ok(d) = frame.into_data() {
            seen.push_str(&String::from_utf8_lossy(&d));
        }
    }
    for line in seen.lines() {
        let v: Value = serde_json::from_str(line).unwrap();
        assert_eq!(v["sandboxID"], b.as_str(), "{line}");
    }
}
