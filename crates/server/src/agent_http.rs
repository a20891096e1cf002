//! A minimal HTTP/1.1 client for a sandbox agent behind a host Unix socket: used by the envd
//! proxy (streaming, upgrades) and by the server itself (`/health`, `/init`, `/metrics`).

use std::path::Path;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;

#[derive(Debug, thiserror::Error)]
pub enum AgentHttpError {
    #[error("connecting to the agent socket {path}: {source}")]
    Connect {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("talking to the agent: {0}")]
    Http(#[from] hyper::Error),
    #[error("building the request to the agent: {0}")]
    Build(#[from] http::Error),
    #[error("agent answered {status} to {what}: {body}")]
    Status {
        what: String,
        status: u16,
        body: String,
    },
    #[error("agent answered invalid JSON to {what}: {err}")]
    Json { what: String, err: String },
}

/// Sends one request over a fresh connection to the agent socket. The connection task keeps
/// running until the response (or the upgraded stream) is done.
pub async fn send<B>(socket: &Path, req: Request<B>) -> Result<Response<Incoming>, AgentHttpError>
where
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let stream = UnixStream::connect(socket)
        .await
        .map_err(|source| AgentHttpError::Connect {
            path: socket.display().to_string(),
            source,
        })?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!(error = %e, "agent connection ended with an error");
        }
    });
    Ok(sender.send_request(req).await?)
}

async fn simple(
    socket: &Path,
    method: http::Method,
    path: &str,
    json: Option<Vec<u8>>,
    token: Option<&str>,
) -> Result<(u16, Bytes), AgentHttpError> {
    let mut b = Request::builder()
        .method(method)
        .uri(path)
        .header(http::header::HOST, "localhost");
    if json.is_some() {
        b = b.header(http::header::CONTENT_TYPE, "application/json");
    }
    if let Some(t) = token {
        b = b.header("x-access-token", t);
    }
    let req = b.body(Full::new(Bytes::from(json.unwrap_or_default())))?;
    let resp = send(socket, req).await?;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await?.to_bytes();
    Ok((status, body))
}

/// `GET /health` answered 2xx.
pub async fn healthy(socket: &Path) -> bool {
    matches!(
        tokio::time::timeout(
            Duration::from_secs(2),
            simple(socket, http::Method::GET, "/health", None, None)
        )
        .await,
        Ok(Ok((s, _))) if (200..300).contains(&s)
    )
}

/// Polls `/health` until it answers or `timeout` passes.
pub async fn wait_ready(socket: &Path, timeout: Duration) -> bool {
    let start = Instant::now();
    let mut delay = Duration::from_millis(2);
    loop {
        if socket.exists() && healthy(socket).await {
            return true;
        }
        if start.elapsed() >= timeout {
            return false;
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_millis(10));
    }
}

/// `POST /init`.
pub async fn init(
    socket: &Path,
    body: &kiln_proto::envd::InitRequest,
    token: Option<&str>,
) -> Result<(), AgentHttpError> {
    let json = serde_json::to_vec(body).map_err(|e| AgentHttpError::Json {
        what: "/init".into(),
        err: e.to_string(),
    })?;
    let (status, body) = simple(socket, http::Method::POST, "/init", Some(json), token).await?;
    if !(200..300).contains(&status) {
        return Err(AgentHttpError::Status {
            what: "POST /init".into(),
            status,
            body: String::from_utf8_lossy(&body).into_owned(),
        });
    }
    Ok(())
}

/// `GET /metrics`.
pub async fn metrics(
    socket: &Path,
    token: Option<&str>,
) -> Result<kiln_proto::envd::Metrics, AgentHttpError> {
    let (status, body) = simple(socket, http::Method::GET, "/metrics", None, token).await?;
    if !(200..300).contains(&status) {
        return Err(AgentHttpError::Status {
            what: "GET /metrics".into(),
            status,
            body: String::from_utf8_lossy(&body).into_owned(),
        });
    }
    serde_json::from_slice(&body).map_err(|e| AgentHttpError::Json {
        what: "/metrics".into(),
        err: e.to_string(),
    })
}
