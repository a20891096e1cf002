//! The server's private control requests over the agent's socket (`/kiln/detach`).
//!
//! Before a checkpoint the server asks the agent to detach from its host-backed sockets over
//! the connection it already has (no `runsc kill … USR1`, a runsc process costing tens of
//! milliseconds on the pause path); the agent answers first, then detaches (see
//! [`crate::listen::run`]) and closes every connection upgraded out of one ([`spawn_upgraded`]). Attaching again needs no request at all: a detached
//! agent watches for its `.detached` marker to disappear, which the server removes after a
//! restore. The signals (SIGUSR1/SIGUSR2) keep working for older servers and for tools.
//!
//! The proxy never forwards client requests under `/kiln/` to the agent's control paths.

use std::future::Future;
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
        return crate::reply::api_error(
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

/// Tasks that own a socket upgraded out of a connection (port forwarding): they outlive the
/// connection's own task, so a detach closes them here.
static UPGRADED: std::sync::Mutex<Option<tokio::task::JoinSet<()>>> = std::sync::Mutex::new(None);

/// Runs `task`, which owns an upgraded connection's socket, where a detach closes it.
pub fn spawn_upgraded(task: impl Future<Output = ()> + Send + 'static) {
    let mut set = UPGRADED.lock().unwrap_or_else(|p| p.into_inner());
    let set = set.get_or_insert_with(tokio::task::JoinSet::new);
    // Finished ones are dropped as new ones come.
    while set.try_join_next().is_some() {}
    set.spawn(task);
}

/// Aborts every upgraded connection's task and waits until each is dropped.
pub async fn close_upgraded() {
    let set = UPGRADED.lock().unwrap_or_else(|p| p.into_inner()).take();
    if let Some(mut set) = set {
        set.shutdown().await;
    }
}
