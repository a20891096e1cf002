//! HTTP server (HTTP/1.1 and h2c): routing, `/init`, `/health`, `/metrics`, `/envs` and the
//! dispatch of Connect calls to the process and filesystem services.

use std::convert::Infallible;
use std::sync::Arc;

use http::{header, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use kiln_proto::connect::Code;
use kiln_proto::envd::InitRequest;
use tokio::io::{AsyncRead, AsyncWrite};

use crate::auth::caller;
use crate::process_rpc;
use crate::reply::{api_error, json_response};
use crate::rpc::{self, Body, CallKind, RpcError};
use crate::state::Agent;
use crate::users;

/// Serve one connection (HTTP/1.1 or h2c prior knowledge).
pub async fn serve_conn<IO>(agent: Arc<Agent>, io: IO)
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let svc = hyper::service::service_fn(move |req| {
        let agent = agent.clone();
        async move { Ok::<_, Infallible>(handle(agent, req).await) }
    });
    let mut b = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    b.http1().keep_alive(true);
    b.http2().max_concurrent_streams(1000);
    // With upgrades: kiln's forwarding to servers bound to localhost ([`crate::forward`]).
    if let Err(e) = b
        .serve_connection_with_upgrades(TokioIo::new(io), svc)
        .await
    {
        tracing::debug!("connection ended: {e}");
    }
}

/// Route one request.
pub async fn handle(agent: Arc<Agent>, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    tracing::debug!(%method, %path, "request");
    if path == "/health" {
        return Response::builder()
            .status(StatusCode::NO_CONTENT)
            .body(rpc::empty())
            .expect("valid response");
    }
    if path == crate::control::DETACH_PATH {
        return crate::control::handle_detach(&method);
    }
    if path == crate::forward::PATH && method == Method::GET {
        return crate::forward::handle(req).await;
    }
    let token_ok = agent.token_ok(&req);
    if path == "/files" {
        return crate::files::handle(agent, req, token_ok).await;
    }
    if !token_ok {
        // What the client is sending is read first (bounded in size and time): a refusal
        // sent and its connection closed mid-body breaks the client's write, and it sees a
        // broken pipe instead of the refusal.
        let _ = tokio::time::timeout(
            std::time::Duration::from_millis(200),
            rpc::read_body(req.into_body(), 1 << 16),
        )
        .await;
        if path.starts_with("/process.") || path.starts_with("/filesystem.") {
            return rpc::error_response(&RpcError::new(
                Code::Unauthenticated,
                "missing or invalid X-Access-Token",
            ));
        }
        return api_error(
            StatusCode::UNAUTHORIZED,
            "missing or invalid X-Access-Token",
        );
    }
    match (&method, path.as_str()) {
        (&Method::POST, "/init") => init(agent, req).await,
        (&Method::GET, "/envs") => json_response(&agent.init_state().env_vars),
        (&Method::GET, "/metrics") => json_response(&crate::metrics::sample().await),
        (_, p)
            if p.starts_with("/process.Process/") || p.starts_with("/filesystem.Filesystem/") =>
        {
            if method != Method::POST {
                return rpc::error_response(&RpcError::new(
                    Code::Unimplemented,
                    format!("{p} must be called with POST"),
                ));
            }
            connect_call(agent, req, p.to_string()).await
        }
        _ => api_error(
            StatusCode::NOT_FOUND,
            format!("no route for {method} {path}"),
        ),
    }
}

async fn init(agent: Arc<Agent>, req: Request<Incoming>) -> Response<Body> {
    let body = match rpc::read_body(req.into_body(), 1 << 20).await {
        Ok(b) => b,
        Err(e) => return api_error(StatusCode::BAD_REQUEST, e.message),
    };
    let r: InitRequest = if body.iter().all(u8::is_ascii_whitespace) {
        InitRequest::default()
    } else {
        match serde_json::from_slice(&body) {
            Ok(r) => r,
            Err(e) => {
                return api_error(
                    StatusCode::BAD_REQUEST,
                    format!("malformed /init JSON: {e}"),
                )
            }
        }
    };
    if let Some(u) = r.default_user.as_deref().filter(|u| !u.is_empty()) {
        if let Err(e) = users::lookup(u) {
            return api_error(StatusCode::BAD_REQUEST, format!("defaultUser: {e}"));
        }
    }
    if let Some(ts) = r.timestamp.as_deref() {
        crate::metrics::maybe_set_clock(ts);
    }
    if let Some(cas) = r.extra_cas.filter(|c| !c.is_empty()) {
        let installed = tokio::task::spawn_blocking(move || {
            crate::trust::install(std::path::Path::new("/"), &cas)
        })
        .await;
        if let Err(e) = installed
            .map_err(|e| e.to_string())
            .and_then(|r| r.map_err(|e| e.to_string()))
        {
            return api_error(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("installing the extra CA certificates: {e}"),
            );
        }
    }
    {
        let mut s = agent.init.write().unwrap_or_else(|p| p.into_inner());
        if let Some(env) = r.env_vars {
            s.env_vars.extend(env);
        }
        if let Some(t) = r.access_token {
            s.access_token = if t.is_empty() { None } else { Some(t) };
        }
        if let Some(u) = r.default_user {
            s.default_user = Some(u);
        }
        if let Some(w) = r.default_workdir {
            s.default_workdir = Some(w);
        }
    }
    Response::builder()
        .status(StatusCode::NO_CONTENT)
        .body(rpc::empty())
        .expect("valid response")
}

async fn connect_call(agent: Arc<Agent>, req: Request<Incoming>, path: String) -> Response<Body> {
    let Some(kind) = rpc::call_kind(req.headers()) else {
        let ct = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("none")
            .to_string();
        return Response::builder()
            .status(StatusCode::UNSUPPORTED_MEDIA_TYPE)
            .header(header::CONTENT_TYPE, "application/json")
            .body(rpc::full(format!(
                "{{\"code\":\"invalid_argument\",\"message\":\"unsupported content type {ct:?}; use application/json, application/proto or application/connect+json|proto\"}}"
            )))
            .expect("valid response");
    };
    let method = path.rsplit('/').next().unwrap_or("").to_string();
    let service = if path.starts_with("/process.") {
        "process"
    } else {
        "filesystem"
    };
    let streaming = matches!(
        (service, method.as_str()),
        ("process", "Start" | "Connect" | "StreamInput") | ("filesystem", "WatchDir")
    );
    let known = match service {
        "process" => matches!(
            method.as_str(),
            "Start"
                | "Connect"
                | "List"
                | "SendInput"
                | "StreamInput"
                | "SendSignal"
                | "CloseStdin"
                | "Update"
        ),
        _ => matches!(
            method.as_str(),
            "Stat"
                | "MakeDir"
                | "Move"
                | "ListDir"
                | "Remove"
                | "WatchDir"
                | "CreateWatcher"
                | "GetWatcherEvents"
                | "RemoveWatcher"
        ),
    };
    let codec = match kind {
        CallKind::Unary(c) | CallKind::Stream(c) => c,
    };
    if !known {
        let e = RpcError::new(Code::Unimplemented, format!("unknown RPC {path}"));
        return match kind {
            CallKind::Stream(c) => rpc::stream_error(c, e),
            CallKind::Unary(_) => rpc::error_response(&e),
        };
    }
    if streaming != matches!(kind, CallKind::Stream(_)) {
        let e = RpcError::invalid(format!(
            "{path} is {}; wrong content type for it",
            if streaming {
                "a streaming RPC"
            } else {
                "a unary RPC"
            }
        ));
        return match kind {
            CallKind::Stream(c) => rpc::stream_error(c, e),
            CallKind::Unary(_) => rpc::error_response(&e),
        };
    }
    let user = match caller(&agent, &req) {
        Ok(u) => u,
        Err(e) => {
            return if streaming {
                rpc::stream_error(codec, e)
            } else {
                rpc::error_response(&e)
            };
        }
    };
    let headers = req.headers().clone();
    if streaming {
        let reader = rpc::EnvelopeReader::new(req.into_body(), codec);
        return process_rpc::stream(agent, codec, &headers, user, reader, service, &method).await;
    }
    let body = match rpc::read_body(req.into_body(), rpc::MAX_MESSAGE).await {
        Ok(b) => b,
        Err(e) => return rpc::error_response(&e),
    };
    match service {
        "process" => process_rpc::unary(agent, codec, &method, &body).await,
        _ => crate::fsrpc::unary(agent, codec, user, &method, &body).await,
    }
}
