//! What the sandbox proxy records of the envd traffic it forwards: the Connect RPCs of the
//! process and filesystem services and `/files` uploads and downloads. The request is parsed
//! (JSON or protobuf, unary or enveloped) and the response watched as it streams (a process's
//! start event gives its pid, its end event the exit code or signal), so the records describe
//! what actually happened whatever the client is.
//!
//! Records written from a response body are sent before the frame that caused them is passed
//! on, waiting for room in the writer's queue (backpressure, never a drop), so a client that
//! has seen a process end finds its record stored.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use http::{header, HeaderMap, Method, Response, StatusCode, Uri};
use kiln_proto::connect::Code;
use kiln_proto::framing::EnvelopeDecoder;
use kiln_proto::process as pb;
use serde_json::{json, Map, Value};

use super::record::Kind;
use super::tap_body::{CountIn, CountOut, StreamTap, Upload, Watched};
use super::tap_parse::{event_name, fs_op, fs_request};
use super::tap_record::{codec_of, decode, first_envelope, Counter, Recorded};
use super::AuditLog;

/// Largest response read whole to learn what an upload wrote.
const UPLOAD_ANSWER_LIMIT: usize = 1 << 20;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Op {
    /// `process.Process/Start` or `/Connect`: a stream of process events.
    ProcStream {
        connect: bool,
    },
    /// Another process RPC (input, signal, close stdin, resize, stream input).
    ProcUnary(String),
    /// A filesystem RPC.
    Fs(String),
    Download,
    Upload,
}

/// One forwarded request being recorded.
pub struct Tap {
    rec: Recorded,
    op: Op,
    uploaded: Option<Arc<Upload>>,
    multipart_boundary: Option<String>,
    /// The request was read (buffered, or from the start of a streamed body).
    parsed: bool,
}

fn query_param(uri: &Uri, name: &str) -> Option<String> {
    uri.query()?.split('&').find_map(|kv| {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        (k == name).then(|| percent_decode(v))
    })
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => {
                match std::str::from_utf8(&b[i + 1..i + 3])
                    .ok()
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                {
                    Some(v) => {
                        out.push(v);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The user named in `Authorization: Basic base64(user:)` (None: the sandbox's default user).
fn basic_user(h: &HeaderMap) -> Option<String> {
    use base64::Engine;
    let v = h.get(header::AUTHORIZATION)?.to_str().ok()?;
    let b64 = v
        .strip_prefix("Basic ")
        .or_else(|| v.strip_prefix("basic "))?;
    let raw = base64::engine::general_purpose::STANDARD
        .decode(b64.trim())
        .ok()?;
    let s = String::from_utf8(raw).ok()?;
    let user = s.split(':').next().unwrap_or("").to_string();
    (!user.is_empty()).then_some(user)
}

fn selector(s: &Option<pb::ProcessSelector>) -> Value {
    match s.as_ref().and_then(|s| s.selector.as_ref()) {
        Some(pb::process_selector::Selector::Pid(p)) => json!({ "pid": p }),
        Some(pb::process_selector::Selector::Tag(t)) => json!({ "tag": t }),
        None => json!({}),
    }
}

fn merge(into: &mut Map<String, Value>, v: Value) {
    if let Value::Object(o) = v {
        into.extend(o);
    }
}

impl Tap {
    /// Starts recording a request to the agent's port, or None when the log is off or the
    /// request is not an audited operation (health checks, `/init`, listing processes,
    /// polling a watcher).
    pub fn begin(
        log: &AuditLog,
        sandbox: &str,
        method: &Method,
        uri: &Uri,
        headers: &HeaderMap,
    ) -> Option<Tap> {
        if !log.enabled() {
            return None;
        }
        let path = uri.path();
        let op = if let Some(m) = path.strip_prefix("/process.Process/") {
            match m {
                "Start" => Op::ProcStream { connect: false },
                "Connect" => Op::ProcStream { connect: true },
                "List" => return None,
                other => Op::ProcUnary(other.to_string()),
            }
        } else if let Some(m) = path.strip_prefix("/filesystem.Filesystem/") {
            match m {
                "GetWatcherEvents" => return None,
                other => Op::Fs(other.to_string()),
            }
        } else if path == "/files" && method == Method::GET {
            Op::Download
        } else if path == "/files" && method == Method::POST {
            Op::Upload
        } else {
            return None;
        };
        let mut fields = Map::new();
        fields.insert("user".into(), basic_user(headers).into());
        let mut multipart_boundary = None;
        if matches!(op, Op::Download | Op::Upload) {
            fields.insert("path".into(), query_param(uri, "path").into());
            if let Some(u) = query_param(uri, "username") {
                fields.insert("user".into(), u.into());
            }
            let ct = headers
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("");
            if op == Op::Upload && ct.starts_with("multipart/") {
                multipart_boundary = ct
                    .split(';')
                    .find_map(|p| p.trim().strip_prefix("boundary="))
                    .map(|b| b.trim_matches('"').to_string());
            }
            if headers
                .get(header::CONTENT_ENCODING)
                .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"gzip"))
            {
                fields.insert("gzip".into(), true.into());
            }
        }
        Some(Tap {
            rec: Recorded {
                log: log.clone(),
                sandbox: sandbox.to_string(),
                codec: codec_of(headers),
                started: Instant::now(),
                fields,
            },
            op,
            uploaded: None,
            multipart_boundary,
            parsed: false,
        })
    }

    /// Reads what the (buffered) request asks for.
    pub fn request(&mut self, body: &[u8]) {
        self.parsed = true;
        let c = self.rec.codec;
        let v = match &self.op {
            Op::ProcStream { connect: false } => first_envelope(body)
                .and_then(|p| decode::<pb::StartRequest>(c, &p))
                .map(|r| {
                    let cfg = r.process.unwrap_or_default();
                    let mut env: Vec<&String> = cfg.envs.keys().collect();
                    env.sort();
                    json!({
                        "cmd": cfg.cmd,
                        "args": cfg.args,
                        "cwd": cfg.cwd,
                        "envNames": env,
                        "pty": r.pty.is_some(),
                        "tag": r.tag,
                        "stdin": r.stdin.unwrap_or(false),
                    })
                }),
            Op::ProcStream { connect: true } => first_envelope(body)
                .and_then(|p| decode::<pb::ConnectRequest>(c, &p))
                .map(|r| selector(&r.process)),
            Op::ProcUnary(m) => match m.as_str() {
                "SendInput" => decode::<pb::SendInputRequest>(c, body).map(|r| {
                    let (bytes, pty) = match r.input.and_then(|i| i.input) {
                        Some(pb::process_input::Input::Stdin(b)) => (b.len(), false),
                        Some(pb::process_input::Input::Pty(b)) => (b.len(), true),
                        None => (0, false),
                    };
                    let mut v = selector(&r.process);
                    if let Value::Object(o) = &mut v {
                        o.insert("bytes".into(), bytes.into());
                        o.insert("pty".into(), pty.into());
                    }
                    v
                }),
                "SendSignal" => decode::<pb::SendSignalRequest>(c, body).map(|r| {
                    let mut v = selector(&r.process);
                    if let Value::Object(o) = &mut v {
                        let sig = match r.signal {
                            9 => "SIGKILL".to_string(),
                            15 => "SIGTERM".to_string(),
                            n => n.to_string(),
                        };
                        o.insert("signal".into(), sig.into());
                    }
                    v
                }),
                "CloseStdin" => {
                    decode::<pb::CloseStdinRequest>(c, body).map(|r| selector(&r.process))
                }
                "Update" => decode::<pb::UpdateRequest>(c, body).map(|r| {
                    let mut v = selector(&r.process);
                    if let (Value::Object(o), Some(s)) = (&mut v, r.pty.and_then(|p| p.size)) {
                        o.insert("cols".into(), s.cols.into());
                        o.insert("rows".into(), s.rows.into());
                    }
                    v
                }),
                _ => None,
            },
            Op::Fs(m) => fs_request(c, m, body),
            Op::Download | Op::Upload => None,
        };
        if let Some(v) = v {
            merge(&mut self.rec.fields, v);
        }
        if self.op == Op::Upload {
            self.uploaded = Some(Arc::new(Upload::whole(body)));
        }
    }

    /// Counts a streamed request body (large uploads).
    pub fn wrap_request(&mut self, body: Body) -> Body {
        let u = Arc::new(Upload::default());
        self.uploaded = Some(u.clone());
        Body::new(CountIn { inner: body, up: u })
    }

    /// Records what the response says, now or as its body streams.
    pub async fn response(mut self, resp: Response<Body>) -> Response<Body> {
        let status = resp.status();
        // A streamed request (a Connect stream without Content-Length): the agent has read
        // its message before answering, so it is in the body's first bytes.
        if !self.parsed && self.op != Op::Upload {
            if let Some(u) = self.uploaded.clone() {
                let head = u.head();
                self.request(&head);
            }
        }
        match self.op.clone() {
            Op::ProcStream { connect } if status == StatusCode::OK => {
                let ev = if connect { "connect" } else { "start" };
                self.rec.fields.insert("event".into(), ev.into());
                self.rec.owner().await;
                let Some(tx) = self.rec.log.sender() else {
                    return resp;
                };
                let (parts, body) = resp.into_parts();
                let tap = StreamTap {
                    dec: EnvelopeDecoder::new(64 << 20),
                    tap: Some(self.rec),
                    pid: None,
                };
                Response::from_parts(parts, Body::new(Watched::new(body, tap, tx)))
            }
            Op::ProcStream { connect } => {
                let ev = if connect { "connect" } else { "start" };
                self.rec.fields.insert("event".into(), ev.into());
                self.rec
                    .fields
                    .insert("error".into(), code_of(status).into());
                self.rec.owner().await;
                self.rec.emit(Kind::Process).await;
                resp
            }
            Op::ProcUnary(m) => {
                let (resp, code) = result_of(resp).await;
                self.rec
                    .fields
                    .insert("event".into(), event_name(&m).into());
                self.rec.fields.insert("result".into(), code.into());
                self.rec.emit(Kind::Process).await;
                resp
            }
            Op::Fs(m) => {
                let (resp, code) = result_of(resp).await;
                self.rec.fields.insert("op".into(), fs_op(&m).into());
                self.rec.fields.insert("result".into(), code.into());
                self.rec.emit(Kind::File).await;
                resp
            }
            Op::Upload => self.upload_done(resp).await,
            Op::Download if status == StatusCode::OK => {
                let Some(tx) = self.rec.log.sender() else {
                    return resp;
                };
                let (parts, body) = resp.into_parts();
                let gzip = parts
                    .headers
                    .get(header::CONTENT_ENCODING)
                    .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"gzip"));
                let tap = CountOut {
                    bytes: 0,
                    gunzip: gzip.then(|| flate2::write::GzDecoder::new(Counter(0))),
                    tap: Some(self.rec),
                };
                Response::from_parts(parts, Body::new(Watched::new(body, tap, tx)))
            }
            Op::Download => {
                self.rec.fields.insert("op".into(), "read".into());
                self.rec.fields.insert("bytes".into(), 0.into());
                self.rec
                    .fields
                    .insert("result".into(), files_result(status).into());
                self.rec.emit(Kind::File).await;
                resp
            }
        }
    }

    async fn upload_done(mut self, resp: Response<Body>) -> Response<Body> {
        let status = resp.status();
        self.rec.fields.insert("op".into(), "write".into());
        self.rec
            .fields
            .insert("result".into(), files_result(status).into());
        let total = self
            .uploaded
            .as_ref()
            .map_or(0, |u| u.bytes.load(Ordering::Relaxed));
        let (parts, body) = resp.into_parts();
        let (resp, paths) = if status.is_success() {
            match http_body_util::BodyExt::collect(http_body_util::Limited::new(
                body,
                UPLOAD_ANSWER_LIMIT,
            ))
            .await
            {
                Ok(c) => {
                    let b = c.to_bytes();
                    let paths: Vec<String> = serde_json::from_slice::<Vec<Value>>(&b)
                        .unwrap_or_default()
                        .iter()
                        .filter_map(|e| e["path"].as_str().map(str::to_string))
                        .collect();
                    (Response::from_parts(parts, Body::from(b)), paths)
                }
                Err(_) => (Response::from_parts(parts, Body::empty()), Vec::new()),
            }
        } else {
            (Response::from_parts(parts, body), Vec::new())
        };
        let mut bytes = total;
        if let (Some(b), Some(u)) = (&self.multipart_boundary, &self.uploaded) {
            match multipart_payload(b, u, total) {
                Some(n) if paths.len() <= 1 => bytes = n,
                _ => {
                    self.rec
                        .fields
                        .insert("multipartFraming".into(), true.into());
                }
            }
        }
        self.rec.fields.insert("bytes".into(), bytes.into());
        if paths.len() == 1 {
            self.rec
                .fields
                .insert("path".into(), paths[0].clone().into());
        } else if paths.len() > 1 {
            self.rec.fields.insert("paths".into(), paths.into());
        }
        self.rec.emit(Kind::File).await;
        resp
    }
}

/// Bytes of the one part of a single-part multipart body: the total less the part's header
/// and the closing delimiter.
fn multipart_payload(boundary: &str, u: &Upload, total: u64) -> Option<u64> {
    let (head, tail) = (&u.head(), &u.tail());
    let head_len = find(head, b"\r\n\r\n")? + 4;
    let delim = format!("\r\n--{boundary}--");
    let at = rfind(tail, delim.as_bytes())?;
    let trailer = tail.len() - at;
    total.checked_sub((head_len + trailer) as u64)
}

fn find(h: &[u8], n: &[u8]) -> Option<usize> {
    h.windows(n.len()).position(|w| w == n)
}

fn rfind(h: &[u8], n: &[u8]) -> Option<usize> {
    h.windows(n.len()).rposition(|w| w == n)
}

/// `ok`, or the Connect code of a failed call: from its (small) error body, else its status.
async fn result_of(resp: Response<Body>) -> (Response<Body>, String) {
    let status = resp.status();
    if status.is_success() {
        return (resp, "ok".into());
    }
    let (parts, body) = resp.into_parts();
    let limited = http_body_util::Limited::new(body, 64 << 10);
    match http_body_util::BodyExt::collect(limited).await {
        Ok(c) => {
            let b = c.to_bytes();
            let code = kiln_proto::connect::ErrorBody::from_unary(status.as_u16(), &b)
                .code
                .as_str()
                .to_string();
            (Response::from_parts(parts, Body::from(b)), code)
        }
        Err(_) => (Response::from_parts(parts, Body::empty()), code_of(status)),
    }
}

/// The result of a `/files` call (plain HTTP statuses, not Connect's).
fn files_result(s: StatusCode) -> String {
    match s.as_u16() {
        200..=299 => "ok".into(),
        400 => "invalid_argument".into(),
        401 => "unauthenticated".into(),
        403 => "permission_denied".into(),
        404 => "not_found".into(),
        507 => "no_space".into(),
        n => format!("http_{n}"),
    }
}

/// `ok`, or the Connect code an HTTP status stands for.
fn code_of(s: StatusCode) -> String {
    if s.is_success() {
        "ok".into()
    } else {
        Code::from_http_status(s.as_u16()).as_str().to_string()
    }
}

#[cfg(test)]
#[path = "tap_tests.rs"]
mod tests;
