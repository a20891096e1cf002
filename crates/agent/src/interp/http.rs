//! The HTTP API `e2b-code-interpreter` speaks to on port 49999: `GET /health`,
//! `POST /execute` (NDJSON stream), `POST/GET /contexts`, `DELETE /contexts/{id}`,
//! `POST /contexts/{id}/restart`.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http::{header, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde::Deserialize;
use serde_json::{json, Map, Value};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::mpsc;

use super::contexts::{Context, Contexts, Language};
use super::output::Event;
use crate::rpc::{full, read_body, Body};

const BODY_LIMIT: usize = 64 << 20;

/// Serve one connection.
pub async fn serve_conn<IO>(ctxs: Arc<Contexts>, io: IO)
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let svc = hyper::service::service_fn(move |req| {
        let ctxs = ctxs.clone();
        async move { Ok::<_, Infallible>(handle(ctxs, req).await) }
    });
    let mut b = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    b.http1().keep_alive(true);
    if let Err(e) = b.serve_connection(TokioIo::new(io), svc).await {
        tracing::debug!("interp connection ended: {e}");
    }
}

fn json_response(status: StatusCode, v: &Value) -> Response<Body> {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .body(full(v.to_string()))
        .expect("static response parts are valid")
}

fn error(status: StatusCode, msg: &str) -> Response<Body> {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "text/plain; charset=utf-8")
        .body(full(msg.to_string()))
        .expect("static response parts are valid")
}

async fn json_body<T: for<'de> Deserialize<'de> + Default>(
    req: Request<Incoming>,
) -> Result<T, Response<Body>> {
    let b = read_body(req.into_body(), BODY_LIMIT)
        .await
        .map_err(|e| error(StatusCode::BAD_REQUEST, &e.message))?;
    if b.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(&b).map_err(|e| error(StatusCode::BAD_REQUEST, &format!("{e}")))
}

#[derive(Deserialize, Default)]
struct ExecuteReq {
    code: String,
    context_id: Option<String>,
    language: Option<String>,
    env_vars: Option<Map<String, Value>>,
}

#[derive(Deserialize, Default)]
struct CreateReq {
    language: Option<String>,
    cwd: Option<String>,
}

/// Route one request.
pub async fn handle(ctxs: Arc<Contexts>, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().trim_end_matches('/').to_string();
    let method = req.method().clone();
    let parts: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    match (&method, parts.as_slice()) {
        (&Method::GET, ["health"]) => json_response(StatusCode::OK, &json!("OK")),
        (&Method::POST, ["execute"]) => execute(ctxs, req).await,
        (&Method::GET, ["contexts"]) => json_response(StatusCode::OK, &json!(ctxs.list().await)),
        (&Method::POST, ["contexts"]) => {
            let r: CreateReq = match json_body(req).await {
                Ok(r) => r,
                Err(resp) => return resp,
            };
            let Some(lang) = Language::parse(r.language.as_deref()) else {
                return error(StatusCode::BAD_REQUEST, "unsupported language");
            };
            match ctxs.create(lang, r.cwd.as_deref()).await {
                Ok(c) => json_response(StatusCode::OK, &json!(c.info)),
                Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, &format!("{e:#}")),
            }
        }
        (&Method::DELETE, ["contexts", id]) => {
            if ctxs.remove(id).await {
                Response::builder()
                    .status(StatusCode::NO_CONTENT)
                    .body(full(Bytes::new()))
                    .expect("static response parts are valid")
            } else {
                error(StatusCode::NOT_FOUND, &format!("context {id} not found"))
            }
        }
        (&Method::POST, ["contexts", id, "restart"]) => match ctxs.get(id).await {
            Some(c) => match ctxs.restart(&c).await {
                Ok(()) => json_response(StatusCode::OK, &json!(c.info)),
                Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, &format!("{e:#}")),
            },
            None => error(StatusCode::NOT_FOUND, &format!("context {id} not found")),
        },
        _ => error(StatusCode::NOT_FOUND, "not found"),
    }
}

async fn execute(ctxs: Arc<Contexts>, req: Request<Incoming>) -> Response<Body> {
    let r: ExecuteReq = match json_body(req).await {
        Ok(r) => r,
        Err(resp) => return resp,
    };
    let ctx: Arc<Context> = match (&r.context_id, &r.language) {
        (Some(_), Some(_)) => {
            return error(
                StatusCode::BAD_REQUEST,
                "give context_id or language, not both",
            )
        }
        (Some(id), None) => match ctxs.get(id).await {
            Some(c) => c,
            None => return error(StatusCode::NOT_FOUND, &format!("context {id} not found")),
        },
        (None, lang) => {
            let Some(lang) = Language::parse(lang.as_deref()) else {
                return error(StatusCode::BAD_REQUEST, "unsupported language");
            };
            match ctxs.default_for(lang).await {
                Ok(c) => c,
                Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, &format!("{e:#}")),
            }
        }
    };
    let (tx, rx) = mpsc::channel::<Event>(64);
    let env = r.env_vars.unwrap_or_default();
    tokio::spawn(async move { ctx.execute(&r.code, &env, tx).await });
    // When the client goes away hyper drops this body, closing the channel; the execution sees
    // that and interrupts the cell.
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        let ev = rx.recv().await?;
        Some((
            Ok::<_, std::io::Error>(Frame::data(Bytes::from(ev.to_line()))),
            rx,
        ))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/x-ndjson")
        .body(StreamBody::new(stream).boxed_unsync())
        .expect("static response parts are valid")
}
