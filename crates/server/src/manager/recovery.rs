//! After a (possibly unclean) restart: adopt sandboxes that still run and answer, keep paused
//! ones paused, clean up and mark everything else, and remove host leftovers the store does
//! not know.

use std::collections::HashSet;

use super::Manager;
use crate::error::{Error, Result};
use crate::store::{PauseMode, SandboxState};

/// What [`Manager::recover`] did.
#[derive(Debug, Default, Clone)]
pub struct RecoveryReport {
    pub adopted: Vec<String>,
    /// Paused sandboxes kept paused.
    pub paused: Vec<String>,
    pub cleaned: Vec<String>,
    pub orphans_removed: Vec<String>,
}

impl Manager {
    /// Rebuilds the registry from the store and the host.
    pub async fn recover(&self) -> Result<RecoveryReport> {
        let mut report = RecoveryReport::default();
        let known = self
            .store
            .list_sandboxes(&[
                SandboxState::Starting,
                SandboxState::Running,
                SandboxState::Paused,
            ])
            .await?;
        let mut keep = HashSet::new();
        for mut rec in known {
            // Paused on the host (also when the server died between the driver's pause and
            // the store's update): it stays paused.
            if rec.state != SandboxState::Starting
                && self.driver.is_paused(&rec.id).await.unwrap_or(false)
            {
                if rec.state != SandboxState::Paused {
                    let mode = rec.pause_mode.unwrap_or(PauseMode::Full);
                    self.store.set_paused(&rec.id, mode).await?;
                    rec.state = SandboxState::Paused;
                    rec.pause_mode = Some(mode);
                }
                keep.insert(rec.id.clone());
                self.registry.insert(rec.clone());
                report.paused.push(rec.id);
                continue;
            }
            let alive = rec.state != SandboxState::Starting
                && self.driver.is_running(&rec.id).await.unwrap_or(false)
                && self.agent(&rec.id, None).health().await.is_ok();
            if alive {
                if rec.state != SandboxState::Running {
                    // The server died mid-resume, after the sandbox was running again.
                    self.store
                        .set_state(&rec.id, SandboxState::Running, None)
                        .await?;
                    rec.state = SandboxState::Running;
                }
                keep.insert(rec.id.clone());
                self.registry.insert(rec.clone());
                self.event(&rec.id, "recovered", "still running after a server restart")
                    .await;
                report.adopted.push(rec.id);
            } else {
                let _ = self.driver.stop(&rec.id).await;
                self.store
                    .set_state(
                        &rec.id,
                        SandboxState::Killed,
                        Some("gone after a server restart"),
                    )
                    .await?;
                self.event(
                    &rec.id,
                    "lost",
                    "not running after a server restart; cleaned up",
                )
                .await;
                report.cleaned.push(rec.id);
            }
        }
        let on_host = self
            .driver
            .list_on_host()
            .await
            .map_err(|e| Error::internal(format!("listing sandboxes on the host: {e}")))?;
        for h in on_host {
            if !keep.contains(&h.id) {
                if let Err(e) = self.driver.stop(&h.id).await {
                    tracing::warn!(sandbox = %h.id, error = %e, "removing a leftover sandbox");
                }
                report.orphans_removed.push(h.id);
            }
        }
        Ok(report)
    }
}
