//! The REST API's routes, auth and error shapes, through the real router, SQLite store and
//! driver (no sandbox is started, so no runsc is needed).

use crate::common;

use http::StatusCode;
use kiln_server::api;
use serde_json::Value;

use common::assert_error;

struct Fixture {
    app: axum::Router,
    key: String,
    _dir: tempfile::TempDir,
}

async fn fixture() -> Fixture {
    let dir = common::state_dir();
    let (app, key) = common::empty_app(dir.path()).await;
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
    let key = with_key.then_some(f.key.as_str());
    common::call(&f.app, key, method, path, body, headers).await
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
    let f = fixture().await;
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
    let f = fixture().await;
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
    let f = fixture().await;
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
        ("GET", "/sandboxes/metrics", None, 400),
        ("POST", "/v3/templates", Some("{}"), 501),
        ("GET", "/secrets", None, 501),
        ("GET", "/v2/sandboxes?state=frozen", None, 400),
        ("GET", "/v2/sandboxes?limit=x", None, 400),
        ("GET", "/v2/sandboxes?nextToken=%%%", None, 400),
        ("GET", "/v2/sandboxes?order=sideways", None, 400),
        ("GET", "/v2/sandboxes?limit=-5", None, 400),
        ("GET", "/v2/sandboxes?limit=1001", None, 400),
        ("GET", "/v2/sandboxes?nextToken=%ff%fe", None, 400),
        ("GET", "/sandboxes?limit=-5&nextToken=%ff%fe", None, 400),
        ("GET", "/sandboxes?limit=-5", None, 400),
        ("GET", "/sandboxes?nextToken=bm90LWEtY3Vyc29y", None, 400),
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
    let f = fixture().await;
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
