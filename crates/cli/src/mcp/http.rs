//! `kiln mcp --http ADDR`: the MCP server over streamable HTTP (rmcp's tower service at
//! `/mcp`) behind an API key check. Every request carries a kiln API key
//! (`Authorization: Bearer KEY` or `X-API-Key: KEY`); the key is checked against the kiln
//! server (remembered for a minute) and the calls of that request act with it. No key, or one
//! kiln refuses: 401 with `WWW-Authenticate: Bearer`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::{StreamableHttpServerConfig, StreamableHttpService};
use tokio_util::sync::CancellationToken;

use super::server::{CallerKey, KilnMcp};
use crate::client::{Client, ClientError};

/// How long a key kiln accepted is taken as valid without asking again.
const KEY_TTL: Duration = Duration::from_secs(60);
/// Keys remembered at most (the oldest are forgotten first).
const MAX_KEYS: usize = 1024;

struct Auth {
    client: Client,
    valid: Mutex<HashMap<String, Instant>>,
}

fn key_of(h: &HeaderMap) -> Option<String> {
    let bearer = h
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (scheme, rest) = v.split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| rest.trim())
        })
        .filter(|k| !k.is_empty());
    let header = || {
        h.get("x-api-key")
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|k| !k.is_empty())
    };
    bearer.or_else(header).map(str::to_string)
}

fn refuse(status: StatusCode, message: &str) -> Response {
    let body = serde_json::json!({ "error": message });
    let mut r = (status, axum::Json(body)).into_response();
    if status == StatusCode::UNAUTHORIZED {
        r.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            header::HeaderValue::from_static("Bearer realm=\"kiln\""),
        );
    }
    r
}

impl Auth {
    /// Whether kiln accepts `key` (asking it at most once a minute per key).
    async fn check(&self, key: &str) -> Result<(), Response> {
        let now = Instant::now();
        {
            let mut valid = self.valid.lock().unwrap_or_else(|p| p.into_inner());
            match valid.get(key) {
                Some(t) if now.duration_since(*t) < KEY_TTL => return Ok(()),
                Some(_) => {
                    valid.remove(key);
                }
                None => {}
            }
        }
        let probe = self.client.with_key(Some(key.to_string()));
        match probe.get_json("/v2/sandboxes?limit=1").await {
            Ok(_) => {
                let mut valid = self.valid.lock().unwrap_or_else(|p| p.into_inner());
                if valid.len() >= MAX_KEYS {
                    if let Some(old) = valid
                        .iter()
                        .min_by_key(|(_, t)| **t)
                        .map(|(k, _)| k.clone())
                    {
                        valid.remove(&old);
                    }
                }
                valid.insert(key.to_string(), now);
                Ok(())
            }
            Err(ClientError::Api {
                status: 401 | 403,
                message,
            }) => Err(refuse(
                StatusCode::UNAUTHORIZED,
                &format!("kiln refused the API key: {message}"),
            )),
            Err(e) => Err(refuse(
                StatusCode::BAD_GATEWAY,
                &format!("cannot check the API key with kiln: {e}"),
            )),
        }
    }
}

async fn authenticate(State(auth): State<Arc<Auth>>, mut req: Request, next: Next) -> Response {
    let Some(key) = key_of(req.headers()) else {
        return refuse(
            StatusCode::UNAUTHORIZED,
            "a kiln API key is required: send `Authorization: Bearer <key>` (or X-API-Key)",
        );
    };
    if let Err(r) = auth.check(&key).await {
        return r;
    }
    req.extensions_mut().insert(CallerKey(key));
    next.run(req).await
}

/// Serves MCP at `http://ADDR/mcp` until SIGINT or SIGTERM.
pub async fn serve(
    addr: SocketAddr,
    client: Client,
    allow_hosts: Vec<String>,
) -> anyhow::Result<()> {
    let handler = KilnMcp::new(client.with_key(None));
    let ct = CancellationToken::new();
    let mut hosts = vec!["localhost".to_string(), "127.0.0.1".into(), "::1".into()];
    hosts.push(addr.ip().to_string());
    hosts.extend(allow_hosts);
    let config = StreamableHttpServerConfig::default()
        .with_allowed_hosts(hosts)
        .with_cancellation_token(ct.child_token());
    let mcp = StreamableHttpService::new(
        move || Ok(handler.clone()),
        Arc::new(LocalSessionManager::default()),
        config,
    );
    let auth = Arc::new(Auth {
        client,
        valid: Mutex::new(HashMap::new()),
    });
    let app = axum::Router::new()
        .nest_service("/mcp", mcp)
        .layer(axum::middleware::from_fn_with_state(auth, authenticate));
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("listening on {addr}"))?;
    let local = listener.local_addr()?;
    eprintln!("kiln mcp: serving MCP (streamable HTTP) at http://{local}/mcp");
    let stop = ct.clone();
    tokio::spawn(async move {
        use tokio::signal::unix::{signal, SignalKind};
        if let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
        stop.cancel();
    });
    axum::serve(listener, app)
        .with_graceful_shutdown(async move { ct.cancelled_owned().await })
        .await
        .context("serving MCP over HTTP")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_come_from_bearer_or_x_api_key() {
        let mut h = HeaderMap::new();
        assert_eq!(key_of(&h), None);
        h.insert(header::AUTHORIZATION, "Bearer e2b_abc".parse().unwrap());
        assert_eq!(key_of(&h).as_deref(), Some("e2b_abc"));
        h.insert(header::AUTHORIZATION, "Basic xyz".parse().unwrap());
        assert_eq!(key_of(&h), None);
        h.insert("x-api-key", "e2b_def".parse().unwrap());
        assert_eq!(key_of(&h).as_deref(), Some("e2b_def"));
        h.insert(header::AUTHORIZATION, "bearer  ".parse().unwrap());
        assert_eq!(key_of(&h).as_deref(), Some("e2b_def"));
    }

    #[tokio::test]
    async fn requests_without_a_key_get_401() {
        let auth = Arc::new(Auth {
            client: Client::new("http://127.0.0.1:9", None).unwrap(),
            valid: Mutex::new(HashMap::new()),
        });
        let app = axum::Router::new()
            .route("/mcp", axum::routing::post(|| async { "reached" }))
            .layer(axum::middleware::from_fn_with_state(auth, authenticate));
        let req = Request::post("/mcp")
            .body(axum::body::Body::empty())
            .unwrap();
        let resp = tower::ServiceExt::oneshot(app, req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
        assert!(resp.headers()[header::WWW_AUTHENTICATE]
            .to_str()
            .unwrap()
            .starts_with("Bearer"));
    }
}
