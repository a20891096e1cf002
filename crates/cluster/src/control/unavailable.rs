//! What a control replica answers for a feature a cluster does not have yet: every `501`
//! the replica's own routes give (the server's "not implemented" answers, a node's refusal)
//! keeps its status and says plainly that the feature is not available on a kiln cluster yet
//! and that a single-host `kiln serve` has it. Traffic to a sandbox (its ports, envd, signed
//! file URLs) passes untouched: a sandbox's own 501 is its own.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

/// The largest 501 body read to rewrite (the API's error bodies are a few hundred bytes).
const MAX_BODY: usize = 64 * 1024;

/// Endings of the server's 501 messages, cut off to leave the feature's name.
const SUFFIXES: &[&str] = &[
    " is not implemented in kiln yet",
    " is not implemented by this isolation driver",
];

/// Qualifiers of the feature's name that say why one server lacks it, cut off too.
const QUALIFIERS: &[&str] = &[
    " in a cluster",
    " on a cluster node",
    " on a server without a state directory",
    " on a server without its identity key",
    " (no identity key)",
    " on a server without its interception CA (see the server log)",
];

/// How the server names its own `--audit off` in its refusals.
const SERVE_AUDIT_OFF: &str = "this server (kiln serve --audit off)";

/// The message of a cluster's 501 for the request `method path` whose answer said `original`.
pub fn message(method: &str, path: &str, original: &str) -> String {
    if original.contains("its kiln node runs with") {
        // A node's own refusal, naming the node and the setting to change: kept whole.
        return original.to_string();
    }
    if original.contains(SERVE_AUDIT_OFF) {
        // The replica's own log is off: its flag is named, not the single-host server's.
        return original.replace(SERVE_AUDIT_OFF, "this replica (kiln control --audit off)");
    }
    let feature = SUFFIXES
        .iter()
        .find_map(|s| original.strip_suffix(s))
        .map(|f| {
            QUALIFIERS
                .iter()
                .fold(f.to_string(), |f, q| f.replace(q, ""))
        });
    let feature = match feature {
        Some(f) if !f.trim().is_empty() => f,
        _ if path.contains("/audit") => "the audit log".to_string(),
        _ => format!("{method} {path}"),
    };
    format!("{feature} is not available on a kiln cluster yet (a single-host `kiln serve` has it)")
}

/// Whether `req` goes to a sandbox rather than to the replica's own routes, for a replica
/// whose sandbox host names are under `domain`.
pub(super) fn to_a_sandbox(req: &Request, domain: &str) -> bool {
    let routed = kiln_server::routing::target_of_request(req.headers(), req.uri(), domain);
    !matches!(routed, Ok(None)) || req.uri().path() == "/files"
}

/// The middleware (its state: the sandbox domain): a `501` JSON answer of the replica's own
/// routes gets [`message`] as its message.
pub async fn rewrite(State(domain): State<Arc<str>>, req: Request, next: Next) -> Response {
    if to_a_sandbox(&req, &domain) {
        return next.run(req).await;
    }
    let (method, path) = (req.method().to_string(), req.uri().path().to_string());
    let resp = next.run(req).await;
    let json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if resp.status() != StatusCode::NOT_IMPLEMENTED || !json {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, MAX_BODY).await else {
        return (parts.status, "").into_response();
    };
    let original = serde_json::from_slice::<serde_json::Value>(&bytes)
        .ok()
        .and_then(|v| v["message"].as_str().map(str::to_string))
        .unwrap_or_default();
    let body = serde_json::json!({
        "code": 501,
        "message": message(&method, &path, &original),
    });
    let mut resp = Response::from_parts(parts, Body::from(body.to_string()));
    resp.headers_mut().remove(header::CONTENT_LENGTH);
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sandbox_traffic_is_told_apart() {
        let req = |host: &str, path: &str| {
            Request::builder()
                .uri(path)
                .header("host", host)
                .body(Body::empty())
                .unwrap()
        };
        let d = "kiln.local";
        assert!(!to_a_sandbox(&req("127.0.0.1:3000", "/volumes"), d));
        assert!(to_a_sandbox(&req("8000-abc123.kiln.local", "/volumes"), d));
        assert!(to_a_sandbox(&req("127.0.0.1:3000", "/files"), d));
        let mut h = req("127.0.0.1:3000", "/anything");
        h.headers_mut()
            .insert("e2b-sandbox-id", "abc123".parse().unwrap());
        h.headers_mut()
            .insert("e2b-sandbox-port", "8000".parse().unwrap());
        assert!(to_a_sandbox(&h, d));
    }

    #[test]
    fn the_feature_is_named_and_the_single_host_server_pointed_to() {
        let m = message(
            "POST",
            "/volumes",
            "volumes in a cluster is not implemented by this isolation driver",
        );
        assert_eq!(
            m,
            "volumes is not available on a kiln cluster yet (a single-host `kiln serve` has it)"
        );
        let m = message(
            "GET",
            "/secrets",
            "secrets on a server without a state directory is not implemented in kiln yet",
        );
        assert!(
            m.starts_with("secrets is not available on a kiln cluster yet"),
            "{m}"
        );
        let m = message(
            "PUT",
            "/sandboxes/x/network",
            "network rules on a server without its interception CA (see the server log) \
             is not implemented in kiln yet",
        );
        assert_eq!(
            m,
            "network rules is not available on a kiln cluster yet (a single-host `kiln serve` \
             has it)"
        );
        let m = message("GET", "/sandboxes/x/audit", "the audit log is off");
        assert!(m.starts_with("the audit log is not available"), "{m}");
        let off = "the audit log is off on node n1 (its kiln node runs with --audit off)";
        assert_eq!(message("GET", "/sandboxes/x/audit", off), off);
        let own = kiln_server::audit::AuditError::Off.to_string();
        assert_eq!(
            message("GET", "/audit", &own),
            "the audit log is off on this replica (kiln control --audit off)"
        );
        let m = message(
            "GET",
            "/alerts",
            "alerts need the audit log, which is off on this server (kiln serve --audit off)",
        );
        assert_eq!(
            m,
            "alerts need the audit log, which is off on this replica (kiln control --audit off)"
        );
        let m = message("GET", "/v3/templates/x", "");
        assert!(m.starts_with("GET /v3/templates/x is not available"), "{m}");
    }
}
