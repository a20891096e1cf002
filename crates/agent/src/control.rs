//! The server's private control requests over the agent's socket (`/kiln/detach`).
//!
//! Detaching the agent from its host-backed sockets before a checkpoint used to need a
//! `runsc kill … USR1`, a runsc process costing tens of milliseconds on the pause path. The
//! server now asks over the connection it already has; the agent answers first, then
//! detaches (see [`crate::listen::run`]). Attaching again needs no request at all: a detached
//! agent watches for its `.detached` marker to disappear, which the server removes after a
//! restore. The signals (SIGUSR1/SIGUSR2) keep working for older servers and for tools.
//!
//! The proxy never forwards client requests under `/kiln/` to the agent's control paths.

use std::sync::OnceLock;

use http::{Method, Response, StatusCode};
use tokio::sync::Notify;

use crate::rpc::{self, Body};

/// The path of the detach request.
pub const DETACH_PATH: &str = "/kiln/detach";

fn detach_signal() -> &'static Notify {
    static DETACH: OnceLock<Notify> = OnceLock::new();
    DETACH.get_or_init(Notify::new)
}

/// Resolves when a detach was requested (a request made while nobody waits is kept).
pub async fn detach_requested() {
    detach_signal().notified().await
}

/// Handles `POST /kiln/detach`: 202, and the listener loop detaches right after.
pub fn handle_detach(method: &Method) -> Response<Body> {
    if method != Method::POST {
        return crate::router::api_error(
            StatusCode::METHOD_NOT_ALLOWED,
            format!("{DETACH_PATH} takes POST"),
        );
    }
    detach_signal().notify_one();
    Response::builder()
        .status(StatusCode::ACCEPTED)
        .header(http::header::CONNECTION, "close")
        .body(rpc::empty())
        .expect("valid response")
}
