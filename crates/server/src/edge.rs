//! The server's edges against hostile or broken clients: how connections are accepted and
//! served ([`serve`]: a cap on open connections, a header read timeout that also closes idle
//! keep-alive connections, a cap on header size) and what the API buffers ([`limit_api_body`]:
//! a size cap and a read deadline on every API request body, with or without Content-Length).
//!
//! Sandbox traffic through the proxy is not buffered beyond small bodies (see
//! [`crate::proxy`]): uploads stream into the sandbox, whose disk quota bounds them.
//!
//! With [`EdgeConfig::tls`] set, a connection that opens with a TLS handshake is served over
//! TLS (ALPN `h2`/`http/1.1`, see [`crate::tls`]) and any other as plain HTTP; requests that
//! came over TLS carry the [`Https`] extension.
//!
//! Answers: 413 (body too large), 408 (body too slow), 431 (headers too large, from hyper),
//! 503 + `Retry-After` (too many connections) — all JSON in E2B's error shape except 431,
//! which hyper writes before any request exists.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use tower::ServiceExt;

use crate::api::error::ApiError;

/// Largest API request body (a create with metadata and environment is a few KiB).
pub const API_BODY_LIMIT: usize = 1 << 20;
/// How long an API request body may take to arrive.
pub const API_BODY_TIMEOUT: Duration = Duration::from_secs(30);

/// Connection-level limits of `kiln serve`.
#[derive(Debug, Clone)]
pub struct EdgeConfig {
    /// Open connections at most; further ones get 503 and are closed.
    pub max_connections: usize,
    /// A request's headers must arrive within this time, and a keep-alive connection with no
    /// request is closed after it.
    pub header_timeout: Duration,
    /// Largest request head (request line and headers), bytes: beyond, 431.
    pub max_header_bytes: usize,
    /// TLS for clients that start a handshake (`--tls-cert`/`--tls-key`); None: plain only.
    pub tls: Option<Arc<rustls::ServerConfig>>,
}

/// Request extension: the request came over TLS.
#[derive(Debug, Clone, Copy)]
pub struct Https;

impl Default for EdgeConfig {
    fn default() -> Self {
        Self {
            max_connections: 4096,
            header_timeout: Duration::from_secs(30),
            max_header_bytes: 64 * 1024,
            tls: None,
        }
    }
}

/// Buffers an API request's body up to [`API_BODY_LIMIT`] within [`API_BODY_TIMEOUT`]: 413
/// beyond the size (whether or not the client sent Content-Length), 408 when too slow.
pub async fn limit_api_body(req: Request, next: Next) -> Response {
    let declared = req
        .headers()
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > API_BODY_LIMIT as u64) {
        return too_large();
    }
    let (parts, body) = req.into_parts();
    let read = tokio::time::timeout(
        API_BODY_TIMEOUT,
        Limited::new(body, API_BODY_LIMIT).collect(),
    )
    .await;
    let bytes = match read {
        Err(_) => {
            return ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                format!(
                    "the request body did not arrive within {}s",
                    API_BODY_TIMEOUT.as_secs()
                ),
            )
            .into_response()
        }
        Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => return too_large(),
        Ok(Err(e)) => {
            return ApiError::bad_request(format!("reading the request body: {e}")).into_response()
        }
        Ok(Ok(c)) => c.to_bytes(),
    };
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
}

fn too_large() -> Response {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        format!("request body larger than {API_BODY_LIMIT} bytes"),
    )
    .into_response()
}

/// The answer to a connection over [`EdgeConfig::max_connections`].
fn busy() -> Vec<u8> {
    let body = "{\"code\":503,\"message\":\"too many open connections to this server; retry\"}\n";
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         retry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Serves `app` on `listener` until the process ends, within `cfg`'s limits. HTTP/1.1 (with
/// upgrades, for WebSockets through the proxy) and HTTP/2.
pub async fn serve(listener: TcpListener, app: axum::Router, cfg: EdgeConfig) {
    let slots = Arc::new(tokio::sync::Semaphore::new(cfg.max_connections));
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(cfg.header_timeout)
        .max_buf_size(cfg.max_header_bytes.max(8192));
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(Some(Duration::from_secs(30)))
        .keep_alive_timeout(Duration::from_secs(20))
        .max_header_list_size(cfg.max_header_bytes as u32);
    let builder = Arc::new(builder);
    loop {
        let (mut stream, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                // Out of fds and the like: wait instead of spinning.
                tracing::warn!(error = %e, "accepting a connection");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            tokio::spawn(async move {
                let _ =
                    tokio::time::timeout(Duration::from_secs(2), stream.write_all(&busy())).await;
                let _ = stream.shutdown().await;
            });
            continue;
        };
        let _ = stream.set_nodelay(true);
        // Handlers that count per client (the console's sign-in limit) read the peer here.
        let app = app
            .clone()
            .map_request(move |mut r: Request<hyper::body::Incoming>| {
                r.extensions_mut().insert(axum::extract::ConnectInfo(peer));
                r
            });
        let builder = builder.clone();
        let (tls, handshake_timeout) = (cfg.tls.clone(), cfg.header_timeout);
        tokio::spawn(async move {
            let _slot = slot;
            let Some(tls) = tls else {
                return serve_conn(&builder, stream, app).await;
            };
            // A client that connects and says nothing is dropped like one whose headers are
            // late.
            let mut first = [0u8; 1];
            match tokio::time::timeout(handshake_timeout, stream.peek(&mut first)).await {
                Ok(Ok(1)) if first[0] == crate::tls::TLS_HANDSHAKE => {}
                Ok(Ok(1)) => return serve_conn(&builder, stream, app).await,
                _ => return,
            }
            let acceptor = tokio_rustls::TlsAcceptor::from(tls);
            match tokio::time::timeout(handshake_timeout, acceptor.accept(stream)).await {
                Ok(Ok(s)) => {
                    let app = app.map_request(|mut r: Request<hyper::body::Incoming>| {
                        r.extensions_mut().insert(Https);
                        r
                    });
                    serve_conn(&builder, s, app).await
                }
                Ok(Err(e)) => tracing::debug!(error = %e, "TLS handshake failed"),
                Err(_) => tracing::debug!("TLS handshake timed out"),
            }
        });
    }
}

/// Serves one connection (HTTP/1.1 with upgrades, or HTTP/2) until it ends.
async fn serve_conn<I, S>(builder: &auto::Builder<TokioExecutor>, io: I, svc: S)
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    S: tower::Service<Request<hyper::body::Incoming>, Response = Response> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: std::error::Error + Send + Sync + 'static,
{
    let conn =
        builder.serve_connection_with_upgrades(TokioIo::new(io), TowerToHyperService::new(svc));
    if let Err(e) = conn.await {
        tracing::debug!(error = %e, "connection ended with an error");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busy_answer_is_well_formed() {
        let b = busy();
        let text = std::str::from_utf8(&b).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(
            head.contains(&format!("content-length: {}", body.len())),
            "{text}"
        );
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["code"], 503);
    }
}
