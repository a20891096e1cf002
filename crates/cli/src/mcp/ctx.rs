//! What a tool call runs with: the kiln client acting for the caller's API key, and a way to
//! send progress notifications when the caller asked for them (a `progressToken`).

use std::sync::atomic::{AtomicU64, Ordering};

use rmcp::model::{ProgressNotificationParam, ProgressToken};
use rmcp::service::{Peer, RequestContext};
use rmcp::RoleServer;

use super::args::{ToolError, ToolResult};
use crate::client::{Client, SandboxRef};

/// How long a sandbox service (the code interpreter, the desktop's action API) may take to
/// start listening.
const SERVICE_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

pub struct Ctx {
    pub client: Client,
    progress: Option<(Peer<RoleServer>, ProgressToken)>,
    step: AtomicU64,
}

impl Ctx {
    pub fn new(client: Client, rc: &RequestContext<RoleServer>) -> Ctx {
        let progress = rc.meta.get_progress_token().map(|t| (rc.peer.clone(), t));
        Ctx {
            client,
            progress,
            step: AtomicU64::new(0),
        }
    }

    /// Sends one progress notification (a no-op when the caller gave no progress token).
    pub async fn progress(&self, message: impl Into<String>) {
        let Some((peer, token)) = &self.progress else {
            return;
        };
        let n = self.step.fetch_add(1, Ordering::Relaxed) + 1;
        let p = ProgressNotificationParam::new(token.clone(), n as f64).with_message(message);
        if let Err(e) = peer.notify_progress(p).await {
            tracing::debug!("progress notification not delivered: {e}");
        }
    }

    /// Sends a request to a service port of a sandbox, waiting out a service that is still
    /// starting (kiln answers 502 while nothing listens on the port yet) for up to
    /// [`SERVICE_WAIT`].
    pub async fn send_to_port(
        &self,
        make: impl Fn() -> reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, String> {
        let deadline = tokio::time::Instant::now() + SERVICE_WAIT;
        loop {
            let resp = make().send().await.map_err(|e| e.to_string())?;
            if resp.status() != reqwest::StatusCode::BAD_GATEWAY
                || tokio::time::Instant::now() >= deadline
            {
                return Ok(resp);
            }
            tokio::time::sleep(std::time::Duration::from_millis(250)).await;
        }
    }

    /// The running sandbox `id` (with its envd token).
    pub async fn sandbox(&self, id: &str) -> ToolResult<SandboxRef> {
        super::args::non_empty("sandbox_id", id)?;
        self.client
            .sandbox(id)
            .await
            .map_err(|e| ToolError::failed(format!("sandbox {id}: {e}")))
    }
}
