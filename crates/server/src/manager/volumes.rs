//! Volumes: storage of a team that outlives sandboxes (E2B's `/volumes`). The rows live in
//! the store ([`VolumesDb`]); the driver keeps the data (one filesystem of
//! [`LifecycleConfig::volume_mb`](super::LifecycleConfig) per volume) and mounts volumes
//! into the sandboxes created with `volumeMounts`, whose snapshots and forks mount the same.

use std::path::PathBuf;

use super::Manager;
use crate::driver::VolumeMount;
use crate::error::{Error, Result};
use crate::store::{now_ms, Inserted, MountRecord, VolumeRecord, VolumesDb};

/// Most volumes one sandbox mounts.
pub const MAX_MOUNTS: usize = 16;

/// Paths a volume may not be mounted at (or under): the sandbox's own system directories.
const RESERVED: &[&str] = &["/proc", "/dev", "/sys", "/run/kiln", "/usr/bin/kiln-agent"];

/// Checks a volume name: 1-63 letters, digits and hyphens.
pub fn check_name(name: &str) -> Result<()> {
    if name.is_empty()
        || name.len() > 63
        || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
    {
        return Err(Error::bad_request(format!(
            "volume name {name:?}: use 1-63 letters, digits and hyphens"
        )));
    }
    Ok(())
}

/// What a volume create whose insert answered `got` answers: nothing when it went in, else
/// 409 (the team has that name) or 429 (the team holds `cap` volumes), the latter saying how
/// the operator of `server` (`kiln serve`, `kiln control`) raises the cap.
pub fn check_inserted(
    got: Inserted,
    team: &str,
    name: &str,
    cap: Option<u32>,
    server: &str,
) -> Result<()> {
    match got {
        Inserted::Done => Ok(()),
        Inserted::NameTaken => Err(Error::Conflict(format!(
            "volume \"{name}\" exists already; pick another name or delete it first"
        ))),
        Inserted::Full(held) => {
            let cap = cap.unwrap_or_default();
            Err(Error::Limit(format!(
                "team \"{team}\" holds {held} volumes, its cap ({cap}); delete one \
                 (DELETE /volumes/{{volumeID}}, kiln volumes rm), or have the operator raise \
                 the cap: kiln team set {team} --max-volumes N for this team, {server} \
                 --team-max-volumes N for every team's default"
            )))
        }
    }
}

/// Checks where a volume is mounted inside a sandbox: an absolute path with no `.` or `..`
/// and outside the system directories; returns it without a trailing slash.
pub fn check_mount_path(path: &str) -> Result<String> {
    let bad = |why: &str| Error::bad_request(format!("volume mount path {path:?}: {why}"));
    if !path.starts_with('/') {
        return Err(bad("must be absolute"));
    }
    if path.len() > 1024 || path.contains('\0') {
        return Err(bad("too long or holds a NUL byte"));
    }
    let parts: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    if parts.iter().any(|p| *p == ".." || *p == ".") {
        return Err(bad("must not contain '.' or '..'"));
    }
    if parts.is_empty() {
        return Err(bad("cannot be the root directory"));
    }
    let clean = format!("/{}", parts.join("/"));
    if RESERVED
        .iter()
        .any(|r| clean == *r || clean.starts_with(&format!("{r}/")))
    {
        return Err(bad("is a system directory of the sandbox"));
    }
    Ok(clean)
}

impl Manager {
    /// Keeps volumes in `db` from now on (once; later calls are ignored).
    pub fn set_volumes_db(&self, db: VolumesDb) {
        let _ = self.volumes.set(db);
    }

    fn volumes_db(&self) -> Result<&VolumesDb> {
        self.volumes.get().ok_or_else(|| {
            Error::Driver(crate::driver::DriverError::NotImplemented(
                "volumes (this server keeps no volume table)",
            ))
        })
    }

    /// Creates volume `name` of `team`: 409 when the team has one of that name, 429 when it
    /// holds as many volumes as its quota allows.
    pub async fn create_volume(&self, team: &str, name: &str) -> Result<VolumeRecord> {
        check_name(name)?;
        let db = self.volumes_db()?;
        let v = VolumeRecord {
            id: format!("vol_{}", crate::auth::random_hex(8)),
            team: team.to_string(),
            name: name.to_string(),
            token: crate::auth::random_hex(24),
            size_mb: self.cfg.volume_mb,
            created_at_ms: now_ms(),
        };
        let cap = self.team_quota(team).await?.max_volumes;
        check_inserted(
            db.insert_capped(&v, cap).await?,
            team,
            name,
            cap,
            "kiln serve",
        )?;
        if let Err(e) = self.driver.create_volume(&v.id, v.size_mb).await {
            let _ = db.delete_unused(&v.id).await;
            return Err(e.into());
        }
        Ok(v)
    }

    /// Keeps volume `v` (its id, team, name and token given, as a cluster records it) on this
    /// host: its row and its filesystem, unless it has them already. The cluster counted it
    /// against the team's cap; a row of the same team and name left by another volume is a
    /// conflict.
    pub async fn adopt_volume(&self, v: &VolumeRecord) -> Result<()> {
        check_name(&v.name)?;
        let db = self.volumes_db()?;
        if db.get(&v.id).await?.is_none() {
            match db.insert_capped(v, None).await? {
                Inserted::Done => {}
                Inserted::NameTaken | Inserted::Full(_) => {
                    return Err(Error::Conflict(format!(
                        "this host keeps another volume named \"{}\" of team \"{}\"",
                        v.name, v.team
                    )))
                }
            }
        }
        if self.driver.volume_root(&v.id).await.is_err() {
            if let Err(e) = self.driver.create_volume(&v.id, v.size_mb).await {
                let _ = db.delete_unused(&v.id).await;
                return Err(e.into());
            }
        }
        Ok(())
    }

    /// The volume of `team` whose id or name is `key` (404 otherwise).
    pub async fn volume(&self, team: &str, key: &str) -> Result<VolumeRecord> {
        self.volumes_db()?
            .get_for(team, key)
            .await?
            .ok_or_else(|| Error::NotFound(format!("volume \"{key}\" not found")))
    }

    /// The volume `id` if `token` is its content token (any team: the token is the key).
    pub async fn volume_by_token(&self, id: &str, token: &str) -> Result<Option<VolumeRecord>> {
        let v = self.volumes_db()?.get(id).await?;
        Ok(v.filter(|v| crate::proxy::constant_time_eq(v.token.as_bytes(), token.as_bytes())))
    }

    /// The volumes of `team`, oldest first (every team's when None).
    pub async fn list_volumes(&self, team: Option<&str>) -> Result<Vec<VolumeRecord>> {
        Ok(self.volumes_db()?.list(team).await?)
    }

    /// Deletes a volume of `team` and its data: 404 when unknown, 409 while a live sandbox
    /// mounts it.
    pub async fn delete_volume(&self, team: &str, key: &str) -> Result<()> {
        let v = self.volume(team, key).await?;
        match self.volumes_db()?.delete_unused(&v.id).await? {
            None => Err(Error::NotFound(format!("volume \"{key}\" not found"))),
            Some(users) if !users.is_empty() => Err(Error::Conflict(format!(
                "volume \"{}\" is mounted by sandbox(es) {}; kill them first",
                v.name,
                users.join(", ")
            ))),
            Some(_) => Ok(self.driver.delete_volume(&v.id).await?),
        }
    }

    /// The host directory of a volume's files (for the content API).
    pub async fn volume_root(&self, id: &str) -> Result<PathBuf> {
        Ok(self.driver.volume_root(id).await?)
    }

    /// Mounts every volume's filesystem (after a host reboot they are not); a volume that
    /// cannot be mounted is logged and left for its next use to report.
    pub async fn mount_volumes(&self) {
        let Some(db) = self.volumes.get() else { return };
        let Ok(all) = db.list(None).await else { return };
        for v in all {
            if let Err(e) = self.driver.volume_root(&v.id).await {
                tracing::warn!(volume = %v.id, error = %e, "volume not available");
            }
        }
    }

    /// Resolves `volumeMounts` (`(name, path)` pairs) of a create by `team`.
    pub async fn resolve_mounts(
        &self,
        team: &str,
        asked: &[(String, String)],
    ) -> Result<Vec<MountRecord>> {
        if asked.is_empty() {
            return Ok(Vec::new());
        }
        if asked.len() > MAX_MOUNTS {
            return Err(Error::bad_request(format!(
                "at most {MAX_MOUNTS} volume mounts per sandbox"
            )));
        }
        let db = self.volumes_db()?;
        let mut out: Vec<MountRecord> = Vec::new();
        for (name, path) in asked {
            let path = check_mount_path(path)?;
            if out.iter().any(|m| m.path == path) {
                return Err(Error::bad_request(format!(
                    "two volumes are mounted at {path:?}"
                )));
            }
            let v = db.get_for(team, name).await?.ok_or_else(|| {
                Error::bad_request(format!(
                    "volumeMounts: volume \"{name}\" not found; create it with Volume.create"
                ))
            })?;
            out.push(MountRecord {
                volume_id: v.id,
                name: v.name,
                path,
            });
        }
        // In the order a snapshot's restore lists them again (see `mounts_of`).
        out.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(out)
    }

    /// Records that sandbox `id` mounts `mounts` and returns them as the driver takes them.
    pub(super) async fn record_mounts(
        &self,
        id: &str,
        mounts: &[MountRecord],
    ) -> Result<Vec<VolumeMount>> {
        if mounts.is_empty() {
            return Ok(Vec::new());
        }
        self.volumes_db()?.set_mounts(id, mounts).await?;
        Ok(mounts
            .iter()
            .map(|m| VolumeMount {
                volume_id: m.volume_id.clone(),
                path: m.path.clone(),
            })
            .collect())
    }

    /// The volumes sandbox `id` mounts (what it was created with; a fork's are its source's).
    pub async fn mounts_of(&self, id: &str) -> Result<Vec<MountRecord>> {
        match self.volumes.get() {
            Some(db) => Ok(db.mounts(id).await?),
            None => Ok(Vec::new()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_paths_are_checked() {
        assert!(check_name("my-vol-1").is_ok());
        for bad in ["", "a b", "a/b", "a_b", &"x".repeat(64)] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        assert_eq!(check_mount_path("/mnt/data/").unwrap(), "/mnt/data");
        for bad in [
            "mnt",
            "/",
            "/mnt/../etc",
            "/a/./b",
            "/proc/x",
            "/dev",
            "/run/kiln",
        ] {
            assert!(check_mount_path(bad).is_err(), "{bad:?}");
        }
        assert!(check_mount_path("/devices").is_ok());
    }
}
