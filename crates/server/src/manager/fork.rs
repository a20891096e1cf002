//! Fork: `count` children continuing from the parent's exact state, the parent running on.
//!
//! The parent is captured once (a snapshot that is never listed and is deleted afterwards),
//! then each child is restored from it like a sandbox created from a snapshot: own id, own
//! token, own layer, and its parent's egress policy in force before it runs (without the
//! parent's workload identity tokens). Each child succeeds or fails alone.

use std::time::Instant;

use super::{CreateParams, Manager};
use crate::driver::SnapshotRef;
use crate::error::{Error, Result};
use crate::store::{now_ms, SandboxRecord, SandboxState, SnapshotRecord};

/// Most children one fork may ask for.
pub const MAX_FORK: u32 = 20;

/// Refuses a fork of `count` children outside 1..=[`MAX_FORK`].
pub fn check_fork_count(count: u32) -> Result<()> {
    if !(1..=MAX_FORK).contains(&count) {
        return Err(Error::bad_request(format!(
            "count must be 1-{MAX_FORK}, got {count}"
        )));
    }
    Ok(())
}

/// Lets a fork's parent continue when dropped.
struct Release<'a>(&'a dyn crate::driver::Driver, &'a str);

impl Drop for Release<'_> {
    fn drop(&mut self) {
        self.0.release_source(self.1);
    }
}

impl Manager {
    /// `POST /sandboxes/{id}/fork`: one result per child, in order.
    pub async fn fork(
        &self,
        id: &str,
        count: u32,
        timeout_secs: Option<i64>,
    ) -> Result<Vec<Result<SandboxRecord>>> {
        check_fork_count(count)?;
        let timeout =
            self.check_timeout(timeout_secs.unwrap_or(self.cfg.default_timeout_secs as i64))?;
        let t = Instant::now();
        let (snap, parent) = {
            let _guard = self.lifecycle_lock.write().await;
            let parent = self.get(id)?;
            if parent.state != SandboxState::Running {
                return Err(Error::Conflict(format!(
                    "sandbox \"{id}\" is paused; resume it before forking it"
                )));
            }
            self.wake_locked(id, "a fork").await?;
            self.used(id);
            let snap_id = super::new_sandbox_id();
            self.driver
                .capture_for_fork(id, &SnapshotRef(snap_id.clone()))
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
        // The children are restored first; the parent continues once they answer (the
        // driver restores it in the background, and requests to it wait for that), or when
        // this call ends in any other way.
        let release = Release(self.driver.as_ref(), id);
        let p = self.child_params(&parent, timeout).await;
        let children = (0..count).map(|_| {
            let p = p.clone();
            let (snap, alias) = (snap.clone(), parent.alias.clone());
            async move {
                let child = self.create_from_snapshot(&p, snap, timeout).await;
                if let Ok(c) = &child {
                    self.registry.update(&c.id, |r| r.alias = alias);
                }
                child.map(|c| self.get(&c.id).unwrap_or(c))
            }
        });
        // Restored side by side (the boot semaphore bounds how many at once).
        let out = futures::future::join_all(children).await;
        drop(release);
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
        Ok(out)
    }

    /// What a fork's child of running sandbox `id` is created with (its parent's metadata,
    /// settings and egress policy, without the parent's workload identity tokens), for a child
    /// restored on another host from a snapshot of `id`.
    pub async fn fork_child_params(
        &self,
        id: &str,
        timeout_secs: Option<i64>,
    ) -> Result<CreateParams> {
        let timeout =
            self.check_timeout(timeout_secs.unwrap_or(self.cfg.default_timeout_secs as i64))?;
        let parent = self.get(id)?;
        if parent.state != SandboxState::Running {
            return Err(Error::Conflict(format!(
                "sandbox \"{id}\" is paused; resume it before forking it"
            )));
        }
        Ok(self.child_params(&parent, timeout).await)
    }

    async fn child_params(&self, parent: &SandboxRecord, timeout: u64) -> CreateParams {
        // A child never escapes its parent's egress policy.
        let network = self.network_for_child(&parent.id).await;
        CreateParams {
            template_id: parent.template_id.clone(),
            timeout_secs: Some(timeout as i64),
            metadata: parent.metadata.clone(),
            secure: parent.envd_token.is_some(),
            auto_pause: parent.auto_pause,
            auto_resume: parent.auto_resume,
            auto_pause_filesystem_only: !parent.auto_pause_memory,
            team: parent.team.clone(),
            network,
            ingress: parent.ingress.clone(),
            ..Default::default()
        }
    }
}
