//! Noticing sandboxes whose runtime died on its own (the sentry killed by the host's OOM
//! killer, a crash, someone's `kill -9`): within [`WATCH_INTERVAL`] such a sandbox is marked
//! killed with the reason, its host resources are released, and a `died` event is recorded.
//! Later requests for it get 404 like any ended sandbox. The same tick lets the driver do its
//! upkeep of running sandboxes (console log rotation).

use std::sync::Arc;
use std::time::Duration;

use super::Manager;
use crate::store::SandboxState;

/// How often running sandboxes are checked.
pub const WATCH_INTERVAL: Duration = Duration::from_secs(1);
/// The reason recorded for a sandbox that died.
pub const DIED_REASON: &str = "died: the sandbox runtime exited unexpectedly";

impl Manager {
    /// Marks and cleans up running sandboxes whose runtime is gone; returns their ids.
    pub async fn reap_dead(&self) -> Vec<String> {
        // (A sandbox in standby is paused on purpose: not a death.)
        let running = |r: &crate::store::SandboxRecord| {
            r.state == SandboxState::Running && self.idle.standby_since(&r.id).is_none()
        };
        let ids: Vec<String> = self
            .registry
            .list()
            .into_iter()
            .filter(running)
            .map(|r| r.id)
            .collect();
        if ids.is_empty() {
            return Vec::new();
        }
        self.driver.housekeep(&ids).await;
        let suspects = self.driver.dead(&ids).await;
        if suspects.is_empty() {
            return Vec::new();
        }
        // Pauses, resumes, snapshots and forks stop runtimes on purpose: judge only while
        // none is under way, and only sandboxes still registered as running.
        let _guard = self.lifecycle_lock.write().await;
        let mut died = Vec::new();
        for id in self.driver.dead(&suspects).await {
            if !self.registry.get(&id).is_some_and(|r| running(&r))
                || self.registry.remove(&id).is_none()
            {
                continue;
            }
            let reason = match self.driver.death_cause(&id) {
                Some(cause) => format!("died: {cause}"),
                None => DIED_REASON.to_string(),
            };
            let cleanup = self.driver.stop(&id).await;
            if let Err(e) = self
                .store
                .set_state(&id, SandboxState::Killed, Some(&reason))
                .await
            {
                tracing::warn!(sandbox = %id, error = %e, "recording a dead sandbox");
            }
            let detail = match cleanup {
                Ok(()) => reason,
                Err(e) => format!("{reason} (cleanup error: {e})"),
            };
            self.event(&id, "died", detail).await;
            died.push(id);
        }
        died
    }

    /// Runs [`Self::reap_dead`] every [`WATCH_INTERVAL`] forever.
    pub fn spawn_watcher(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let me = Arc::clone(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(WATCH_INTERVAL).await;
                me.reap_dead().await;
            }
        })
    }
}
