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
            // autoPause: the sandbox pauses instead of ending.
            if let Some(r) = self.registry.get(&id).filter(|r| r.auto_pause) {
                match self.pause(&id, r.auto_pause_memory).await {
                    Ok(()) => continue,
                    Err(e) => {
                        tracing::warn!(sandbox = %id, error = %e, "auto-pausing; killing instead")
                    }
                }
            }
            // Not in the middle of a pause, snapshot or fork of it (a capture cut short by a
            // kill fails with a runtime error); then only if it is still due (a connect may
            // have extended it meanwhile).
            let _guard = self.lifecycle_lock.lock().await;
            if self
                .registry
                .get(&id)
                .is_some_and(|r| r.end_at_ms > now_ms())
            {
                continue;
            }
            match self.end(&id, "timed-out", "timeout expired").await {
                Ok(true) => killed.push(id),
                Ok(false) => {}
                Err(e) => tracing::warn!(sandbox = %id, error = %e, "killing an expired sandbox"),
            }
        }
        killed
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
