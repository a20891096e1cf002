//! `kiln-agent computer`: the computer-use action API of the `desktop` template (port 49990),
//! beyond E2B. One request carries a batch of actions in Anthropic's or OpenAI's vocabulary
//! ([`actions`]) and can ask for a screenshot after them, so an agent loop needs no shell round
//! trips. See docs/rich-sandboxes.md for the wire format.
//!
//! - `GET /health` → `"OK"`
//! - `GET /display` → `{display, width, height, cursor: {x, y}}`
//! - `GET /screenshot[?format=jpeg]` → the image itself
//! - `POST /actions {actions: [..], screenshot?: bool | "png" | "jpeg",
//!   coordinate_space?: {width, height}}` → `{results, cursor, screen, screenshot?}`

pub mod actions;
pub mod image;
pub mod input;
pub mod keymap;
pub mod keys;
pub mod keysyms;
pub mod x11;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use base64::Engine as _;
use http::{header, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{json, Value};
use tokio::sync::Mutex;

use crate::rpc::{full, read_body, Body};
use actions::Action;
use x11::{Display, Image};

/// The port of the action API in the desktop template.
pub const PORT: u16 = 49990;
const BODY_LIMIT: usize = 4 << 20;
/// Most actions one request may carry.
pub const MAX_ACTIONS: usize = 200;

#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub addr: SocketAddr,
    pub display: String,
    /// A scratch directory (the service itself writes no files).
    pub tmp: PathBuf,
}

struct Service {
    display: Display,
    /// One batch at a time: interleaved input from two requests would mix clicks and keys.
    busy: Mutex<()>,
}

/// Bind and serve forever.
pub async fn serve(cfg: ServeConfig) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(cfg.addr)
        .await
        .with_context(|| format!("bind {}", cfg.addr))?;
    tracing::info!(
        "computer-use API listening on {} (display {})",
        listener.local_addr()?,
        cfg.display
    );
    let svc = Arc::new(Service {
        display: Display::new(cfg.display),
        busy: Mutex::new(()),
    });
    loop {
        match listener.accept().await {
            Ok((s, _)) => {
                let _ = s.set_nodelay(true);
                let svc = svc.clone();
                tokio::spawn(async move {
                    let f = hyper::service::service_fn(move |req| {
                        let svc = svc.clone();
                        async move { Ok::<_, Infallible>(handle(&svc, req).await) }
                    });
                    let b = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                    if let Err(e) = b.serve_connection(TokioIo::new(s), f).await {
                        tracing::debug!("computer-use connection ended: {e}");
                    }
                });
            }
            Err(e) => {
                tracing::warn!("accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

fn json_response(status: StatusCode, v: &Value) -> Response<Body> {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .body(full(v.to_string()))
        .expect("static response parts are valid")
}

fn image_json(img: &Image) -> Value {
    json!({
        "format": img.format,
        "width": img.width,
        "height": img.height,
        "bytes": img.bytes.len(),
        "data": base64::engine::general_purpose::STANDARD.encode(&img.bytes),
    })
}

async fn handle(svc: &Service, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().trim_end_matches('/').to_string();
    let query = req.uri().query().unwrap_or("").to_string();
    match (req.method(), path.as_str()) {
        (&Method::GET, "/health") => json_response(StatusCode::OK, &json!("OK")),
        (&Method::GET, "/display") => {
            let d = &svc.display;
            match (d.size().await, d.cursor().await) {
                (Ok((w, h)), Ok((x, y))) => json_response(
                    StatusCode::OK,
                    &json!({"display": d.name, "width": w, "height": h, "cursor": {"x": x, "y": y}}),
                ),
                (Err(e), _) | (_, Err(e)) => {
                    json_response(StatusCode::SERVICE_UNAVAILABLE, &json!({ "error": e }))
                }
            }
        }
        (&Method::GET, "/screenshot") => {
            let jpeg = query
                .split('&')
                .any(|kv| kv == "format=jpeg" || kv == "format=jpg");
            let _g = svc.busy.lock().await;
            match svc.display.screenshot(jpeg, None).await {
                Ok(img) => Response::builder()
                    .status(StatusCode::OK)
                    .header(header::CONTENT_TYPE, format!("image/{}", img.format))
                    .body(full(img.bytes))
                    .expect("static response parts are valid"),
                Err(e) => json_response(StatusCode::SERVICE_UNAVAILABLE, &json!({ "error": e })),
            }
        }
        (&Method::POST, "/actions") => {
            let body = match read_body(req.into_body(), BODY_LIMIT).await {
                Ok(b) => b,
                Err(e) => {
                    return json_response(StatusCode::BAD_REQUEST, &json!({"error": e.message}))
                }
            };
            let v: Value = match serde_json::from_slice(&body) {
                Ok(v) => v,
                Err(e) => {
                    return json_response(
                        StatusCode::BAD_REQUEST,
                        &json!({"error": format!("invalid JSON: {e}")}),
                    )
                }
            };
            let (status, v) = run_batch(svc, &v).await;
            json_response(status, &v)
        }
        _ => json_response(StatusCode::NOT_FOUND, &json!({"error": "not found"})),
    }
}

/// What the request asked for after its actions: no screenshot, PNG or JPEG.
fn wanted_screenshot(v: &Value) -> Result<Option<bool>, String> {
    match v.get("screenshot") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => Ok(None),
        Some(Value::Bool(true)) => Ok(Some(false)),
        Some(Value::String(s)) if s == "png" => Ok(Some(false)),
        Some(Value::String(s)) if s == "jpeg" || s == "jpg" => Ok(Some(true)),
        Some(other) => Err(format!(
            "screenshot must be true, false, \"png\" or \"jpeg\", not {other}"
        )),
    }
}

async fn run_batch(svc: &Service, v: &Value) -> (StatusCode, Value) {
    let bad = |msg: String, index: Option<usize>| {
        (
            StatusCode::BAD_REQUEST,
            json!({"error": msg, "index": index}),
        )
    };
    // A batch, or one action object on its own.
    let list: Vec<Value> = match v.get("actions") {
        Some(Value::Array(a)) => a.clone(),
        Some(_) => return bad("actions must be a list".into(), None),
        None if v.get("action").is_some() || v.get("type").is_some() => vec![v.clone()],
        None => Vec::new(),
    };
    if list.len() > MAX_ACTIONS {
        return bad(format!("at most {MAX_ACTIONS} actions per request"), None);
    }
    let shot = match wanted_screenshot(v) {
        Ok(s) => s,
        Err(e) => return bad(e, None),
    };
    let mut parsed = Vec::with_capacity(list.len());
    for (i, a) in list.iter().enumerate() {
        match Action::parse(a) {
            Ok(a) => parsed.push(a),
            Err(e) => return bad(e, Some(i)),
        }
    }
    let _g = svc.busy.lock().await;
    let d = &svc.display;
    let (w, h) = match d.size().await {
        Ok(s) => s,
        Err(e) => {
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                json!({"error": format!("the display {} is not up: {e}", d.name)}),
            )
        }
    };
    if let Some(space) = v.get("coordinate_space") {
        let dim = |k: &str| space.get(k).and_then(Value::as_f64).filter(|n| *n >= 1.0);
        match (dim("width"), dim("height")) {
            (Some(mw), Some(mh)) => {
                for a in &mut parsed {
                    a.scale(w as f64 / mw, h as f64 / mh);
                }
            }
            _ => return bad("coordinate_space needs width and height".into(), None),
        }
    }
    let mut results = Vec::with_capacity(parsed.len());
    for (i, a) in parsed.iter().enumerate() {
        match run_one(d, a, (w, h)).await {
            Ok(r) => results.push(r),
            Err(e) => {
                return (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    json!({"error": e, "index": i, "results": results}),
                )
            }
        }
    }
    let mut out = json!({"results": results, "screen": {"width": w, "height": h}});
    if let Ok((x, y)) = d.cursor().await {
        out["cursor"] = json!({"x": x, "y": y});
    }
    if let Some(jpeg) = shot {
        match d.screenshot(jpeg, None).await {
            Ok(img) => out["screenshot"] = image_json(&img),
            Err(e) => {
                return (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    json!({"error": e, "results": out["results"]}),
                )
            }
        }
    }
    (StatusCode::OK, out)
}

async fn run_one(d: &Display, a: &Action, (w, h): (u32, u32)) -> Result<Value, String> {
    if let Some(steps) = input::steps(a)? {
        d.input(steps).await?;
        return Ok(json!({"ok": true}));
    }
    Ok(match a {
        Action::Screenshot => json!({"image": image_json(&d.screenshot(false, None).await?)}),
        Action::Zoom { region } => {
            let [x0, y0, x1, y1] = *region;
            if x1 > w as i64 || y1 > h as i64 {
                return Err(format!("region {region:?} is outside the {w}x{h} screen"));
            }
            json!({"image": image_json(&d.screenshot(false, Some(*region)).await?)})
                .as_object()
                .map(|o| {
                    let mut o = o.clone();
                    o.insert("region".into(), json!([x0, y0, x1, y1]));
                    Value::Object(o)
                })
                .unwrap_or(Value::Null)
        }
        Action::CursorPosition => {
            let (x, y) = d.cursor().await?;
            json!({"x": x, "y": y})
        }
        Action::DisplayInfo => json!({"width": w, "height": h, "display": d.name}),
        Action::Wait { seconds } => {
            tokio::time::sleep(Duration::from_secs_f64(*seconds)).await;
            json!({"ok": true})
        }
        _ => return Err(format!("unsupported action {a:?}")),
    })
}
