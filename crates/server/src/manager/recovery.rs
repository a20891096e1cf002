//! After a (possibly unclean) restart: adopt sandboxes that still run and answer, clean up
//! and mark everything else, and remove host leftovers the store does not know.

use std::collections::HashSet;

use super::Manager;
use crate::error::{Error, Result};
use crate::store::SandboxState;

/// What [`Manager::recover`] did.
#[derive(Debug, Default, Clone)]
pub struct RecoveryReport {
    pub adopted: Vec<String>,
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
        for rec in known {
            let alive = rec.state == SandboxState::Running
                && self.driver.is_running(&rec.id).await.unwrap_or(false)
                && self.agent(&rec.id, None).health().await.is_ok();
            if alive {
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
