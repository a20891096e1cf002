//! Snapshots: capturing a running sandbox (which keeps running), listing and deleting
//! snapshots, and creating sandboxes from one (`templateID` = a snapshot id or name). A
//! snapshot outlives its source sandbox.
//!
//! Snapshot ids are generated like sandbox ids and checked against a strict grammar before
//! they reach the driver (which builds paths from them); names are user-chosen within
//! [`check_snapshot_name`]'s grammar.

use std::time::Instant;

use super::{CreateParams, Manager};
use crate::driver::{SandboxSpec, SnapshotRef};
use crate::error::{Error, Result};
use crate::store::{now_ms, SandboxRecord, SandboxState, SnapshotRecord};

/// What becomes of a capture's source.
#[derive(Clone, Copy)]
enum Capture {
    /// It keeps running; `memory`: the snapshot has its memory and processes.
    Continue { memory: bool },
    /// It ends: a disk snapshot without a checkpoint (see [`Manager::snapshot_ending`]).
    End,
}

/// Tag E2B appends to snapshot ids (`<id>:default`).
const TAG: &str = "default";

/// Whether `s` is a snapshot id: 20 lowercase letters and digits, as kiln generates them.
pub fn is_snapshot_id(s: &str) -> bool {
    s.len() == 20
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
}

/// Snapshot names: 1-64 of lowercase letters, digits, `-`, `_`, `.`, starting with a letter
/// or digit.
pub fn check_snapshot_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        && name.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'-' | b'_' | b'.')
        });
    if ok {
        Ok(())
    } else {
        Err(Error::bad_request(format!(
            "invalid snapshot name {name:?}: use 1-64 lowercase letters, digits, '-', '_' or '.'"
        )))
    }
}

/// The snapshot key (id or name) a `templateID` or a snapshot id given by a client names,
/// without its `:tag`.
fn key_of(s: &str) -> &str {
    s.split_once(':').map(|(k, _)| k).unwrap_or(s)
}

/// The snapshot key a `templateID` or a client's snapshot id names, without its `:tag`, when
/// it can be a snapshot's id or name (anything else names no snapshot).
pub fn snapshot_key(s: &str) -> Option<&str> {
    let k = key_of(s);
    (is_snapshot_id(k) || check_snapshot_name(k).is_ok()).then_some(k)
}

/// `<id>:default`, the form the API shows.
pub fn tagged(id: &str) -> String {
    format!("{id}:{TAG}")
}

impl Manager {
    /// `POST /sandboxes/{id}/snapshots`: captures the running sandbox `id` (of `team`), memory
    /// included.
    pub async fn snapshot(
        &self,
        id: &str,
        team: &str,
        name: Option<String>,
    ) -> Result<SnapshotRecord> {
        self.snapshot_with(id, team, name, true).await
    }

    /// [`Manager::snapshot`]; `memory: false` (E2B's `mode: "filesystem"`) keeps the disk only:
    /// sandboxes created from the snapshot boot fresh on it.
    pub async fn snapshot_with(
        &self,
        id: &str,
        team: &str,
        name: Option<String>,
        memory: bool,
    ) -> Result<SnapshotRecord> {
        self.capture(id, team, name, Capture::Continue { memory })
            .await
    }

    /// A disk snapshot of sandbox `id` of `team` that ends it (the last layer of a template
    /// build): its filesystems are flushed from inside (`sync`), the driver freezes its disk
    /// without a checkpoint, and the sandbox is killed with `reason`. Where `sync` cannot run
    /// in it, the snapshot is a regular disk snapshot (whose checkpoint flushes) before the kill.
    pub async fn snapshot_ending(
        &self,
        id: &str,
        team: &str,
        reason: &str,
    ) -> Result<SnapshotRecord> {
        self.get_for(id, team)?;
        let how = match self.flush_disk(id).await {
            Ok(()) => Capture::End,
            Err(why) => {
                tracing::debug!(sandbox = id, why, "no sync: a disk snapshot that continues");
                Capture::Continue { memory: false }
            }
        };
        let snap = self.capture(id, team, None, how).await;
        if let Err(e) = self.kill(id, reason).await {
            tracing::warn!(sandbox = id, error = %e, "stopping a snapshot's ended source");
        }
        snap
    }

    /// Runs `sync` in sandbox `id` as root: its filesystems' cached writes reach its disk.
    async fn flush_disk(&self, id: &str) -> std::result::Result<(), String> {
        let token = self.get(id).map_err(|e| e.to_string())?.envd_token;
        let opts = kiln_envd::RunOptions {
            user: Some("root".into()),
            cwd: Some("/".into()),
            timeout: Some(std::time::Duration::from_secs(60)),
            ..Default::default()
        };
        match self.agent(id, token).exec("sync", &[], opts).await {
            Ok(out) if out.exit_code == 0 => Ok(()),
            Ok(out) => Err(format!("sync exited with code {}", out.exit_code)),
            Err(e) => Err(e.to_string()),
        }
    }

    async fn capture(
        &self,
        id: &str,
        team: &str,
        name: Option<String>,
        how: Capture,
    ) -> Result<SnapshotRecord> {
        self.get_for(id, team)?;
        if let Some(n) = &name {
            check_snapshot_name(n)?;
            if self.store.get_snapshot(n).await?.is_some() {
                return Err(Error::Conflict(format!(
                    "a snapshot named {n:?} already exists"
                )));
            }
        }
        let _guard = self.lifecycle_lock.write().await;
        let rec = self.get(id)?;
        if rec.state != SandboxState::Running {
            return Err(Error::Conflict(format!(
                "sandbox \"{id}\" is paused; resume it before taking a snapshot"
            )));
        }
        self.wake_locked(id, "a snapshot").await?;
        self.used(id);
        let snap_id = super::new_sandbox_id();
        let t = Instant::now();
        let snap_ref = SnapshotRef(snap_id.clone());
        let size = match how {
            Capture::Continue { memory } => {
                let size = self.driver.snapshot(id, &snap_ref, memory).await?;
                // The source continues from the capture: wait until its agent answers again.
                self.agent(id, rec.envd_token.clone())
                    .wait_ready(self.cfg.agent_ready_timeout)
                    .await?;
                size
            }
            Capture::End => self.driver.snapshot_ending(id, &snap_ref).await?,
        };
        let snap = SnapshotRecord {
            id: snap_id,
            name,
            sandbox_id: id.to_string(),
            template_id: rec.template_id.clone(),
            envd_token: rec.envd_token.clone(),
            env_vars: rec.env_vars.clone(),
            created_at_ms: now_ms(),
            size_bytes: size,
            team: rec.team.clone(),
        };
        if let Err(e) = self.store.insert_snapshot(&snap).await {
            let _ = self
                .driver
                .delete_snapshot(&SnapshotRef(snap.id.clone()))
                .await;
            return Err(e.into());
        }
        self.event(
            id,
            "snapshot",
            format!(
                "snapshot {} ({} bytes) in {} ms",
                snap.id,
                size,
                t.elapsed().as_millis()
            ),
        )
        .await;
        Ok(snap)
    }

    /// Snapshots of `team`, oldest first, optionally of one sandbox or with one name.
    pub async fn snapshots(
        &self,
        team: &str,
        sandbox_id: Option<&str>,
        name: Option<&str>,
    ) -> Result<Vec<SnapshotRecord>> {
        Ok(self
            .store
            .list_snapshots()
            .await?
            .into_iter()
            .filter(|s| s.team == team)
            .filter(|s| sandbox_id.is_none_or(|id| s.sandbox_id == id))
            .filter(|s| name.is_none_or(|n| s.name.as_deref() == Some(key_of(n))))
            .collect())
    }

    /// `DELETE /templates/{snapshotID}`: deletes a snapshot of `team` and frees its disk.
    pub async fn delete_snapshot(&self, key: &str, team: &str) -> Result<()> {
        let Some(k) = snapshot_key(key) else {
            return Err(Error::bad_request(format!("invalid snapshot id {key:?}")));
        };
        let snap = self
            .store
            .get_snapshot(k)
            .await?
            .filter(|s| s.team == team)
            .ok_or_else(|| Error::NotFound(format!("snapshot {key:?} not found")))?;
        match self
            .driver
            .delete_snapshot(&SnapshotRef(snap.id.clone()))
            .await
        {
            Ok(()) | Err(crate::driver::DriverError::NotFound(_)) => {}
            Err(e) => return Err(e.into()),
        }
        self.store.delete_snapshot(&snap.id).await?;
        Ok(())
    }

    /// The snapshot of `team` a create request's `templateID` names, if it names one.
    pub async fn snapshot_for(
        &self,
        template_id: &str,
        team: &str,
    ) -> Result<Option<SnapshotRecord>> {
        self.find_snapshot(template_id, team).await
    }

    pub(super) async fn find_snapshot(
        &self,
        template_id: &str,
        team: &str,
    ) -> Result<Option<SnapshotRecord>> {
        let Some(k) = snapshot_key(template_id) else {
            return Ok(None);
        };
        Ok(self.store.get_snapshot(k).await?.filter(|s| s.team == team))
    }

    /// Creates a sandbox continuing from `snap`: its processes and files as they were, with
    /// its own id and access token, the request's environment added and its egress policy
    /// (`p.network`; `None`: the default) in force before anything runs.
    pub(super) async fn create_from_snapshot(
        &self,
        p: &CreateParams,
        snap: SnapshotRecord,
        timeout: u64,
    ) -> Result<SandboxRecord> {
        let tpl = self.lookup_template(&snap.template_id).await?;
        let alias = snap.name.clone().unwrap_or_else(|| tagged(&snap.id));
        let started = Instant::now();
        self.provision(
            p,
            &tpl,
            super::provision::Origin::Snapshot { snap, alias },
            timeout,
            started,
        )
        .await
    }

    /// Restores `snap` into the sandbox `spec` describes and gives its agent the new identity.
    pub(super) async fn restore_and_init(
        &self,
        snap: &SnapshotRecord,
        spec: &SandboxSpec,
        record: &SandboxRecord,
    ) -> Result<String> {
        let t = std::time::Instant::now();
        self.driver
            .restore(&SnapshotRef(snap.id.clone()), spec)
            .await
            .map_err(|e| Error::create("restoring the snapshot")(e.into()))?;
        let t_restore = t.elapsed();
        // The restored agent still holds the snapshot's token: present it to set the new one.
        let agent = self.agent(&spec.id, snap.envd_token.clone());
        agent
            .wait_ready(self.cfg.agent_ready_timeout)
            .await
            .map_err(|e| Error::create("waiting for the restored agent")(e.into()))?;
        let t_ready = t.elapsed();
        let init = kiln_proto::envd::InitRequest {
            env_vars: Some(record.env_vars.clone().into_iter().collect()),
            access_token: Some(record.envd_token.clone().unwrap_or_default()),
            timestamp: Some(
                chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            ),
            // Its source trusted them already, unless it was made before they changed.
            extra_cas: super::network::extra_cas_field(self.extra_cas()),
            ..Default::default()
        };
        agent
            .init(&init)
            .await
            .map_err(|e| Error::create("initialising the restored agent")(e.into()))?;
        let ms = |d: std::time::Duration| d.as_millis();
        Ok(format!(
            "restore {} ms, agent ready {} ms, init {} ms",
            ms(t_restore),
            ms(t_ready - t_restore),
            ms(t.elapsed() - t_ready)
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_ids_and_names_are_strict() {
        assert!(is_snapshot_id("abcdefghij0123456789"));
        for bad in [
            "",
            "abc",
            "ABCDEFGHIJ0123456789",
            "abcdefghij012345678/",
            "../../etc/passwd0",
        ] {
            assert!(!is_snapshot_id(bad), "{bad:?}");
        }
        assert!(check_snapshot_name("my-snap.v2").is_ok());
        for bad in ["", "-x", "a/b", "..", "A", &"x".repeat(65), "a b"] {
            assert!(check_snapshot_name(bad).is_err(), "{bad:?}");
        }
        assert_eq!(key_of("abc:default"), "abc");
        assert_eq!(tagged("abc"), "abc:default");
    }
}
