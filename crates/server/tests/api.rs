//! The REST API's routes, auth and error shapes, through the real router, SQLite store and
//! driver (no sandbox is started, so no runsc is needed).

use std::sync::Arc;

use axum::body::Body;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use kiln_server::api::{self, ApiConfig, AppState};
use kiln_server::driver::gvisor::{GvisorConfig, GvisorDriver};
use kiln_server::store::Store;
use kiln_server::templates::FixedTemplates;
use kiln_server::{auth, LifecycleConfig, Manager};
use serde_json::Value;
use tower::ServiceExt;

struct Fixture {
    app: axum::Router,
    key: String,
    _dir: tempfile::TempDir,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(Store::open(&dir.path().join("kiln.db")).unwrap());
    let key = auth::create_key(&store, "test").unwrap().secret;
    let driver = Arc::new(GvisorDriver::new(GvisorConfig::new(dir.path())).unwrap());
    let manager = Manager::new(
        LifecycleConfig::default(),
        store,
        driver,
        Arc::new(FixedTemplates::default()),
    );
    let app = api::router(Arc::new(AppState {
        manager,
        cfg: ApiConfig {
            domain: "kiln.test".into(),
        },
    }));
    Fixture {
        app,
        key,
        _dir: dir,
    }
}

async fn call(
    f: &Fixture,
    method: &str,
    path: &str,
    body: Option<&str>,
    headers: &[(&str, &str)],
    with_key: bool,
) -> (StatusCode, Value) {
    let mut b = Request::builder().method(method).uri(path);
    if with_key {
        b = b.header("X-API-Key", &f.key);
    }
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    if body.is_some() {
        b = b.header("content-type", "application/json");
    }
    let req = b.body(Body::from(body.unwrap_or("").to_string())).unwrap();
    let resp = f.app.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let v = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into()))
    };
    (status, v)
}

fn assert_error(status: StatusCode, v: &Value, want: u16) {
    assert_eq!(status.as_u16(), want, "body: {v}");
    assert_eq!(v["code"].as_u64(), Some(u64::from(want)), "body: {v}");
    assert!(
        v["message"].as_str().is_some_and(|m| !m.is_empty()),
        "body: {v}"
    );
}

#[test]
fn openapi_parses_and_lists_every_route() {
    let doc: Value = serde_json::from_str(api::OPENAPI).expect("openapi.json is valid JSON");
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."));
    let mut documented = std::collections::BTreeSet::new();
    for (path, ops) in doc["paths"].as_object().unwrap() {
        for method in ops.as_object().unwrap().keys() {
            documented.insert((method.to_uppercase(), path.clone()));
        }
    }
    let served: std::collections::BTreeSet<(String, String)> = api::ROUTES
        .iter()
        .map(|(m, p)| (m.to_string(), p.to_string()))
        .collect();
    assert_eq!(documented, served, "openapi.json and api::ROUTES differ");
}

#[tokio::test]
async fn every_listed_route_is_served() {
    let f = fixture();
    for (method, path) in api::ROUTES {
        let concrete = path
            .replace("{sandboxID}", "nosuchsandbox")
            .replace("{templateID}", "nosuchtemplate");
        let body = (*method != "GET" && *method != "DELETE").then_some("{}");
        let (status, v) = call(&f, method, &concrete, body, &[], true).await;
        let msg = v["message"].as_str().unwrap_or("");
        assert!(
            !msg.starts_with("unknown route") && status != StatusCode::METHOD_NOT_ALLOWED,
            "{method} {path} is not routed: {status} {v}"
        );
        assert!(
            status != StatusCode::INTERNAL_SERVER_ERROR,
            "{method} {path}: {v}"
        );
    }
}

#[tokio::test]
async fn auth_is_required_and_errors_are_json() {
    let f = fixture();
    let (s, v) = call(&f, "GET", "/sandboxes", None, &[], false).await;
    assert_error(s, &v, 401);
    let (s, v) = call(
        &f,
        "GET",
        "/sandboxes",
        None,
        &[("X-API-Key", "e2b_bad")],
        false,
    )
    .await;
    assert_error(s, &v, 401);
    let (s, v) = call(
        &f,
        "GET",
        "/templates",
        None,
        &[("Authorization", "Bearer e2b_bad")],
        false,
    )
    .await;
    assert_error(s, &v, 401);
    // Unknown routes need auth too, then answer JSON.
    let (s, v) = call(&f, "GET", "/nope", None, &[], false).await;
    assert_error(s, &v, 401);
    let (s, v) = call(&f, "GET", "/nope", None, &[], true).await;
    assert_error(s, &v, 404);
    let (s, _) = call(&f, "GET", "/health", None, &[], false).await;
    assert_eq!(s, StatusCode::OK);
    let (s, v) = call(&f, "GET", "/sandboxes", None, &[], true).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v, Value::Array(vec![]));
}

#[tokio::test]
async fn bad_input_gets_the_right_status() {
    let f = fixture();
    let cases: &[(&str, &str, Option<&str>, u16)] = &[
        ("POST", "/sandboxes", Some("{\"templateID\": "), 400),
        ("POST", "/sandboxes", Some(""), 400),
        ("POST", "/sandboxes", Some("[]"), 400),
        ("POST", "/sandboxes", Some("{\"timeout\": 5}"), 400),
        (
            "POST",
            "/sandboxes",
            Some("{\"templateID\":\"base\",\"timeout\":-1}"),
            400,
        ),
        (
            "POST",
            "/sandboxes",
            Some("{\"templateID\":\"base\",\"timeout\":0}"),
            400,
        ),
        (
            "POST",
            "/sandboxes",
            Some("{\"templateID\":\"base\",\"timeout\":99999999999}"),
            400,
        ),
        (
            "POST",
            "/sandboxes",
            Some("{\"templateID\":\"base\",\"timeout\":1e40}"),
            400,
        ),
        (
            "POST",
            "/v2/sandboxes",
            Some("{\"templateID\":\"nosuch\"}"),
            404,
        ),
        (
            "POST",
            "/sandboxes",
            Some("{\"templateID\":\"base\",\"allow_internet_access\":true}"),
            501,
        ),
        ("GET", "/sandboxes/abc", None, 404),
        ("DELETE", "/sandboxes/abc", None, 404),
        (
            "POST",
            "/sandboxes/abc/timeout",
            Some("{\"timeout\":10}"),
            404,
        ),
        (
            "POST",
            "/sandboxes/abc/timeout",
            Some("{\"timeout\":-10}"),
            400,
        ),
        ("POST", "/sandboxes/abc/timeout", Some("nope"), 400),
        (
            "POST",
            "/sandboxes/abc/connect",
            Some("{\"timeout\":10}"),
            404,
        ),
        ("POST", "/v2/sandboxes/abc/connect", Some(""), 404),
        ("GET", "/sandboxes/abc/logs", None, 404),
        ("GET", "/sandboxes/abc/metrics", None, 404),
        ("POST", "/sandboxes/abc/pause", Some("{}"), 404),
        ("GET", "/sandboxes/metrics", None, 501),
        ("POST", "/v3/templates", Some("{}"), 501),
        ("GET", "/secrets", None, 501),
        ("GET", "/v2/sandboxes?state=frozen", None, 400),
        ("GET", "/v2/sandboxes?limit=x", None, 400),
        ("GET", "/v2/sandboxes?nextToken=%%%", None, 400),
        ("GET", "/v2/sandboxes?order=sideways", None, 400),
        ("GET", "/sandboxes?metadata=novalue", None, 400),
        ("PATCH", "/sandboxes", Some("{}"), 405),
        ("GET", "/templates/nosuch", None, 404),
    ];
    for (m, p, b, want) in cases {
        let (s, v) = call(&f, m, p, *b, &[], true).await;
        assert_error(s, &v, *want);
    }
    let (s, v) = call(
        &f,
        "GET",
        "/v2/sandboxes?state=running,paused&limit=5&order=desc",
        None,
        &[],
        true,
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
}

#[tokio::test]
async fn proxy_routing_errors() {
    let f = fixture();
    // Unknown sandbox by header and by host: 502 like E2B's proxy, JSON, no API key needed.
    let (s, v) = call(
        &f,
        "GET",
        "/health",
        None,
        &[("E2b-Sandbox-Id", "ghost"), ("E2b-Sandbox-Port", "49983")],
        false,
    )
    .await;
    assert_error(s, &v, 502);
    assert_eq!(v["sandboxId"], "ghost");
    let (s, v) = call(
        &f,
        "GET",
        "/health",
        None,
        &[("Host", "49983-ghost.kiln.test")],
        false,
    )
    .await;
    assert_error(s, &v, 502);
    // A host under another domain is an API request (needs a key).
    let (s, v) = call(
        &f,
        "GET",
        "/sandboxes",
        None,
        &[("Host", "49983-ghost.other.test")],
        false,
    )
    .await;
    assert_error(s, &v, 401);
    let (s, v) = call(
        &f,
        "GET",
        "/",
        None,
        &[("E2b-Sandbox-Id", "ghost"), ("E2b-Sandbox-Port", "port")],
        false,
    )
    .await;
    assert_error(s, &v, 400);
    let (s, v) = call(&f, "GET", "/", None, &[("E2b-Sandbox-Port", "80")], false).await;
    assert_error(s, &v, 400);
}

#[test]
fn metadata_filter_parsing() {
    let m = api::parse_metadata_filter("a%3Db=c%26d&x=y+z").unwrap();
    assert_eq!(m.get("a=b").map(String::as_str), Some("c&d"));
    assert_eq!(m.get("x").map(String::as_str), Some("y z"));
    assert!(api::parse_metadata_filter("k=%zz").is_err());
    assert!(api::parse_metadata_filter("").unwrap().is_empty());
}
