//! The `volumes` and `sandbox_volumes` tables (migration 12): one row per volume of a team
//! (its name, content-API token and size), and one per volume a sandbox mounts (kept after the
//! sandbox ends, so its snapshots and forks mount the same volumes). [`VolumesDb`] has a
//! connection of its own to the state database, like the secrets.

use std::path::Path;

use rusqlite::{params, Connection, OptionalExtension, Row};

use super::side_db::SideDb;
use super::Result;

/// One volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeRecord {
    /// `vol_…`.
    pub id: String,
    pub team: String,
    /// Unique within the team.
    pub name: String,
    /// Bearer token of the volume-content API.
    pub token: String,
    pub size_mb: u32,
    pub created_at_ms: i64,
}

/// A volume mounted by a sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountRecord {
    pub volume_id: String,
    pub name: String,
    /// Absolute path inside the sandbox.
    pub path: String,
}

/// A connection to the state database for volumes.
#[derive(Clone)]
pub struct VolumesDb(SideDb);

fn from_row(r: &Row<'_>) -> rusqlite::Result<VolumeRecord> {
    Ok(VolumeRecord {
        id: r.get("id")?,
        team: r.get("team")?,
        name: r.get("name")?,
        token: r.get("token")?,
        size_mb: r.get("size_mb")?,
        created_at_ms: r.get("created_at")?,
    })
}

/// What [`VolumesDb::insert_capped`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Inserted {
    Done,
    /// The team has a volume of that name.
    NameTaken,
    /// The team holds this many volumes, the cap or more.
    Full(u64),
}

impl VolumesDb {
    /// Opens the state database at `path` (already migrated by the state store).
    pub fn open(path: &Path) -> Result<Self> {
        SideDb::open(path).map(Self)
    }

    /// An in-memory database with the current schema (tests).
    pub fn open_in_memory() -> Result<Self> {
        SideDb::open_in_memory().map(Self)
    }

    async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Connection) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        self.0.run(f).await
    }

    /// Stores a new volume; false when its team already has one of that name.
    pub async fn insert(&self, v: &VolumeRecord) -> Result<bool> {
        Ok(self.insert_capped(v, None).await? == Inserted::Done)
    }

    /// Stores a new volume unless its team already has one of that name or holds `cap`
    /// volumes (checked and inserted in one transaction).
    pub async fn insert_capped(&self, v: &VolumeRecord, cap: Option<u32>) -> Result<Inserted> {
        let v = v.clone();
        self.run(move |c| {
            // IMMEDIATE: the count is read and then written beside; a read transaction that
            // upgrades fails at once when another connection wrote in between.
            let tx = c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            if let Some(cap) = cap {
                let held: i64 = tx.query_row(
                    "SELECT COUNT(*) FROM volumes WHERE team = ?1",
                    [&v.team],
                    |r| r.get(0),
                )?;
                if held >= i64::from(cap) {
                    return Ok(Inserted::Full(held.max(0) as u64));
                }
            }
            let n = tx.execute(
                "INSERT INTO volumes (id, team, name, token, size_mb, created_at)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6) ON CONFLICT (team, name) DO NOTHING",
                params![v.id, v.team, v.name, v.token, v.size_mb, v.created_at_ms],
            )?;
            tx.commit()?;
            Ok(if n == 1 {
                Inserted::Done
            } else {
                Inserted::NameTaken
            })
        })
        .await
    }

    /// The volume `id` of any team (the content API checks its token).
    pub async fn get(&self, id: &str) -> Result<Option<VolumeRecord>> {
        let id = id.to_string();
        self.run(move |c| {
            Ok(
                c.query_row("SELECT * FROM volumes WHERE id = ?1", [id], from_row)
                    .optional()?,
            )
        })
        .await
    }

    /// The volume of `team` whose id or name is `key`.
    pub async fn get_for(&self, team: &str, key: &str) -> Result<Option<VolumeRecord>> {
        let (team, key) = (team.to_string(), key.to_string());
        self.run(move |c| {
            Ok(c.query_row(
                "SELECT * FROM volumes WHERE team = ?1 AND (id = ?2 OR name = ?2)",
                params![team, key],
                from_row,
            )
            .optional()?)
        })
        .await
    }

    /// The volumes of `team` (every team's when None), oldest first.
    pub async fn list(&self, team: Option<&str>) -> Result<Vec<VolumeRecord>> {
        let team = team.map(str::to_string);
        self.run(move |c| {
            let mut st = c.prepare_cached(
                "SELECT * FROM volumes WHERE ?1 IS NULL OR team = ?1 ORDER BY created_at, id",
            )?;
            let rows = st.query_map([team], from_row)?;
            Ok(rows.collect::<rusqlite::Result<Vec<_>>>()?)
        })
        .await
    }

    /// Ids of the live sandboxes (starting, running or paused) that mount volume `id`.
    pub async fn users(&self, id: &str) -> Result<Vec<String>> {
        let id = id.to_string();
        self.run(move |c| {
            let mut st = c.prepare_cached(
                "SELECT DISTINCT m.sandbox_id FROM sandbox_volumes m
                 JOIN sandboxes s ON s.id = m.sandbox_id
                 WHERE m.volume_id = ?1 AND s.state IN ('starting', 'running', 'paused')
                 ORDER BY m.sandbox_id",
            )?;
            let rows = st.query_map([id], |r| r.get(0))?;
            Ok(rows.collect::<rusqlite::Result<Vec<String>>>()?)
        })
        .await
    }

    /// Deletes volume `id` and its mount rows unless a live sandbox mounts it (one
    /// transaction). Ok(None): no such volume; Ok(Some(users)): not deleted when not empty.
    pub async fn delete_unused(&self, id: &str) -> Result<Option<Vec<String>>> {
        let id = id.to_string();
        self.run(move |c| {
            let tx = c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            let users: Vec<String> = {
                let mut st = tx.prepare(
                    "SELECT DISTINCT m.sandbox_id FROM sandbox_volumes m
                     JOIN sandboxes s ON s.id = m.sandbox_id
                     WHERE m.volume_id = ?1 AND s.state IN ('starting', 'running', 'paused')",
                )?;
                let rows = st.query_map([&id], |r| r.get(0))?;
                rows.collect::<rusqlite::Result<_>>()?
            };
            if !users.is_empty() {
                return Ok(Some(users));
            }
            let n = tx.execute("DELETE FROM volumes WHERE id = ?1", [&id])?;
            tx.execute("DELETE FROM sandbox_volumes WHERE volume_id = ?1", [&id])?;
            tx.commit()?;
            Ok((n == 1).then(Vec::new))
        })
        .await
    }

    /// Records the volumes sandbox `sandbox` mounts.
    pub async fn set_mounts(&self, sandbox: &str, mounts: &[MountRecord]) -> Result<()> {
        let (sandbox, mounts) = (sandbox.to_string(), mounts.to_vec());
        self.run(move |c| {
            let tx = c.transaction()?;
            for m in &mounts {
                tx.execute(
                    "INSERT OR REPLACE INTO sandbox_volumes (sandbox_id, volume_id, name, path)
                     VALUES (?1, ?2, ?3, ?4)",
                    params![sandbox, m.volume_id, m.name, m.path],
                )?;
            }
            tx.commit()?;
            Ok(())
        })
        .await
    }

    /// The volumes sandbox `sandbox` mounts, in mount-path order.
    pub async fn mounts(&self, sandbox: &str) -> Result<Vec<MountRecord>> {
        let sandbox = sandbox.to_string();
        self.run(move |c| {
            let mut st = c.prepare_cached(
                "SELECT volume_id, name, path FROM sandbox_volumes WHERE sandbox_id = ?1
                 ORDER BY path",
            )?;
            let rows = st.query_map([sandbox], |r| {
                Ok(MountRecord {
                    volume_id: r.get(0)?,
                    name: r.get(1)?,
                    path: r.get(2)?,
                })
            })?;
            Ok(rows.collect::<rusqlite::Result<Vec<_>>>()?)
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vol(id: &str, team: &str, name: &str) -> VolumeRecord {
        VolumeRecord {
            id: id.into(),
            team: team.into(),
            name: name.into(),
            token: format!("tok-{id}"),
            size_mb: 64,
            created_at_ms: 1,
        }
    }

    #[tokio::test]
    async fn volumes_are_per_team_and_busy_ones_stay() {
        let db = VolumesDb::open_in_memory().unwrap();
        assert!(db.insert(&vol("vol_a", "t1", "data")).await.unwrap());
        assert!(!db.insert(&vol("vol_b", "t1", "data")).await.unwrap());
        assert!(db.insert(&vol("vol_c", "t2", "data")).await.unwrap());
        assert_eq!(db.get_for("t1", "data").await.unwrap().unwrap().id, "vol_a");
        assert_eq!(
            db.get_for("t1", "vol_a").await.unwrap().unwrap().name,
            "data"
        );
        assert!(db.get_for("t2", "vol_a").await.unwrap().is_none());
        assert_eq!(db.list(Some("t1")).await.unwrap().len(), 1);
        // The cap counts the team's own volumes, checked before the name.
        for (team, name, want) in [
            ("t1", "other", Inserted::Full(1)),
            ("t1", "data", Inserted::Full(1)),
            ("t3", "data", Inserted::Done),
        ] {
            let v = vol("vol_d", team, name);
            assert_eq!(db.insert_capped(&v, Some(1)).await.unwrap(), want);
        }
        assert_eq!(
            db.insert_capped(&vol("vol_e", "t3", "data"), None)
                .await
                .unwrap(),
            Inserted::NameTaken
        );
        assert!(db.delete_unused("vol_d").await.unwrap().is_some());
        assert_eq!(db.list(None).await.unwrap().len(), 2);
        let m = MountRecord {
            volume_id: "vol_a".into(),
            name: "data".into(),
            path: "/mnt/data".into(),
        };
        db.set_mounts("sbx1", std::slice::from_ref(&m))
            .await
            .unwrap();
        assert_eq!(db.mounts("sbx1").await.unwrap(), vec![m]);
        // No sandbox row: not live, so the volume is not in use.
        assert!(db.users("vol_a").await.unwrap().is_empty());
        db.run(|c| {
            c.execute(
                "INSERT INTO sandboxes (id, template_id, client_id, state, metadata, env_vars,
                   cpu_count, memory_mb, disk_size_mb, started_at, end_at, driver)
                 VALUES ('sbx1', 'base', 'kiln', 'running', '{}', '{}', 1, 512, 0, 0, 0, 'test')",
                [],
            )?;
            Ok(())
        })
        .await
        .unwrap();
        assert_eq!(db.users("vol_a").await.unwrap(), vec!["sbx1".to_string()]);
        assert_eq!(
            db.delete_unused("vol_a").await.unwrap(),
            Some(vec!["sbx1".to_string()])
        );
        assert_eq!(db.delete_unused("vol_c").await.unwrap(), Some(vec![]));
        assert_eq!(db.delete_unused("vol_c").await.unwrap(), None);
    }

    /// A capped insert reads the team's count and then writes; another connection writing in
    /// between (the event log, the audit writer) must make it wait for the lock, not fail with
    /// "database is locked" as an upgraded read transaction does.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn capped_inserts_beside_another_writer_never_fail_busy() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kiln.db");
        let writer = crate::store::busy_writer::BusyWriter::start(
            crate::store::SqliteStore::open(&path).unwrap(),
        );
        let db = VolumesDb::open(&path).unwrap();
        for i in 0..300 {
            let v = vol(&format!("vol_{i}"), "t1", &format!("v{i}"));
            let got = db.insert_capped(&v, Some(10_000)).await;
            assert_eq!(
                got.expect("a capped insert beside a writer"),
                Inserted::Done
            );
        }
        assert!(writer.stop().await > 0);
    }
}
