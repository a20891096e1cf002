//! HTTP server (HTTP/1.1 and h2c): routing, auth, `/init`, `/health`, `/metrics`, `/envs` and
//! the Connect services.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use http::{header, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use kiln_proto::connect::Code;
use kiln_proto::envd::{ApiError, InitRequest};
use kiln_proto::filesystem as fspb;
use kiln_proto::process as pb;
use tokio::io::{AsyncRead, AsyncWrite};

use crate::process::{Event, Spawn, Table};
use crate::rpc::{self, Body, CallKind, Codec, RpcError};
use crate::users::{self, User};

/// Settings applied by `POST /init`.
#[derive(Debug, Default, Clone)]
pub struct InitState {
    pub env_vars: HashMap<String, String>,
    pub access_token: Option<String>,
    pub default_user: Option<String>,
    pub default_workdir: Option<String>,
}

/// Shared state of one agent.
pub struct Agent {
    pub init: RwLock<InitState>,
    pub procs: Arc<Table>,
    watchers: Mutex<HashMap<String, Arc<BufferedWatcher>>>,
}

struct BufferedWatcher {
    events: Arc<Mutex<std::collections::VecDeque<fspb::FilesystemEvent>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Default for Agent {
    fn default() -> Self {
        Agent {
            init: RwLock::new(InitState::default()),
            procs: Arc::new(Table::default()),
            watchers: Mutex::new(HashMap::new()),
        }
    }
}

/// Identity of a request after auth.
pub struct Caller {
    pub user: User,
}

impl Agent {
    pub fn new() -> Arc<Self> {
        Arc::new(Agent::default())
    }

    fn init_state(&self) -> InitState {
        self.init.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Resolve the user of a request: explicit name, else the default user, else the user the
    /// agent runs as.
    pub fn resolve_user(&self, name: Option<&str>) -> Result<User, RpcError> {
        let name = match name.filter(|n| !n.is_empty()) {
            Some(n) => n.to_string(),
            None => match self.init_state().default_user {
                Some(u) if !u.is_empty() => u,
                // SAFETY: geteuid has no preconditions.
                _ => {
                    return users::lookup_uid(unsafe { libc::geteuid() })
                        .map_err(|e| RpcError::new(Code::Internal, e.to_string()))
                }
            },
        };
        users::lookup(&name).map_err(|e| match e {
            users::UserError::NotFound(_) => {
                RpcError::new(Code::Unauthenticated, format!("invalid user: {e}"))
            }
            other => RpcError::internal(other.to_string()),
        })
    }

    /// Working directory for `user` when the request names none.
    pub fn default_cwd(&self, user: &User) -> String {
        match self.init_state().default_workdir {
            Some(w) if !w.is_empty() => w,
            _ => user.home.to_string_lossy().into_owned(),
        }
    }

    fn token_ok(&self, req: &Request<Incoming>) -> bool {
        match &self.init_state().access_token {
            None => true,
            Some(t) => {
                req.headers()
                    .get("x-access-token")
                    .and_then(|v| v.to_str().ok())
                    == Some(t.as_str())
            }
        }
    }
}

/// User named in `Authorization: Basic base64(user:)`.
pub fn basic_user(req: &Request<Incoming>) -> Result<Option<String>, RpcError> {
    let Some(v) = req.headers().get(header::AUTHORIZATION) else {
        return Ok(None);
    };
    let v = v
        .to_str()
        .map_err(|_| RpcError::new(Code::Unauthenticated, "Authorization header is not ASCII"))?;
    let Some(b64) = v
        .strip_prefix("Basic ")
        .or_else(|| v.strip_prefix("basic "))
    else {
        return Err(RpcError::new(
            Code::Unauthenticated,
            "Authorization must be HTTP Basic with the user name (user:)",
        ));
    };
    use base64::Engine;
    let raw = base64::engine::general_purpose::STANDARD
        .decode(b64.trim())
        .map_err(|_| {
            RpcError::new(
                Code::Unauthenticated,
                "Authorization Basic value is not valid base64",
            )
        })?;
    let s = String::from_utf8(raw)
        .map_err(|_| RpcError::new(Code::Unauthenticated, "Authorization user is not UTF-8"))?;
    let user = s.split(':').next().unwrap_or("").to_string();
    Ok(if user.is_empty() { None } else { Some(user) })
}

/// JSON error of the plain HTTP API.
pub fn api_error(status: StatusCode, message: impl Into<String>) -> Response<Body> {
    let body = serde_json::to_vec(&ApiError {
        code: status.as_u16(),
        message: message.into(),
    })
    .unwrap_or_default();
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .body(rpc::full(body))
        .expect("valid response")
}

fn json_response<T: serde::Serialize>(v: &T) -> Response<Body> {
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/json")
        .body(rpc::full(serde_json::to_vec(v).unwrap_or_default()))
        .expect("valid response")
}

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
    if let Err(e) = b.serve_connection(TokioIo::new(io), svc).await {
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
    let token_ok = agent.token_ok(&req);
    if path == "/files" {
        return crate::files::handle(agent, req, token_ok).await;
    }
    if !token_ok {
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

fn caller(agent: &Agent, req: &Request<Incoming>) -> Result<User, RpcError> {
    let name = basic_user(req)?;
    agent.resolve_user(name.as_deref())
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
        let mut reader = rpc::EnvelopeReader::new(req.into_body(), codec);
        return match (service, method.as_str()) {
            ("process", "StreamInput") => {
                let r = stream_input(&agent, &mut reader).await;
                let (resp, w) = rpc::stream_response(codec);
                tokio::spawn(async move {
                    match r {
                        Ok(()) => {
                            w.send(&pb::StreamInputResponse {}).await;
                            w.finish(None).await
                        }
                        Err(e) => w.finish(Some(e)).await,
                    }
                });
                resp
            }
            _ => {
                let first = match reader.next_any(service, &method).await {
                    Ok(m) => m,
                    Err(e) => return rpc::stream_error(codec, e),
                };
                tokio::spawn(reader.drain());
                server_stream(agent, codec, &headers, user, first).await
            }
        };
    }
    let body = match rpc::read_body(req.into_body(), rpc::MAX_MESSAGE).await {
        Ok(b) => b,
        Err(e) => return rpc::error_response(&e),
    };
    macro_rules! unary {
        ($req:ty, $f:expr) => {{
            match rpc::decode::<$req>(codec, &body) {
                Ok(r) => rpc::unary_response(codec, $f(r).await),
                Err(e) => rpc::error_response(&e),
            }
        }};
    }
    let a = agent.clone();
    match (service, method.as_str()) {
        ("process", "List") => unary!(pb::ListRequest, |_r| async {
            Ok(pb::ListResponse {
                processes: a.procs.list(),
            })
        }),
        ("process", "SendInput") => {
            unary!(pb::SendInputRequest, |r: pb::SendInputRequest| async move {
                let p = find_proc(&a, r.process.as_ref())?;
                match r.input.and_then(|i| i.input) {
                    Some(pb::process_input::Input::Stdin(d)) => p.write_input(&d, false).await?,
                    Some(pb::process_input::Input::Pty(d)) => p.write_input(&d, true).await?,
                    None => return Err(RpcError::invalid("input is empty: set stdin or pty")),
                }
                Ok(pb::SendInputResponse {})
            })
        }
        ("process", "SendSignal") => unary!(
            pb::SendSignalRequest,
            |r: pb::SendSignalRequest| async move {
                let p = find_proc(&a, r.process.as_ref())?;
                let sig = match pb::Signal::try_from(r.signal) {
                    Ok(pb::Signal::Sigkill) => libc::SIGKILL,
                    Ok(pb::Signal::Sigterm) => libc::SIGTERM,
                    _ => {
                        return Err(RpcError::invalid(format!(
                            "unsupported signal {}; use SIGNAL_SIGTERM or SIGNAL_SIGKILL",
                            r.signal
                        )))
                    }
                };
                p.signal(sig)?;
                Ok(pb::SendSignalResponse {})
            }
        ),
        ("process", "CloseStdin") => unary!(
            pb::CloseStdinRequest,
            |r: pb::CloseStdinRequest| async move {
                find_proc(&a, r.process.as_ref())?.close_stdin().await?;
                Ok(pb::CloseStdinResponse {})
            }
        ),
        ("process", "Update") => unary!(pb::UpdateRequest, |r: pb::UpdateRequest| async move {
            let p = find_proc(&a, r.process.as_ref())?;
            if let Some(size) = r.pty.and_then(|p| p.size) {
                p.resize(size.cols, size.rows)?;
            }
            Ok(pb::UpdateResponse {})
        }),
        ("filesystem", m) => crate::fsrpc::unary(agent, codec, user, m, &body).await,
        _ => rpc::error_response(&RpcError::new(
            Code::Unimplemented,
            format!("unknown RPC {path}"),
        )),
    }
}

/// First message of a server-streaming call.
pub enum FirstMessage {
    Start(pb::StartRequest),
    Connect(pb::ConnectRequest),
    WatchDir(fspb::WatchDirRequest),
}

impl rpc::EnvelopeReader {
    async fn next_any(&mut self, service: &str, method: &str) -> Result<FirstMessage, RpcError> {
        let missing = || RpcError::invalid("streaming request carried no message");
        Ok(match (service, method) {
            ("process", "Start") => FirstMessage::Start(self.next().await?.ok_or_else(missing)?),
            ("process", "Connect") => {
                FirstMessage::Connect(self.next().await?.ok_or_else(missing)?)
            }
            _ => FirstMessage::WatchDir(self.next().await?.ok_or_else(missing)?),
        })
    }
}

pub fn find_proc(
    agent: &Agent,
    sel: Option<&pb::ProcessSelector>,
) -> Result<Arc<crate::process::Proc>, RpcError> {
    match sel.and_then(|s| s.selector.as_ref()) {
        Some(pb::process_selector::Selector::Pid(pid)) => agent
            .procs
            .by_pid(*pid)
            .ok_or_else(|| RpcError::not_found(format!("process with pid {pid} not found"))),
        Some(pb::process_selector::Selector::Tag(tag)) => agent
            .procs
            .by_tag(tag)
            .ok_or_else(|| RpcError::not_found(format!("process with tag {tag:?} not found"))),
        None => Err(RpcError::invalid(
            "process selector is empty: set pid or tag",
        )),
    }
}

async fn stream_input(agent: &Agent, reader: &mut rpc::EnvelopeReader) -> Result<(), RpcError> {
    let mut proc_ = None;
    while let Some(m) = reader.next::<pb::StreamInputRequest>().await? {
        match m.event {
            Some(pb::stream_input_request::Event::Start(s)) => {
                proc_ = Some(find_proc(agent, s.process.as_ref())?)
            }
            Some(pb::stream_input_request::Event::Data(d)) => {
                let p = proc_
                    .as_ref()
                    .ok_or_else(|| RpcError::invalid("stream input data before the start event"))?;
                match d.input.and_then(|i| i.input) {
                    Some(pb::process_input::Input::Stdin(b)) => p.write_input(&b, false).await?,
                    Some(pb::process_input::Input::Pty(b)) => p.write_input(&b, true).await?,
                    None => {}
                }
            }
            _ => {}
        }
    }
    Ok(())
}

fn keepalive_interval(headers: &http::HeaderMap) -> Duration {
    headers
        .get("keepalive-ping-interval")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|s| *s > 0)
        .map(Duration::from_secs)
        .unwrap_or(Duration::from_secs(50))
}

fn event_msg(ev: pb::process_event::Event) -> pb::ProcessEvent {
    pb::ProcessEvent { event: Some(ev) }
}

async fn server_stream(
    agent: Arc<Agent>,
    codec: Codec,
    headers: &http::HeaderMap,
    user: User,
    first: FirstMessage,
) -> Response<Body> {
    let deadline = rpc::timeout(headers).map(|t| tokio::time::Instant::now() + t);
    let keepalive = keepalive_interval(headers);
    match first {
        FirstMessage::WatchDir(r) => {
            crate::fsrpc::watch_stream(agent, codec, user, r, keepalive, deadline).await
        }
        FirstMessage::Start(r) => {
            let (pid, rx) = match start_process(&agent, user, r).await {
                Ok(v) => v,
                Err(e) => return rpc::stream_error(codec, e),
            };
            let (resp, w) = rpc::stream_response(codec);
            tokio::spawn(forward_process(w, pid, Ok(rx), keepalive, deadline, true));
            resp
        }
        FirstMessage::Connect(r) => {
            let p = match find_proc(&agent, r.process.as_ref()) {
                Ok(p) => p,
                Err(e) => return rpc::stream_error(codec, e),
            };
            let (resp, w) = rpc::stream_response(codec);
            tokio::spawn(forward_process(
                w,
                p.pid,
                p.subscribe(),
                keepalive,
                deadline,
                false,
            ));
            resp
        }
    }
}

async fn start_process(
    agent: &Agent,
    user: User,
    r: pb::StartRequest,
) -> Result<(u32, tokio::sync::mpsc::Receiver<Event>), RpcError> {
    let config = r
        .process
        .ok_or_else(|| RpcError::invalid("process config is missing"))?;
    let cwd = match config.cwd.as_deref().filter(|c| !c.is_empty()) {
        Some(c) => crate::fs::resolve(c, &user)?.to_string_lossy().into_owned(),
        None => {
            let d = agent.default_cwd(&user);
            // A home that does not exist (e.g. nobody's /nonexistent) falls back to /.
            if std::path::Path::new(&d).is_dir() {
                d
            } else {
                "/".to_string()
            }
        }
    };
    let pty = r.pty.map(|p| {
        p.size
            .map(|s| (s.cols as u16, s.rows as u16))
            .unwrap_or((80, 24))
    });
    let mut env: HashMap<String, String> = HashMap::new();
    env.insert(
        "PATH".into(),
        "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
    );
    env.insert("HOME".into(), user.home.to_string_lossy().into_owned());
    env.insert("USER".into(), user.name.clone());
    env.insert("LOGNAME".into(), user.name.clone());
    env.insert(
        "SHELL".into(),
        if user.shell.is_empty() {
            "/bin/sh".into()
        } else {
            user.shell.clone()
        },
    );
    env.insert("PWD".into(), cwd.clone());
    if pty.is_some() {
        env.insert("TERM".into(), "xterm-256color".into());
    }
    env.extend(agent.init_state().env_vars);
    env.extend(config.envs.clone());
    let spawn = Spawn {
        config,
        tag: r.tag,
        stdin: r.stdin.unwrap_or(true),
        pty,
        user,
        cwd,
        env: env.into_iter().collect(),
    };
    let procs = agent.procs.clone();
    let (p, rx) = procs.spawn(spawn)?;
    Ok((p.pid, rx))
}

async fn forward_process(
    w: rpc::StreamWriter,
    pid: u32,
    rx: Result<tokio::sync::mpsc::Receiver<Event>, pb::process_event::EndEvent>,
    keepalive: Duration,
    deadline: Option<tokio::time::Instant>,
    start: bool,
) {
    if !send_event(
        &w,
        start,
        event_msg(pb::process_event::Event::Start(
            pb::process_event::StartEvent { pid },
        )),
    )
    .await
    {
        return;
    }
    let mut rx = match rx {
        Ok(rx) => rx,
        Err(end) => {
            send_event(&w, start, event_msg(pb::process_event::Event::End(end))).await;
            w.finish(None).await;
            return;
        }
    };
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + keepalive, keepalive);
    let dl = async {
        match deadline {
            Some(d) => tokio::time::sleep_until(d).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(dl);
    loop {
        tokio::select! {
            ev = rx.recv() => {
                let Some(ev) = ev else {
                    w.finish(Some(RpcError::new(Code::Unavailable, "process output stream ended unexpectedly"))).await;
                    return;
                };
                use pb::process_event::{data_event::Output, DataEvent, Event as E};
                let (msg, end) = match ev {
                    Event::Stdout(b) => (E::Data(DataEvent { output: Some(Output::Stdout(b.to_vec())) }), false),
                    Event::Stderr(b) => (E::Data(DataEvent { output: Some(Output::Stderr(b.to_vec())) }), false),
                    Event::Pty(b) => (E::Data(DataEvent { output: Some(Output::Pty(b.to_vec())) }), false),
                    Event::End(e) => (E::End(e), true),
                };
                if !send_event(&w, start, event_msg(msg)).await {
                    return;
                }
                if end {
                    w.finish(None).await;
                    return;
                }
            }
            _ = tick.tick() => {
                if !send_event(&w, start, event_msg(pb::process_event::Event::Keepalive(pb::process_event::KeepAlive {}))).await {
                    return;
                }
            }
            _ = &mut dl => {
                w.finish(Some(RpcError::new(Code::DeadlineExceeded, "the request deadline (connect-timeout-ms) passed; the process keeps running"))).await;
                return;
            }
            _ = w.closed() => return,
        }
    }
}

/// Send one process event as a StartResponse or ConnectResponse.
async fn send_event(w: &rpc::StreamWriter, start: bool, ev: pb::ProcessEvent) -> bool {
    if start {
        w.send(&pb::StartResponse { event: Some(ev) }).await
    } else {
        w.send(&pb::ConnectResponse { event: Some(ev) }).await
    }
}

/// Watchers created with CreateWatcher (polled with GetWatcherEvents).
impl Agent {
    pub fn add_watcher(&self, mut watch: crate::watch::Watch) -> String {
        let id = format!("{:016x}", rand::random::<u64>());
        let events: Arc<Mutex<std::collections::VecDeque<fspb::FilesystemEvent>>> =
            Arc::new(Mutex::new(Default::default()));
        let sink = events.clone();
        let task = tokio::spawn(async move {
            while let Some(ev) = watch.events.recv().await {
                let mut q = sink.lock().unwrap_or_else(|p| p.into_inner());
                if q.len() >= crate::watch::MAX_BUFFERED {
                    q.pop_front();
                }
                q.push_back(ev);
            }
        });
        self.watchers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id.clone(), Arc::new(BufferedWatcher { events, task }));
        id
    }

    pub fn take_watcher_events(&self, id: &str) -> Option<Vec<fspb::FilesystemEvent>> {
        let w = self
            .watchers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .cloned()?;
        let mut q = w.events.lock().unwrap_or_else(|p| p.into_inner());
        Some(q.drain(..).collect())
    }

    pub fn remove_watcher(&self, id: &str) -> bool {
        match self
            .watchers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id)
        {
            Some(w) => {
                w.task.abort();
                true
            }
            None => false,
        }
    }
}
