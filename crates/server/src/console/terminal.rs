//! The console's terminal: a WebSocket bridged to a login shell in a sandbox PTY through the
//! sandbox agent's process API (`kiln_envd`, as `kiln sandbox shell` uses it). Binary frames
//! from the browser are keystrokes; a text frame `{"resize":[cols,rows]}` resizes the PTY.
//! Binary frames to the browser are the PTY's output; a last text frame `{"exit":code}` (or
//! `{"error":"…"}`) says why the shell ended.

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use kiln_envd::{EnvdClient, ProcessEvent};
use serde_json::json;

use super::session::{same_origin, same_token};
use super::ConsoleState;
use crate::store::SandboxState;

/// Keystrokes and resizes, in the order the browser sent them.
enum Input {
    Keys(Vec<u8>),
    Resize(u16, u16),
}

fn refuse(status: StatusCode, message: &str) -> Response {
    (
        status,
        axum::Json(json!({"code": status.as_u16(), "message": message})),
    )
        .into_response()
}

/// `GET /console/terminal/{id}?csrf&cols&rows` (WebSocket upgrade).
pub async fn open(
    ws: WebSocketUpgrade,
    State(cs): State<Arc<ConsoleState>>,
    Path(id): Path<String>,
    Query(q): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Response {
    let Some(s) = cs.current(&headers).await else {
        return refuse(StatusCode::UNAUTHORIZED, "sign in to the console first");
    };
    let csrf_ok = q.get("csrf").is_some_and(|t| same_token(t, &s.csrf));
    if !csrf_ok || !same_origin(&headers) {
        return refuse(
            StatusCode::FORBIDDEN,
            "missing or wrong CSRF token: open the terminal from the console page",
        );
    }
    let manager = &cs.app.manager;
    let rec = match manager.get_for(&id, &s.caller.team) {
        Ok(r) => r,
        Err(_) => return refuse(StatusCode::NOT_FOUND, &format!("sandbox {id} not found")),
    };
    let Some(route) = manager
        .route(&id)
        .filter(|_| rec.state == SandboxState::Running)
    else {
        return refuse(
            StatusCode::CONFLICT,
            &format!("sandbox {id} is not running: resume it first"),
        );
    };
    let dim = |k: &str, d: u16| {
        q.get(k)
            .and_then(|v| v.parse::<u16>().ok())
            .filter(|n| (2..=1000).contains(n))
            .unwrap_or(d)
    };
    let size = (dim("cols", 100), dim("rows", 30));
    let envd = manager.agent(&id, route.envd_token);
    ws.on_upgrade(move |sock| bridge(sock, envd, size))
}

async fn send_text(sock: &mut WebSocket, v: serde_json::Value) {
    let _ = sock.send(Message::Text(v.to_string().into())).await;
}

/// Runs the shell and moves bytes both ways until it exits or the browser goes away (then
/// the shell is killed).
async fn bridge(mut sock: WebSocket, envd: EnvdClient, size: (u16, u16)) {
    let envs = HashMap::from([("TERM".to_string(), "xterm-256color".to_string())]);
    let req = kiln_envd::bash_request("exec bash -l", envs, None, Some(size));
    let mut events = match envd.start(&req, None).await {
        Ok(e) => e,
        Err(e) => {
            send_text(
                &mut sock,
                json!({"error": format!("starting the shell: {e}")}),
            )
            .await;
            return;
        }
    };
    let mut pid = None;
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Input>(256);
    let mut input_task: Option<tokio::task::JoinHandle<()>> = None;
    loop {
        tokio::select! {
            ev = events.next_event() => match ev {
                Ok(Some(ProcessEvent::Started { pid: p })) => {
                    pid = Some(p);
                    let envd = envd.clone();
                    let mut rx = std::mem::replace(&mut rx, tokio::sync::mpsc::channel(1).1);
                    input_task = Some(tokio::spawn(async move {
                        while let Some(i) = rx.recv().await {
                            let r = match i {
                                Input::Keys(d) => envd.send_input(p, d, true, None).await,
                                Input::Resize(c, r) => envd.resize_pty(p, c, r, None).await,
                            };
                            if let Err(e) = r {
                                tracing::debug!(error = %e, "console terminal input");
                            }
                        }
                    }));
                }
                Ok(Some(ProcessEvent::Pty(d) | ProcessEvent::Stdout(d) | ProcessEvent::Stderr(d))) => {
                    if sock.send(Message::Binary(d.into())).await.is_err() {
                        break;
                    }
                }
                Ok(Some(ProcessEvent::Exited { code, .. })) => {
                    send_text(&mut sock, json!({"exit": code})).await;
                    pid = None;
                    break;
                }
                Ok(None) => break,
                Err(e) => {
                    send_text(&mut sock, json!({"error": format!("the shell's stream failed: {e}")})).await;
                    break;
                }
            },
            msg = sock.recv() => match msg {
                Some(Ok(Message::Binary(b))) => { let _ = tx.send(Input::Keys(b.to_vec())).await; }
                Some(Ok(Message::Text(t))) => {
                    if let Ok(v) = serde_json::from_str::<serde_json::Value>(t.as_str()) {
                        let n = |i: usize| v["resize"][i].as_u64().and_then(|n| u16::try_from(n).ok());
                        if let (Some(c), Some(r)) = (n(0), n(1)) {
                            let _ = tx.send(Input::Resize(c.max(2), r.max(2))).await;
                        }
                    }
                }
                Some(Ok(_)) => {}
                Some(Err(_)) | None => break,
            },
        }
    }
    drop(tx);
    if let Some(t) = input_task {
        let _ = t.await;
    }
    if let Some(p) = pid {
        let _ = tokio::time::timeout(std::time::Duration::from_secs(2), envd.kill(p, None)).await;
    }
    let _ = sock.send(Message::Close(None)).await;
}
