//! HTTP requests to a router in the process (no socket): what the console and API
//! router-level tests send.

use std::net::SocketAddr;

use axum::body::Body;
use axum::extract::ConnectInfo;
use http::{header, Request, StatusCode};
use http_body_util::BodyExt;
use tower::ServiceExt;

/// One request from `peer`: status, headers and the body as text.
pub async fn send_from(
    app: &axum::Router,
    peer: Option<&str>,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (StatusCode, http::HeaderMap, String) {
    let mut b = Request::builder().method(method).uri(path);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let mut req = b.body(Body::from(body.to_string())).unwrap();
    if let Some(p) = peer {
        let addr: SocketAddr = p.parse().unwrap();
        req.extensions_mut().insert(ConnectInfo(addr));
    }
    let resp = app.clone().oneshot(req).await.unwrap();
    let (s, h) = (resp.status(), resp.headers().clone());
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (s, h, String::from_utf8_lossy(&bytes).into_owned())
}

/// One request: status, headers and the body as text.
pub async fn send(
    app: &axum::Router,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (StatusCode, http::HeaderMap, String) {
    send_from(app, None, method, path, headers, body).await
}

pub const FORM: (&str, &str) = ("content-type", "application/x-www-form-urlencoded");
pub const JSON: (&str, &str) = ("content-type", "application/json");

/// The CSRF token on the app page `cookie` opens, or None (the sign-in page).
pub async fn csrf_of_page(app: &axum::Router, cookie: &str) -> Option<String> {
    let (s, _, page) = send(app, "GET", "/console", &[("cookie", cookie)], "").await;
    assert_eq!(s, StatusCode::OK);
    page.split(r#"name="kiln-csrf" content=""#)
        .nth(1)
        .and_then(|r| r.split('"').next())
        .map(str::to_string)
}

/// Signs in to the console with `key`: the `Cookie` header value and the page's CSRF token
/// (the cookie's attributes and the token's length checked).
pub async fn sign_in(app: &axum::Router, key: &str) -> (String, String) {
    let (s, h, body) = send(
        app,
        "POST",
        "/console/login",
        &[FORM],
        &format!("key={key}"),
    )
    .await;
    assert_eq!(s, StatusCode::SEE_OTHER, "{body}");
    let set = h[header::SET_COOKIE].to_str().unwrap().to_string();
    for attr in ["HttpOnly", "SameSite=Strict", "Path=/console"] {
        assert!(set.contains(attr), "{set}");
    }
    let cookie = set.split(';').next().unwrap().to_string();
    let csrf = csrf_of_page(app, &cookie)
        .await
        .expect("the app page carries the CSRF token");
    assert_eq!(csrf.len(), 64);
    (cookie, csrf)
}
