//! Garbage collection of built templates: after a template is deleted, and on request
//! (`POST /template-builds/gc`, `kiln template gc`), the versions no tag or name points to
//! and the step-cache entries no kept version uses are removed from the database
//! ([`crate::store::BuildsDb::collect`]), then the snapshots that frees are deleted.
//!
//! Nothing a sandbox uses goes: a version a running or paused sandbox started from is kept
//! with its layers, and the driver removes a snapshot's files only once no sandbox, paused
//! sandbox or other snapshot stacks on them.
//!
//! `kiln serve` also collects by itself every `--template-gc-interval` ([`Builds::run_gc_timer`]):
//! every team's built templates as above, the uploaded COPY archives no step-cache entry or
//! running build names and older than the grace period, and (with the hook `kiln serve`
//! installs, [`StoreGc`]) the template store's old versions and unused image layers, as
//! `kiln template gc` does with its defaults.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use super::Builds;
use crate::error::Result;

/// Period of the automatic collection unless `--template-gc-interval` says otherwise.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(3600);
/// Uploaded archives younger than this (since uploaded or last reported present) stay.
pub const DEFAULT_FILES_GRACE: Duration = Duration::from_secs(3600);

/// The template store's collection (`kiln template gc` without `--built`): what it removed,
/// or why it failed. Blocking; run off the runtime's core threads.
#[derive(Clone)]
pub struct StoreGc(pub Arc<dyn Fn() -> std::result::Result<Vec<String>, String> + Send + Sync>);

impl std::fmt::Debug for StoreGc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StoreGc(..)")
    }
}

/// What one collection removed.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Collected {
    /// Template versions (build ids) removed.
    pub builds: Vec<String>,
    /// Step-cache entries removed.
    pub cache_entries: usize,
    /// Snapshots (layers and started templates) deleted.
    pub snapshots: Vec<String>,
}

impl Builds {
    /// Snapshots `team`'s running and paused sandboxes (build sandboxes included) started from.
    fn in_use(&self, team: &str) -> HashSet<String> {
        self.manager
            .list()
            .into_iter()
            .filter(|r| r.team == team)
            .filter_map(|r| r.alias)
            .map(|a| a.split_once(':').map(|(k, _)| k.to_string()).unwrap_or(a))
            .collect()
    }

    /// Collects every `--template-gc-interval` until the server stops (never when it is off).
    pub async fn run_gc_timer(&self) {
        let Some(every) = self.config.gc_interval else {
            return;
        };
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            self.collect_everything().await;
        }
    }

    /// One automatic collection: every team's built templates and archives, then the store.
    pub async fn collect_everything(&self) {
        let teams = match self.db.teams_with_builds().await {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!(error = %e, "template gc: listing teams");
                return;
            }
        };
        for team in &teams {
            if let Err(e) = self.collect(team).await {
                tracing::warn!(team, error = %e, "template gc: built templates");
            }
            if let Err(e) = self.collect_files(team).await {
                tracing::warn!(team, error = %e, "template gc: uploaded archives");
            }
        }
        if let Some(hook) = self.config.store_gc.clone() {
            let _store = self.store_lock.write().await;
            match tokio::task::spawn_blocking(move || (hook.0)()).await {
                Ok(Ok(removed)) if !removed.is_empty() => {
                    tracing::info!(removed = removed.len(), "template gc: template store")
                }
                Ok(Ok(_)) => {}
                Ok(Err(e)) => tracing::warn!(error = %e, "template gc: template store"),
                Err(e) => tracing::warn!(error = %e, "template gc: template store task"),
            }
        }
    }

    /// Removes `team`'s uploaded archives no step-cache entry or running build names, older
    /// than the grace period; returns their hashes.
    pub async fn collect_files(&self, team: &str) -> Result<Vec<String>> {
        let cutoff = crate::store::now_ms() - self.config.files_grace.as_millis() as i64;
        let gone = self.db.collect_files(team, cutoff).await?;
        for h in &gone {
            let p = super::files::archive_path(&self.files_dir, team, h);
            if let Err(e) = std::fs::remove_file(&p) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!(team, hash = h, error = %e, "removing an uploaded archive");
                }
            }
        }
        if !gone.is_empty() {
            tracing::info!(
                team,
                archives = gone.len(),
                "template gc: uploaded archives"
            );
        }
        Ok(gone)
    }

    /// One collection over `team`'s built templates.
    pub async fn collect(&self, team: &str) -> Result<Collected> {
        let plan = self.db.collect(team, self.in_use(team)).await?;
        let mut snapshots = Vec::new();
        for id in plan.snapshots {
            match self.manager.delete_snapshot(&id, team).await {
                Ok(()) => snapshots.push(id),
                Err(crate::Error::NotFound(_)) => {}
                Err(e) => tracing::warn!(snapshot = id, error = %e, "collecting a build layer"),
            }
        }
        if !plan.builds.is_empty() || plan.layers > 0 || !snapshots.is_empty() {
            tracing::info!(
                team,
                versions = plan.builds.len(),
                cache_entries = plan.layers,
                snapshots = snapshots.len(),
                "template builds collected"
            );
        }
        Ok(Collected {
            builds: plan.builds,
            cache_entries: plan.layers,
            snapshots,
        })
    }
}
