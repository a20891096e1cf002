//! Garbage collection of built templates: after a template is deleted, and on request
//! (`POST /template-builds/gc`, `kiln template gc`), the versions no tag or name points to
//! and the step-cache entries no kept version uses are removed from the database
//! ([`crate::store::BuildsDb::collect`]), then the snapshots that frees are deleted.
//!
//! Nothing a sandbox uses goes: a version a running or paused sandbox started from is kept
//! with its layers, and the driver removes a snapshot's files only once no sandbox, paused
//! sandbox or other snapshot stacks on them.

use std::collections::HashSet;

use super::Builds;
use crate::error::Result;

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
