//! Ending (or, with autoPause, pausing) sandboxes whose time is up. Expiry is a question to the store (the authority on end
//! times), so a sandbox's timeout holds whichever process serves it.

use std::sync::Arc;

use super::Manager;
use crate::store::now_ms;

impl Manager {
    /// Kills sandboxes whose time is up, or pauses those created with autoPause. Returns
    /// the ids killed.
    pub async fn reap_expired(&self) -> Vec<String> {
        let due = match self.store.expired(now_ms()).await {
            Ok(ids) => ids,
            Err(e) => {
                tracing::warn!(error = %e, "listing expired sandboxes");
                return Vec::new();
            }
        };
        let mut killed = Vec::new();
        for id in due {
            if self.apply_timeout_action(&id).await {
                killed.push(id);
            }
        }
        killed
    }

    /// `set_timeout(0)`: the sandbox's time is up now, so its timeout action runs at once
    /// (pause with autoPause, else kill), as E2B applies it. A paused sandbox stays paused.
    pub async fn expire_now(&self, id: &str) -> crate::error::Result<()> {
        self.set_end(id, |_| now_ms()).await?;
        self.event(id, "timeout", "timeout set to 0: time is up now")
            .await;
        if self.is_running(id) {
            self.apply_timeout_action(id).await;
        }
        Ok(())
    }

    fn is_running(&self, id: &str) -> bool {
        self.registry
            .get(id)
            .is_some_and(|r| r.state == crate::store::SandboxState::Running)
    }

    /// Pauses `id` when it was created with autoPause, else ends it, provided it is still
    /// due. True when it was killed.
    async fn apply_timeout_action(&self, id: &str) -> bool {
        // autoPause: the sandbox pauses instead of ending.
        if let Some(r) = self.registry.get(id).filter(|r| r.auto_pause) {
            match self.pause(id, r.auto_pause_memory).await {
                Ok(()) => return false,
                // Paused meanwhile (the reaper's tick and a `set_timeout(0)` may meet).
                Err(_) if !self.is_running(id) => return false,
                Err(e) => {
                    tracing::warn!(sandbox = %id, error = %e, "auto-pausing; killing instead")
                }
            }
        }
        // Not in the middle of a pause, snapshot or fork of it (a capture cut short by a
        // kill fails with a runtime error); then only if it is still due (a connect may
        // have extended it meanwhile).
        let _guard = self.lifecycle_lock.write().await;
        if !self.is_running(id)
            || self
                .registry
                .get(id)
                .is_some_and(|r| r.end_at_ms > now_ms())
        {
            return false;
        }
        match self.end(id, "timed-out", "timeout expired").await {
            Ok(killed) => killed,
            Err(e) => {
                tracing::warn!(sandbox = %id, error = %e, "killing an expired sandbox");
                false
            }
        }
    }

    /// Runs [`Self::reap_expired`] forever.
    pub fn spawn_reaper(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let me = Arc::clone(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(me.cfg.reap_interval).await;
                me.reap_expired().await;
            }
        })
    }
}
