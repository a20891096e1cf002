//! Who gets into the console and what keys can do, through the real router and SQLite store
//! (no sandbox is started): `/api-keys` and `/teams` scoped to the caller's team (the
//! operator's team, `default`, sees and acts on every team's), the same calls from a console
//! session, the sign-in rate limit per client address, and sessions outliving the server.

use crate::common;

use std::sync::Arc;

use http::{header, StatusCode};
use serde_json::Value;

use kiln_server::api::{ApiConfig, AppState};
use kiln_server::console::ConsoleDb;

use common::requests::{csrf_of_page, send, send_from, sign_in, FORM, JSON};

async fn call(
    app: &axum::Router,
    key: &str,
    method: &str,
    path: &str,
    body: &str,
) -> (StatusCode, Value) {
    common::call(
        app,
        Some(key),
        method,
        path,
        (!body.is_empty()).then_some(body),
        &[],
    )
    .await
}

fn ids(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|k| k["id"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test]
async fn keys_and_teams_are_scoped_to_the_callers_team() {
    let dir = common::state_dir();
    let (app, admin) = common::empty_app(dir.path()).await;
    let red = common::team_key(dir.path(), "red").await;

    // Red lists red's keys only, by prefix: no hash, no secret.
    let (s, v) = call(&app, &red, "GET", "/api-keys", "").await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let list = v.as_array().unwrap();
    assert_eq!(list.len(), 1, "{v}");
    assert_eq!(list[0]["team"], "red");
    assert!(red.starts_with(list[0]["prefix"].as_str().unwrap()));
    assert!(
        list[0].get("hash").is_none() && !v.to_string().contains(&red[10..]),
        "{v}"
    );
    let (s, _) = call(&app, &red, "GET", "/api-keys?team=default", "").await;
    assert_eq!(
        s,
        StatusCode::FORBIDDEN,
        "another team's keys are the operator's to list"
    );
    // The operator's team lists every team's, or one team's.
    let (_, v) = call(&app, &admin, "GET", "/api-keys", "").await;
    assert_eq!(v.as_array().unwrap().len(), 2, "{v}");
    let (_, v) = call(&app, &admin, "GET", "/api-keys?team=red", "").await;
    assert_eq!(v.as_array().unwrap().len(), 1, "{v}");

    // Red makes a key for red: the secret once, and it works.
    let (s, made) = call(&app, &red, "POST", "/api-keys", r#"{"name":"ci"}"#).await;
    assert_eq!(s, StatusCode::CREATED, "{made}");
    assert_eq!(made["team"], "red");
    let secret = made["key"].as_str().unwrap().to_string();
    assert!(secret.starts_with("e2b_") && secret.len() == 44);
    let (s, _) = call(&app, &secret, "GET", "/sandboxes", "").await;
    assert_eq!(s, StatusCode::OK);
    let (_, v) = call(&app, &red, "GET", "/api-keys", "").await;
    assert!(
        !v.to_string().contains(&secret[10..]),
        "listed by prefix only: {v}"
    );
    // Not for another team, and not with a bad name or team.
    for (body, want) in [
        (r#"{"name":"x","team":"blue"}"#, StatusCode::FORBIDDEN),
        (r#"{"name":"  "}"#, StatusCode::BAD_REQUEST),
        (r#"{"name":"a\u0000b"}"#, StatusCode::BAD_REQUEST),
        (r#"{"name":"x","team":"Bad Team"}"#, StatusCode::BAD_REQUEST),
        (r#"{"name":"x","admin":true}"#, StatusCode::BAD_REQUEST),
        ("[", StatusCode::BAD_REQUEST),
    ] {
        let (s, v) = call(&app, &red, "POST", "/api-keys", body).await;
        assert_eq!(s, want, "{body}: {v}");
    }
    // The operator's team makes keys for any team.
    let (s, blue) = call(
        &app,
        &admin,
        "POST",
        "/api-keys",
        r#"{"name":"b","team":"blue"}"#,
    )
    .await;
    assert_eq!(
        (s, blue["team"].as_str()),
        (StatusCode::CREATED, Some("blue")),
        "{blue}"
    );

    // Revoking: red cannot touch the operator's keys (404, as if absent); its own, once.
    let (_, v) = call(&app, &admin, "GET", "/api-keys?team=default", "").await;
    let admin_id = ids(&v).remove(0);
    let (s, _) = call(&app, &red, "DELETE", &format!("/api-keys/{admin_id}"), "").await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let ci = made["id"].as_str().unwrap();
    let (s, _) = call(&app, &red, "DELETE", &format!("/api-keys/{ci}"), "").await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let (s, _) = call(&app, &red, "DELETE", &format!("/api-keys/{ci}"), "").await;
    assert_eq!(s, StatusCode::CONFLICT);
    let (s, v) = call(&app, &secret, "GET", "/sandboxes", "").await;
    assert_eq!(s, StatusCode::UNAUTHORIZED, "{v}");
    let (_, v) = call(&app, &red, "GET", "/api-keys", "").await;
    assert!(v
        .as_array()
        .unwrap()
        .iter()
        .any(|k| k["id"] == ci && k["revokedAt"].is_string()));
    // The operator's last active key stays.
    let (s, v) = call(&app, &admin, "DELETE", &format!("/api-keys/{admin_id}"), "").await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    let blue_id = blue["id"].as_str().unwrap();
    let (s, _) = call(&app, &admin, "DELETE", &format!("/api-keys/{blue_id}"), "").await;
    assert_eq!(
        s,
        StatusCode::NO_CONTENT,
        "the operator revokes any team's key"
    );

    // Teams: red sees red; the operator every team, with quotas and use.
    let (s, v) = call(&app, &red, "GET", "/teams", "").await;
    assert_eq!(s, StatusCode::OK);
    let t = v.as_array().unwrap();
    assert_eq!(t.len(), 1, "{v}");
    assert_eq!(
        (t[0]["name"].as_str(), t[0]["activeKeys"].as_u64()),
        (Some("red"), Some(1))
    );
    assert_eq!(t[0]["usage"]["sandboxes"], 0);
    assert!(t[0]["quota"].get("maxSandboxes").is_some(), "{v}");
    let (_, v) = call(&app, &admin, "GET", "/teams", "").await;
    let names: Vec<&str> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["blue", "default", "red"], "{v}");

    // From a console session: the same API as the signed-in key, CSRF required to change.
    let (cookie, csrf) = sign_in(&app, &red).await;
    let c = ("cookie", cookie.as_str());
    let (s, _, v) = send(&app, "GET", "/console/api/api-keys", &[c], "").await;
    assert_eq!(s, StatusCode::OK);
    assert!(v.contains("\"red\"") && !v.contains("\"default\""), "{v}");
    let body = r#"{"name":"from-console"}"#;
    let (s, _, _) = send(&app, "POST", "/console/api/api-keys", &[c, JSON], body).await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    let t = ("x-csrf-token", csrf.as_str());
    let (s, _, v) = send(&app, "POST", "/console/api/api-keys", &[c, JSON, t], body).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert!(v.contains("\"key\":\"e2b_"), "{v}");
}

#[tokio::test]
async fn failed_sign_ins_are_limited_per_address() {
    let dir = common::state_dir();
    let (app, key) = common::empty_app(dir.path()).await;
    let login = |peer: &'static str, key: String| {
        let app = app.clone();
        async move {
            send_from(
                &app,
                Some(peer),
                "POST",
                "/console/login",
                &[FORM],
                &format!("key={key}"),
            )
            .await
        }
    };
    let wrong = format!("e2b_{}", "0".repeat(40));
    for i in 0..5 {
        let (s, _, _) = login("192.168.5.1:4000", wrong.clone()).await;
        assert_eq!(s, StatusCode::UNAUTHORIZED, "failure {i}");
    }
    // The sixth try is refused before any key is checked, even with the right key.
    for k in [wrong.clone(), key.clone()] {
        let (s, h, page) = login("192.168.5.1:4001", k).await;
        assert_eq!(s, StatusCode::TOO_MANY_REQUESTS, "{page}");
        let wait: u64 = h[header::RETRY_AFTER].to_str().unwrap().parse().unwrap();
        assert!((1..=60).contains(&wait), "{wait}");
        assert!(page.contains("Too many failed sign-ins") && page.contains(r#"role="alert""#));
        assert!(h.get(header::SET_COOKIE).is_none());
    }
    // Another address signs in.
    let (s, _, _) = login("192.168.5.2:4000", key.clone()).await;
    assert_eq!(s, StatusCode::SEE_OTHER);
    // IPv6 addresses count by their /64.
    for _ in 0..5 {
        login("[fd00:5::1]:4000", wrong.clone()).await;
    }
    let (s, _, _) = login("[fd00:5::2]:4000", key.clone()).await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS);
    let (s, _, _) = login("[fd00:6::1]:4000", key).await;
    assert_eq!(s, StatusCode::SEE_OTHER);
}

/// The API router over a fresh manager in `state`, its console sessions in the state
/// database (as `kiln serve` has them).
fn served_app(state: &std::path::Path) -> axum::Router {
    let manager = common::manager(
        state,
        common::driver(state),
        Arc::new(kiln_server::templates::FixedTemplates::default()),
        kiln_server::LifecycleConfig::default(),
    );
    let db = ConsoleDb::open(&state.join("kiln.db")).unwrap();
    kiln_server::front::router(Arc::new(
        AppState::new(
            manager,
            ApiConfig {
                domain: "kiln.test".into(),
                metrics_token: None,
            },
        )
        .with_console_db(db),
    ))
}

#[tokio::test]
async fn sessions_survive_a_server_restart() {
    let dir = common::state_dir();
    let key = common::team_key(dir.path(), "green").await;
    let first = served_app(dir.path());
    let (cookie, csrf) = sign_in(&first, &key).await;
    let (ended, _) = sign_in(&first, &key).await;
    let (s, h, _) = send(
        &first,
        "POST",
        "/console/logout",
        &[("cookie", &ended), FORM],
        &format!("csrf={}", csrf_of_page(&first, &ended).await.unwrap()),
    )
    .await;
    assert_eq!(s, StatusCode::SEE_OTHER, "{h:?}");
    drop(first);

    let second = served_app(dir.path());
    assert_eq!(
        csrf_of_page(&second, &cookie).await.as_deref(),
        Some(csrf.as_str()),
        "the session and its CSRF token are found again"
    );
    let (s, _, v) = send(
        &second,
        "GET",
        "/console/api/teams",
        &[("cookie", &cookie)],
        "",
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    assert!(v.contains("\"green\""), "{v}");
    assert_eq!(
        csrf_of_page(&second, &ended).await,
        None,
        "a signed-out session stays ended"
    );
}
