//! The console's desktop view: noVNC's RFB client in the page talks over a WebSocket that this
//! module bridges to the sandbox's VNC server (x11vnc on port 5900) through the driver's
//! connector, so the console needs neither the sandbox's websockify (port 6080) nor a public
//! route to it.
//!
//! - `GET /console/desktop/{id}`: `{"desktop": bool, "vnc": bool}`: whether the sandbox has
//!   x11vnc and an X display `:0` that answers (a desktop sandbox), and whether a VNC server listens on 5900.
//! - `POST /console/desktop/{id}/stream` (CSRF): starts x11vnc as e2b-desktop's
//!   `stream.start()` does, and waits for it to listen.
//! - `GET /console/vnc/{id}?csrf=` (WebSocket, subprotocol `binary`): binary frames both ways
//!   are the RFB byte stream.
//!
//! The session, CSRF and same-origin checks are the terminal's; another team's sandbox is not
//! found (404); a sandbox without a desktop, or one whose stream is not started, gets a 409.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use kiln_envd::{BoxIo, EnvdClient, RunOptions};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::session::{same_origin, same_token, Session, CSRF_HEADER};
use super::{json_error, ConsoleState};
use crate::store::SandboxState;

/// x11vnc's port, as e2b-desktop's stream uses it.
pub const VNC_PORT: u16 = 5900;
/// The user e2b-desktop runs its commands as.
const DESKTOP_USER: &str = "user";
/// e2b-desktop's `stream.start()` command (no password, display `:0`).
const START_VNC: &str = "x11vnc -bg -display :0 -forever -wait 50 -shared -rfbport 5900 -nopw \
     2>/tmp/x11vnc_stderr.log";
/// Exits 0 in a desktop sandbox: x11vnc is installed and display `:0` answers (the SDK checks
/// its display with `xdpyinfo` too).
const IS_DESKTOP: &str = "command -v x11vnc >/dev/null && xdpyinfo -display :0 >/dev/null 2>&1";
/// How long a started x11vnc gets to listen.
const START_WAIT: Duration = Duration::from_secs(10);

/// A sandbox of the session's team, running, with its agent's client.
struct Target {
    id: String,
    agent: EnvdClient,
    token: Option<String>,
}

type Cs = State<Arc<ConsoleState>>;

/// A refused request: its status and what to tell the client.
pub struct Refused(StatusCode, String);

impl IntoResponse for Refused {
    fn into_response(self) -> Response {
        json_error(self.0, &self.1)
    }
}

fn refused(status: StatusCode, message: impl Into<String>) -> Refused {
    Refused(status, message.into())
}

/// The session's running sandbox `id`, or the answer refusing it.
fn target(cs: &ConsoleState, s: &Session, id: &str) -> Result<Target, Refused> {
    let manager = &cs.app.manager;
    let rec = manager
        .get_for(id, &s.caller.team)
        .map_err(|_| refused(StatusCode::NOT_FOUND, format!("sandbox {id} not found")))?;
    let route = manager
        .route(id)
        .filter(|_| rec.state == SandboxState::Running)
        .ok_or_else(|| {
            refused(
                StatusCode::CONFLICT,
                format!("sandbox {id} is not running: resume it first"),
            )
        })?;
    Ok(Target {
        id: id.to_string(),
        agent: manager.agent(id, route.envd_token.clone()),
        token: route.envd_token,
    })
}

impl Target {
    /// Runs `cmd` as the desktop's user; its exit code.
    async fn run(&self, cmd: &str) -> Result<i32, Refused> {
        let opts = RunOptions {
            user: Some(DESKTOP_USER.to_string()),
            access_token: self.token.clone(),
            timeout: Some(Duration::from_secs(20)),
            ..Default::default()
        };
        match self.agent.run(cmd, opts).await {
            Ok(out) => Ok(out.exit_code),
            Err(e) => {
                tracing::warn!(sandbox = %self.id, error = %e, "console desktop: running a command");
                Err(refused(
                    StatusCode::BAD_GATEWAY,
                    format!("the agent of sandbox {} did not answer", self.id),
                ))
            }
        }
    }

    async fn is_desktop(&self) -> Result<bool, Refused> {
        Ok(self.run(IS_DESKTOP).await? == 0)
    }

    /// A connection to the VNC server (the sandbox kept awake while it lasts), or why there
    /// is none (nothing listens, or the server's sandboxes have no network to reach it by).
    async fn vnc(&self, cs: &ConsoleState) -> Result<(BoxIo, crate::manager::InUse), String> {
        let pr = cs
            .app
            .manager
            .open_route(&self.id, VNC_PORT)
            .await
            .map_err(|_| format!("sandbox {} is not running", self.id))?;
        // The reason goes to the client: no host path in it, as in the API's answers.
        match pr.client.connect_raw().await {
            Ok(io) => Ok((io, pr.in_use)),
            Err(kiln_envd::EnvdError::Connect { source }) => {
                Err(crate::error::redact_host_paths(&source.to_string()))
            }
            Err(e) => Err(crate::error::redact_host_paths(&e.to_string())),
        }
    }
}

fn not_desktop(id: &str) -> Refused {
    refused(
        StatusCode::CONFLICT,
        format!("sandbox {id} has no desktop (no X display :0 with x11vnc): only desktop sandboxes have a desktop view"),
    )
}

async fn session_of(cs: &ConsoleState, headers: &HeaderMap) -> Result<Session, Refused> {
    cs.current(headers)
        .await
        .ok_or_else(|| refused(StatusCode::UNAUTHORIZED, "sign in to the console first"))
}

fn csrf_refused() -> Refused {
    refused(
        StatusCode::FORBIDDEN,
        "missing or wrong CSRF token: open the desktop from the console page",
    )
}

/// `GET /console/desktop/{id}`.
pub async fn status(
    State(cs): Cs,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Response, Refused> {
    let s = session_of(&cs, &headers).await?;
    let t = target(&cs, &s, &id)?;
    if !t.is_desktop().await? {
        return Ok(Json(json!({"desktop": false, "vnc": false})).into_response());
    }
    Ok(match t.vnc(&cs).await {
        Ok(_) => Json(json!({"desktop": true, "vnc": true})),
        Err(why) => Json(json!({"desktop": true, "vnc": false, "reason": why})),
    }
    .into_response())
}

/// `POST /console/desktop/{id}/stream`: starts x11vnc unless one listens already.
pub async fn start_stream(
    State(cs): Cs,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Response, Refused> {
    let s = session_of(&cs, &headers).await?;
    let token_ok = headers
        .get(CSRF_HEADER)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|t| same_token(t, &s.csrf));
    if !token_ok || !same_origin(&headers) {
        return Err(csrf_refused());
    }
    let t = target(&cs, &s, &id)?;
    if !t.is_desktop().await? {
        return Err(not_desktop(&id));
    }
    if t.vnc(&cs).await.is_err() {
        let code = t.run(START_VNC).await?;
        if code != 0 {
            return Err(refused(
                StatusCode::CONFLICT,
                format!("x11vnc did not start in sandbox {id} (exit code {code}; see /tmp/x11vnc_stderr.log in the sandbox)"),
            ));
        }
        let until = tokio::time::Instant::now() + START_WAIT;
        while let Err(why) = t.vnc(&cs).await {
            if tokio::time::Instant::now() >= until {
                return Err(refused(
                    StatusCode::CONFLICT,
                    format!("x11vnc started in sandbox {id}, but port {VNC_PORT} is not reachable: {why}"),
                ));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    Ok(Json(json!({"desktop": true, "vnc": true})).into_response())
}

/// `GET /console/vnc/{id}?csrf=` (WebSocket upgrade).
pub async fn open(
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
    State(cs): Cs,
    Path(id): Path<String>,
    Query(q): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Result<Response, Refused> {
    let s = session_of(&cs, &headers).await?;
    let csrf_ok = q.get("csrf").is_some_and(|t| same_token(t, &s.csrf));
    if !csrf_ok || !same_origin(&headers) {
        return Err(csrf_refused());
    }
    let t = target(&cs, &s, &id)?;
    if !t.is_desktop().await? {
        return Err(not_desktop(&id));
    }
    let Ok(ws) = ws else {
        return Err(refused(
            StatusCode::BAD_REQUEST,
            "this is a WebSocket endpoint: connect with a WebSocket client (noVNC)",
        ));
    };
    let (io, in_use) = t.vnc(&cs).await.map_err(|why| {
        refused(
            StatusCode::CONFLICT,
            format!("no VNC server is reachable on port {VNC_PORT} in sandbox {id} ({why}): start the stream first"),
        )
    })?;
    Ok(ws.protocols(["binary"]).on_upgrade(move |sock| async move {
        bridge(sock, io).await;
        drop(in_use);
    }))
}

/// Moves the RFB byte stream between the browser and the VNC server until either side ends.
async fn bridge(mut sock: WebSocket, mut io: BoxIo) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        tokio::select! {
            n = io.read(&mut buf) => match n {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let frame = bytes::Bytes::copy_from_slice(&buf[..n]);
                    if sock.send(Message::Binary(frame)).await.is_err() {
                        break;
                    }
                }
            },
            msg = sock.recv() => match msg {
                Some(Ok(Message::Binary(b))) => {
                    if io.write_all(&b).await.is_err() {
                        break;
                    }
                }
                Some(Ok(Message::Close(_))) | Some(Err(_)) | None => break,
                Some(Ok(_)) => {}
            },
        }
    }
    let _ = io.shutdown().await;
    let _ = sock.send(Message::Close(None)).await;
}
