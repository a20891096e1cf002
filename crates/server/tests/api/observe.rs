//! Events API cursors, the Prometheus endpoint's token and text, and webhook delivery
//! (signature, retry after a 500, delivery log, test call) through the real router, SQLite
//! store and a local HTTP receiver on 127.0.0.1. No sandbox is started (no runsc needed).

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode};
use kiln_server::api::{ApiConfig, AppState};
use kiln_server::obs::sign;
use kiln_server::obs::webhooks::WebhookConfig;
use kiln_server::templates::FixedTemplates;
use kiln_server::{LifecycleConfig, Manager};
use serde_json::Value;

struct Fixture {
    manager: Arc<Manager>,
    app: axum::Router,
    key: String,
    dir: tempfile::TempDir,
}

/// A fixture whose webhooks may reach the test's receivers on 127.0.0.1.
async fn fixture(metrics_token: Option<&str>) -> Fixture {
    fixture_with(metrics_token, true).await
}

async fn fixture_with(metrics_token: Option<&str>, allow_private: bool) -> Fixture {
    let dir = common::state_dir();
    let cfg = LifecycleConfig {
        webhooks: WebhookConfig {
            retry_base: Duration::from_millis(300),
            poll: Duration::from_millis(100),
            allow_private,
            sandbox_ranges: vec!["198.51.100.0/24".parse().unwrap()],
            ..WebhookConfig::default()
        },
        ..LifecycleConfig::default()
    };
    let manager = common::manager(
        dir.path(),
        common::driver(dir.path()),
        Arc::new(FixedTemplates::default()),
        cfg,
    );
    let (_, key) = common::app(manager.clone(), dir.path()).await;
    let app = kiln_server::front::router(Arc::new(AppState::new(
        manager.clone(),
        ApiConfig {
            domain: "kiln.test".into(),
            metrics_token: metrics_token.map(str::to_string),
        },
    )));
    Fixture {
        manager,
        app,
        key,
        dir,
    }
}

async fn call(f: &Fixture, method: &str, path: &str, body: Option<&str>) -> (StatusCode, Value) {
    common::call(&f.app, Some(&f.key), method, path, body, &[]).await
}

#[tokio::test]
async fn events_pages_follow_the_cursor_without_gaps_or_repeats() {
    let f = fixture(None).await;
    let store = common::store(f.dir.path());
    for i in 0..7 {
        store
            .add_event(&format!("s{}", i % 2), "created", &format!("e{i}"))
            .await
            .unwrap();
    }
    let mut seen = Vec::new();
    let mut cursor = String::new();
    for _ in 0..10 {
        let (st, v) = call(&f, "GET", &format!("/events?limit=3&cursor={cursor}"), None).await;
        assert_eq!(st, StatusCode::OK, "{v}");
        let events = v["events"].as_array().unwrap();
        seen.extend(
            events
                .iter()
                .map(|e| e["detail"].as_str().unwrap().to_string()),
        );
        cursor = v["nextCursor"].as_str().unwrap_or("").to_string();
        if events.is_empty() {
            break;
        }
    }
    let want: Vec<String> = (0..7).map(|i| format!("e{i}")).collect();
    assert_eq!(seen, want);
    // Polling at the end keeps the cursor; a new event shows up exactly once.
    store.add_event("s0", "paused", "late").await.unwrap();
    let (_, v) = call(&f, "GET", &format!("/events?cursor={cursor}"), None).await;
    assert_eq!(v["events"].as_array().unwrap().len(), 1);
    assert_eq!(v["events"][0]["type"], "paused");
    assert_eq!(v["events"][0]["sandboxID"], "s0");
    // Filters and bad input.
    let (_, v) = call(&f, "GET", "/events?sandboxId=s1&limit=100", None).await;
    assert_eq!(v["events"].as_array().unwrap().len(), 3);
    let (_, v) = call(&f, "GET", "/events?type=paused", None).await;
    assert_eq!(v["events"].as_array().unwrap().len(), 1);
    for bad in [
        "/events?limit=0",
        "/events?cursor=x",
        "/events?since=yesterday",
    ] {
        let (st, _) = call(&f, "GET", bad, None).await;
        assert_eq!(st, StatusCode::BAD_REQUEST, "{bad}");
    }
    let (st, _) = call(&f, "GET", "/sandboxes/nosuch/events", None).await;
    assert_eq!(st, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn prometheus_endpoint_needs_its_own_token() {
    let f = fixture(Some("prom-token-123")).await;
    let get = |auth: Option<&'static str>| {
        let app = f.app.clone();
        async move {
            let h: Vec<(&str, &str)> = auth.map(|a| ("authorization", a)).into_iter().collect();
            common::call(&app, None, "GET", "/metrics", None, &h).await
        }
    };
    assert_eq!(get(None).await.0, StatusCode::UNAUTHORIZED);
    assert_eq!(get(Some("Bearer wrong")).await.0, StatusCode::UNAUTHORIZED);
    // The API key is not the metrics token.
    let (st, _) = common::call(&f.app, Some(&f.key), "GET", "/metrics", None, &[]).await;
    assert_eq!(st, StatusCode::UNAUTHORIZED);
    let (st, body) = get(Some("Bearer prom-token-123")).await;
    assert_eq!(st, StatusCode::OK);
    let text = body.as_str().unwrap();
    for want in [
        "# TYPE kiln_sandboxes gauge",
        "kiln_sandboxes{state=\"running\",template=\"\"} 0",
        "kiln_lifecycle_duration_seconds_bucket{op=\"create\",le=\"+Inf\"} 0",
        "# TYPE kiln_proxy_requests_total counter",
        "kiln_egress_connections_total{verdict=\"denied\"}",
        "kiln_state_disk_free_bytes ",
    ] {
        assert!(text.contains(want), "missing {want:?} in\n{text}");
    }
    // Without a token configured the endpoint is off.
    let off = fixture(None).await;
    let (st, _) = common::call(&off.app, Some(&off.key), "GET", "/metrics", None, &[]).await;
    assert_eq!(st, StatusCode::NOT_FOUND);
}

/// A receiver that checks every signature and answers 500 to the first request.
#[derive(Clone, Default)]
struct Receiver {
    got: Arc<Mutex<Vec<(Value, bool, u16)>>>,
}

async fn receive(
    axum::extract::State(r): axum::extract::State<Receiver>,
    headers: HeaderMap,
    body: Bytes,
) -> StatusCode {
    let sig = headers
        .get(sign::SIGNATURE_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let now = chrono::Utc::now().timestamp();
    let valid = sign::verify(SECRET, sig, &body, now, 300).is_ok();
    let mut got = r.got.lock().unwrap();
    let status = if got.is_empty() { 500 } else { 200 };
    got.push((serde_json::from_slice(&body).unwrap(), valid, status));
    StatusCode::from_u16(status).unwrap()
}

const SECRET: &str = "a-test-secret-0123456789";

#[tokio::test]
async fn webhooks_are_signed_retried_logged_and_testable() {
    let f = fixture(None).await;
    let rx = Receiver::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    let app = axum::Router::new()
        .route("/hook", axum::routing::post(receive))
        .with_state(rx.clone());
    tokio::spawn(async move { axum::serve(listener, app).await });

    let body =
        serde_json::json!({"url": url, "secret": SECRET, "events": ["killed", "webhook.test"]});
    let (st, hook) = call(&f, "POST", "/webhooks", Some(&body.to_string())).await;
    assert_eq!(st, StatusCode::CREATED, "{hook}");
    let id = hook["id"].as_str().unwrap().to_string();
    assert_eq!(hook["secret"], SECRET);
    let (_, list) = call(&f, "GET", "/webhooks", None).await;
    assert_eq!(list.as_array().unwrap().len(), 1);
    assert!(list[0].get("secret").is_none(), "secrets are shown once");
    for bad in [
        r#"{"url": "ftp://x/"}"#,
        r#"{"url": "http://127.0.0.1/", "secret": "short"}"#,
        r#"{"url": "http://127.0.0.1/", "bogus": 1}"#,
    ] {
        assert_eq!(
            call(&f, "POST", "/webhooks", Some(bad)).await.0,
            StatusCode::BAD_REQUEST
        );
    }

    let _worker = f.manager.webhooks().spawn(f.manager.subscribe());
    let store = common::store(f.dir.path());
    store
        .add_event("sbx1", "paused", "not subscribed")
        .await
        .unwrap();
    store
        .add_event("sbx1", "killed", "killed by request")
        .await
        .unwrap();

    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while rx.got.lock().unwrap().len() < 2 {
        assert!(tokio::time::Instant::now() < deadline, "no retry arrived");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    {
        let got = rx.got.lock().unwrap();
        assert!(got.iter().all(|(_, valid, _)| *valid), "a bad signature");
        assert_eq!(got[0].0, got[1].0, "the retry carries the same payload");
        assert_eq!(got[0].0["type"], "sandbox.killed");
        assert_eq!(got[0].0["event"]["sandboxID"], "sbx1");
        assert_eq!((got[0].2, got[1].2), (500, 200));
    }
    // The delivery log shows both attempts.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let log = loop {
        let (st, log) = call(&f, "GET", &format!("/webhooks/{id}/deliveries"), None).await;
        assert_eq!(st, StatusCode::OK);
        if log["deliveries"][0]["status"] == "delivered" {
            break log;
        }
        assert!(tokio::time::Instant::now() < deadline, "{log}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let d = &log["deliveries"][0];
    assert_eq!(d["attempts"], 2);
    assert_eq!(d["lastStatusCode"], 200);
    assert_eq!(d["type"], "killed");
    assert_eq!(
        log["deliveries"].as_array().unwrap().len(),
        1,
        "paused is not subscribed"
    );

    // The test call answers with its first attempt.
    let (st, t) = call(&f, "POST", &format!("/webhooks/{id}/test"), None).await;
    assert_eq!(st, StatusCode::OK, "{t}");
    assert_eq!(t["status"], "delivered");
    assert_eq!(
        rx.got.lock().unwrap().last().unwrap().0["type"],
        "webhook.test"
    );

    assert_eq!(
        call(&f, "DELETE", &format!("/webhooks/{id}"), None).await.0,
        StatusCode::NO_CONTENT
    );
    assert_eq!(
        call(&f, "GET", &format!("/webhooks/{id}"), None).await.0,
        StatusCode::NOT_FOUND
    );
}

#[tokio::test]
async fn webhooks_to_private_addresses_are_refused_by_default() {
    let f = fixture_with(None, false).await;
    let rx = Receiver::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let app = axum::Router::new()
        .route("/hook", axum::routing::post(receive))
        .with_state(rx.clone());
    tokio::spawn(async move { axum::serve(listener, app).await });

    // Loopback (literal and by name), link-local (cloud metadata), private, the sandbox slot
    // range, IPv6 loopback and an IPv4-mapped loopback: 400, naming the operator's flag.
    for url in [
        format!("http://127.0.0.1:{port}/hook"),
        format!("http://localhost:{port}/hook"),
        "http://169.254.169.254/latest/meta-data".to_string(),
        "http://10.200.0.3:49983/".to_string(),
        "http://192.168.1.1/".to_string(),
        "http://198.51.100.9/".to_string(),
        "http://[::1]/".to_string(),
        "http://[::ffff:127.0.0.1]/".to_string(),
        "http://0.0.0.0/".to_string(),
    ] {
        let body = serde_json::json!({"url": url, "secret": SECRET});
        let (st, err) = call(&f, "POST", "/webhooks", Some(&body.to_string())).await;
        assert_eq!(st, StatusCode::BAD_REQUEST, "{url}: {err}");
        let msg = err["message"].as_str().unwrap_or_default();
        assert!(msg.contains("--webhook-allow-private"), "{url}: {err}");
    }
    // A public address registers (nothing is sent: no worker runs and no event is queued).
    let body = serde_json::json!({"url": "http://203.0.113.10/hook", "secret": SECRET});
    let (st, hook) = call(&f, "POST", "/webhooks", Some(&body.to_string())).await;
    assert_eq!(st, StatusCode::CREATED, "{hook}");
    let public = hook["id"].as_str().unwrap().to_string();
    assert_eq!(
        call(&f, "DELETE", &format!("/webhooks/{public}"), None)
            .await
            .0,
        StatusCode::NO_CONTENT
    );

    // A webhook stored before the filter (or whose name now points inside) is not delivered:
    // the delivery client's resolver drops private addresses, literal ones are refused.
    let (_, me) = call(&f, "GET", "/webhooks", None).await;
    assert_eq!(me.as_array().unwrap().len(), 0);
    let team = kiln_server::tenancy::DEFAULT_TEAM.to_string();
    let store = common::store(f.dir.path());
    let _worker = f.manager.webhooks().spawn(f.manager.subscribe());
    for (i, url) in [
        format!("http://localhost:{port}/hook"),
        format!("http://127.0.0.1:{port}/hook"),
    ]
    .into_iter()
    .enumerate()
    {
        let id = format!("wh_planted{i}");
        store
            .insert_webhook(&kiln_server::store::WebhookRecord {
                id: id.clone(),
                team: team.clone(),
                url: url.clone(),
                secret: SECRET.into(),
                events: vec![],
                created_at_ms: 0,
            })
            .await
            .unwrap();
        let (st, t) = call(&f, "POST", &format!("/webhooks/{id}/test"), None).await;
        assert_eq!(st, StatusCode::OK, "{url}: {t}");
        assert_ne!(t["status"], "delivered", "{url}: {t}");
        let err = t["lastError"].as_str().unwrap_or_default();
        assert!(err.contains("private"), "{url}: {t}");
    }
    assert!(
        rx.got.lock().unwrap().is_empty(),
        "a private receiver got a delivery"
    );
}
