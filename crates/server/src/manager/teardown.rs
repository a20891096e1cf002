//! Kills that answer before the teardown: `DELETE /sandboxes/{id}` stops routing to the
//! sandbox, records it as killed and answers, while the driver's stop (processes, the runtime's
//! container, network slot, mounts, files) runs in the background. Until that is done the
//! sandbox still counts against the server's sandbox limit (the registry's *tearing down*
//! set), and a server that stops waits for it.

use std::sync::Arc;
use std::time::Duration;

use super::Manager;
use crate::error::Result;
use crate::store::SandboxState;

/// How long a stopping server waits for background teardowns.
pub const SHUTDOWN_WAIT: Duration = Duration::from_secs(30);

impl Manager {
    /// Kills running `id` like [`Manager::kill`], but returns once the sandbox is unreachable
    /// and recorded as killed; its teardown finishes in the background. A sandbox that is not
    /// running goes through [`Manager::kill`]. False when there is nothing to kill (also for a
    /// second kill while the first one's teardown runs).
    pub async fn kill_detached(self: &Arc<Self>, id: &str, reason: &str) -> Result<bool> {
        self.report_last_kills(id).await;
        if self.registry.begin_teardown(id).is_none() {
            return self.kill(id, reason).await;
        }
        let m = self.clone();
        let sid = id.to_string();
        let teardown = tokio::spawn(async move {
            if let Err(e) = m.driver.stop(&sid).await {
                tracing::warn!(sandbox = %sid, "teardown after a kill: {e}");
            }
            m.registry.end_teardown(&sid);
        });
        let recorded = async {
            self.store
                .set_state(id, SandboxState::Killed, Some(reason))
                .await?;
            self.event(id, "killed", reason).await;
            Ok(())
        }
        .await;
        if recorded.is_err() {
            // The caller sees the error; the teardown still completes.
            let _ = teardown.await;
        }
        recorded.map(|()| true)
    }

    /// Waits (at most `limit`) until every background teardown is done; false on timeout.
    pub async fn teardowns_done(&self, limit: Duration) -> bool {
        self.registry.wait_torn_down(limit).await
    }

    /// Sandboxes whose teardown still runs in the background.
    pub fn tearing_down(&self) -> usize {
        self.registry.tearing_len()
    }
}
