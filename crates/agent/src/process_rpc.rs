//! The `process.Process` service: unary calls (List, SendInput, SendSignal, CloseStdin,
//! Update), server streams (Start, Connect; WatchDir is handed to the filesystem service) and
//! the client stream StreamInput.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use http::Response;
use kiln_proto::connect::Code;
use kiln_proto::filesystem as fspb;
use kiln_proto::process as pb;

use crate::process::{Event, Spawn};
use crate::rpc::{self, Body, Codec, RpcError};
use crate::state::Agent;
use crate::users::User;

/// A unary `process.Process` call with its request body.
pub async fn unary(agent: Arc<Agent>, codec: Codec, method: &str, body: &[u8]) -> Response<Body> {
    let a = agent;
    macro_rules! unary {
        ($req:ty, $f:expr) => {{
            match rpc::decode::<$req>(codec, body) {
                Ok(r) => rpc::unary_response(codec, $f(r).await),
                Err(e) => rpc::error_response(&e),
            }
        }};
    }
    match method {
        "List" => unary!(pb::ListRequest, |_r| async {
            Ok(pb::ListResponse {
                processes: a.procs.list(),
            })
        }),
        "SendInput" => {
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
        "SendSignal" => unary!(
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
        "CloseStdin" => unary!(
            pb::CloseStdinRequest,
            |r: pb::CloseStdinRequest| async move {
                find_proc(&a, r.process.as_ref())?.close_stdin().await?;
                Ok(pb::CloseStdinResponse {})
            }
        ),
        "Update" => unary!(pb::UpdateRequest, |r: pb::UpdateRequest| async move {
            let p = find_proc(&a, r.process.as_ref())?;
            if let Some(size) = r.pty.and_then(|p| p.size) {
                p.resize(size.cols, size.rows)?;
            }
            Ok(pb::UpdateResponse {})
        }),
        _ => rpc::error_response(&RpcError::new(
            Code::Unimplemented,
            format!("unknown RPC /process.Process/{method}"),
        )),
    }
}

/// A streaming call of either service (`service` is `process` or `filesystem`).
pub async fn stream(
    agent: Arc<Agent>,
    codec: Codec,
    headers: &http::HeaderMap,
    user: User,
    mut reader: rpc::EnvelopeReader,
    service: &str,
    method: &str,
) -> Response<Body> {
    if (service, method) == ("process", "StreamInput") {
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
        return resp;
    }
    let first = match reader.next_any(service, method).await {
        Ok(m) => m,
        Err(e) => return rpc::stream_error(codec, e),
    };
    tokio::spawn(reader.drain());
    server_stream(agent, codec, headers, user, first).await
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
