//! After a (possibly unclean) restart: adopt sandboxes that still run and answer, keep paused
//! ones paused, clean up and mark everything else, and remove host leftovers the store does
//! not know.
//!
//! Recovery is split so the server can listen at once: [`Manager::begin_recovery`] reads the
//! store and marks every sandbox it lists as pending (one query), then
//! [`Manager::finish_recovery`] looks at them in parallel (at most [`ADOPT_CONCURRENCY`] at a
//! time), usually in the background. A request for a pending sandbox waits for it
//! ([`Manager::wait_adopted`]) instead of failing.

use std::collections::HashSet;
use std::time::Duration;

use futures::StreamExt;

use super::Manager;
use crate::error::{Error, Result};
use crate::store::{Ingress, PauseMode, SandboxRecord, SandboxState};

/// Sandboxes looked at concurrently during recovery.
pub const ADOPT_CONCURRENCY: usize = 16;

/// How long a request for a sandbox recovery has not reached yet waits for it.
pub const ADOPT_WAIT: Duration = Duration::from_secs(30);

/// What [`Manager::recover`] did.
#[derive(Debug, Default, Clone)]
pub struct RecoveryReport {
    pub adopted: Vec<String>,
    /// Paused sandboxes kept paused.
    pub paused: Vec<String>,
    /// Sandboxes in standby kept in standby (running to clients, woken by traffic).
    pub standby: Vec<String>,
    pub cleaned: Vec<String>,
    pub orphans_removed: Vec<String>,
}

/// The sandboxes of the previous run, marked pending; see [`Manager::finish_recovery`].
pub struct PendingRecovery {
    known: Vec<SandboxRecord>,
}

impl PendingRecovery {
    /// Number of sandboxes recovery will look at.
    pub fn len(&self) -> usize {
        self.known.len()
    }

    pub fn is_empty(&self) -> bool {
        self.known.is_empty()
    }
}

enum Outcome {
    Adopted,
    Paused,
    Standby,
    Cleaned,
}

impl Manager {
    /// Rebuilds the registry from the store and the host (both phases, in order).
    pub async fn recover(&self) -> Result<RecoveryReport> {
        let pending = self.begin_recovery().await?;
        self.finish_recovery(pending).await
    }

    /// Reads the sandboxes the store believes alive and marks them pending.
    pub async fn begin_recovery(&self) -> Result<PendingRecovery> {
        let known = self
            .store
            .list_sandboxes(&[
                SandboxState::Starting,
                SandboxState::Running,
                SandboxState::Paused,
            ])
            .await?;
        self.registry
            .mark_pending(known.iter().map(|r| r.id.clone()));
        Ok(PendingRecovery { known })
    }

    /// Adopts or cleans up every pending sandbox (in parallel), then removes host leftovers.
    pub async fn finish_recovery(&self, pending: PendingRecovery) -> Result<RecoveryReport> {
        let ids: Vec<String> = pending.known.iter().map(|r| r.id.clone()).collect();
        let outcomes: Vec<(String, Result<Outcome>)> = futures::stream::iter(pending.known)
            .map(|rec| async move {
                let id = rec.id.clone();
                let out = self.recover_one(rec).await;
                // Settled whatever happened, so waiters never hang on an error.
                self.registry.settle(&id);
                (id, out)
            })
            .buffer_unordered(ADOPT_CONCURRENCY)
            .collect()
            .await;
        let mut report = RecoveryReport::default();
        let mut keep = HashSet::new();
        let mut first_err = None;
        for (id, out) in outcomes {
            match out {
                Ok(Outcome::Adopted) => {
                    keep.insert(id.clone());
                    report.adopted.push(id);
                }
                Ok(Outcome::Paused) => {
                    keep.insert(id.clone());
                    report.paused.push(id);
                }
                Ok(Outcome::Standby) => {
                    keep.insert(id.clone());
                    report.standby.push(id);
                }
                Ok(Outcome::Cleaned) => report.cleaned.push(id),
                Err(e) => {
                    tracing::warn!(sandbox = %id, error = %e, "recovering a sandbox");
                    // Whatever it is, it is not removed as a leftover.
                    keep.insert(id);
                    first_err.get_or_insert(e);
                }
            }
        }
        // Anything still pending (should not happen) is released.
        for id in &ids {
            self.registry.settle(id);
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        self.remove_leftovers(&keep, &mut report).await?;
        Ok(report)
    }

    /// Waits (bounded by [`ADOPT_WAIT`]) until recovery has settled `id`; immediate when it
    /// is not pending.
    pub async fn wait_adopted(&self, id: &str) {
        if !self.registry.wait_settled(id, ADOPT_WAIT).await {
            tracing::warn!(sandbox = id, "still not recovered after {ADOPT_WAIT:?}");
        }
    }

    /// Sandboxes of the previous run not settled yet.
    pub fn recovering(&self) -> usize {
        self.registry.pending_len()
    }

    /// Whether `id`'s runtime runs and its agent answers. A host busy adopting hundreds of
    /// sandboxes at once answers slowly: each check is retried (after 0.5, 1 and 2 s) before a
    /// sandbox is judged gone and cleaned up — a live one must never be.
    async fn still_alive(&self, id: &str) -> bool {
        for delay_ms in [0u64, 500, 1000, 2000] {
            tokio::time::sleep(std::time::Duration::from_millis(delay_ms)).await;
            if self.driver.is_running(id).await.unwrap_or(false)
                && self.agent(id, None).health().await.is_ok()
            {
                return true;
            }
        }
        false
    }

    /// A sandbox of a kiln from before ingress settings lived in the record has them only
    /// with its driver: they go into the record before it is routed to (or its ports would be
    /// public).
    async fn carry_legacy_ingress(&self, rec: &mut SandboxRecord) -> Result<()> {
        if rec.ingress != Ingress::default() {
            return Ok(());
        }
        if let Some(ingress) = self.driver.legacy_ingress(&rec.id).await {
            self.store.set_ingress(&rec.id, &ingress).await?;
            tracing::info!(sandbox = %rec.id, "ingress settings carried into the sandbox record");
            rec.ingress = ingress;
        }
        Ok(())
    }

    async fn recover_one(&self, mut rec: SandboxRecord) -> Result<Outcome> {
        if rec.state != SandboxState::Starting {
            self.carry_legacy_ingress(&mut rec).await?;
        }
        // Paused on the host (also when the server died between the driver's pause and the
        // store's update): it stays paused, or in standby when that is how it was left.
        if rec.state != SandboxState::Starting
            && self.driver.is_paused(&rec.id).await.unwrap_or(false)
        {
            // Found paused on the host while the store says running: left in standby?
            if rec.state == SandboxState::Running
                && super::standby::left_in_standby(self.store.as_ref(), &rec.id).await?
            {
                let id = rec.id.clone();
                self.registry.insert(rec);
                self.idle.set_standby(&id, crate::store::now_ms());
                self.event(&id, "standby", "kept in standby after a server restart")
                    .await;
                return Ok(Outcome::Standby);
            }
            if rec.state != SandboxState::Paused {
                let mode = rec.pause_mode.unwrap_or(PauseMode::Full);
                self.store.set_paused(&rec.id, mode).await?;
                rec.state = SandboxState::Paused;
                rec.pause_mode = Some(mode);
            }
            self.registry.insert(rec);
            return Ok(Outcome::Paused);
        }
        let alive = rec.state != SandboxState::Starting && self.still_alive(&rec.id).await;
        if alive {
            if rec.state != SandboxState::Running {
                // The server died mid-resume, after the sandbox was running again.
                self.store
                    .set_state(&rec.id, SandboxState::Running, None)
                    .await?;
                rec.state = SandboxState::Running;
            }
            let id = rec.id.clone();
            // The previous run may have hinted it idle; this run's idle table starts awake.
            self.driver.set_idle(&id, false);
            self.registry.insert(rec);
            self.event(&id, "recovered", "still running after a server restart")
                .await;
            Ok(Outcome::Adopted)
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
            Ok(Outcome::Cleaned)
        }
    }

    /// Stops what runs on the host without a live store record. Sandboxes created since the
    /// server started (their record is live) are left alone.
    async fn remove_leftovers(
        &self,
        keep: &HashSet<String>,
        report: &mut RecoveryReport,
    ) -> Result<()> {
        let on_host = self
            .driver
            .list_on_host()
            .await
            .map_err(|e| Error::internal(format!("listing sandboxes on the host: {e}")))?;
        for h in on_host {
            if keep.contains(&h.id) || self.registry.get(&h.id).is_some() {
                continue;
            }
            let live = matches!(
                self.store.get_sandbox(&h.id).await?,
                Some(r) if matches!(
                    r.state,
                    SandboxState::Starting | SandboxState::Running | SandboxState::Paused
                )
            );
            if live {
                continue;
            }
            if let Err(e) = self.driver.stop(&h.id).await {
                tracing::warn!(sandbox = %h.id, error = %e, "removing a leftover sandbox");
            }
            report.orphans_removed.push(h.id);
        }
        Ok(())
    }
}
