//! Fork: `count` children continuing from the parent's exact state, the parent running on.
//!
//! The parent is captured once (a snapshot that is never listed and is deleted afterwards),
//! then each child is restored from it like a sandbox created from a snapshot: own id, own
//! token, own layer. Each child succeeds or fails alone.

use std::time::Instant;

use super::{CreateParams, Manager};
use crate::driver::SnapshotRef;
use crate::error::{Error, Result};
use crate::store::{now_ms, SandboxRecord, SandboxState, SnapshotRecord};

/// Most children one fork may ask for.
pub const MAX_FORK: u32 = 20;

impl Manager {
    /// `POST /sandboxes/{id}/fork`: one result per child, in order.
    pub async fn fork(
        &self,
        id: &str,
        count: u32,
        timeout_secs: Option<i64>,
    ) -> Result<Vec<Result<SandboxRecord>>> {
        if !(1..=MAX_FORK).contains(&count) {
            return Err(Error::bad_request(format!(
                "count must be 1-{MAX_FORK}, got {count}"
            )));
        }
        let timeout =
            self.check_timeout(timeout_secs.unwrap_or(self.cfg.default_timeout_secs as i64))?;
        let t = Instant::now();
        let (snap, parent) = {
            let _guard = self.lifecycle_lock.lock().await;
            let parent = self.get(id)?;
            if parent.state != SandboxState::Running {
                return Err(Error::Conflict(format!(
                    "sandbox \"{id}\" is paused; resume it before forking it"
                )));
            }
            let snap_id = super::new_sandbox_id();
            self.driver
                .snapshot(id, &SnapshotRef(snap_id.clone()), true)
                .await?;
            let snap = SnapshotRecord {
                id: snap_id,
                name: None,
                sandbox_id: id.to_string(),
                template_id: parent.template_id.clone(),
                envd_token: parent.envd_token.clone(),
                env_vars: parent.env_vars.clone(),
                created_at_ms: now_ms(),
                size_bytes: 0,
                team: parent.team.clone(),
            };
            (snap, parent)
        };
        // The parent continues (the driver may restore it in the background) while the
        // children are restored.
        let token = parent.envd_token.clone();
        let ready = async move {
            self.agent(id, token)
                .wait_ready(self.cfg.agent_ready_timeout)
                .await
        };
        let children = (0..count).map(|_| {
            let p = CreateParams {
                template_id: parent.template_id.clone(),
                timeout_secs: Some(timeout as i64),
                metadata: parent.metadata.clone(),
                secure: parent.envd_token.is_some(),
                auto_pause: parent.auto_pause,
                auto_resume: parent.auto_resume,
                auto_pause_filesystem_only: !parent.auto_pause_memory,
                team: parent.team.clone(),
                ..Default::default()
            };
            let (snap, alias) = (snap.clone(), parent.alias.clone());
            async move {
                let child = self.create_from_snapshot(p, snap, timeout).await;
                if let Ok(c) = &child {
                    self.registry.update(&c.id, |r| r.alias = alias);
                }
                child.map(|c| self.get(&c.id).unwrap_or(c))
            }
        });
        // Restored side by side (the boot semaphore bounds how many at once).
        let (ready, out) = futures::future::join(ready, futures::future::join_all(children)).await;
        if let Err(e) = self
            .driver
            .delete_snapshot(&SnapshotRef(snap.id.clone()))
            .await
        {
            tracing::warn!(sandbox = id, error = %e, "removing a fork's capture");
        }
        let ok = out.iter().filter(|r| r.is_ok()).count();
        self.event(
            id,
            "forked",
            format!("{ok} of {count} children in {} ms", t.elapsed().as_millis()),
        )
        .await;
        ready?;
        Ok(out)
    }
}
