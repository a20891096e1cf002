//! The step cache of template builds (`tpl_layers`: a step's key → the snapshot that is its
//! layer), the layers each build used or made (migration 14, `tpl_build_layers`), and the
//! garbage collection's pass over them: which template versions and cache entries nothing
//! names any more, and which snapshots that frees.
//!
//! The snapshots of a deleted template wait in `tpl_orphans` until no sandbox runs on them.
//!
//! A build is kept while it runs, while a tag names it, while it is its template's newest
//! ready build (what the bare name starts), and while a sandbox was started from its result.
//! A kept build keeps its result and every layer it used; a cache entry whose layer no kept
//! build uses is removed. Failed builds keep their rows (status and log) but no layers.

use std::collections::{BTreeSet, HashSet};

use rusqlite::{params, OptionalExtension, Transaction};

use super::tplbuild_sql::BuildsDb;
use super::Result;

/// What one collection removed from the database.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcPlan {
    /// Template versions (ready builds) removed.
    pub builds: Vec<String>,
    /// Step-cache entries removed.
    pub layers: usize,
    /// Snapshots nothing in the database names any more: the caller deletes them.
    pub snapshots: Vec<String>,
}

fn strings(tx: &Transaction<'_>, sql: &str, team: &str) -> rusqlite::Result<Vec<String>> {
    let mut st = tx.prepare(sql)?;
    let rows = st.query_map(params![team], |r| r.get::<_, String>(0))?;
    rows.collect()
}

impl BuildsDb {
    /// The cached layer of `team`'s step `key`, recorded as used by `build` in the same
    /// transaction (so a collection never removes a layer a running build just took).
    pub async fn use_layer(&self, team: &str, key: &str, build: &str) -> Result<Option<String>> {
        let (team, key, build) = (team.to_string(), key.to_string(), build.to_string());
        self.run(move |c| {
            let tx = c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            let snap: Option<String> = tx
                .query_row(
                    "SELECT snapshot_id FROM tpl_layers WHERE team = ?1 AND key = ?2",
                    params![team, key],
                    |r| r.get(0),
                )
                .optional()?;
            if let Some(s) = &snap {
                tx.execute(
                    "INSERT OR IGNORE INTO tpl_build_layers (build_id, snapshot_id)
                     VALUES (?1, ?2)",
                    params![build, s],
                )?;
            }
            tx.commit()?;
            Ok(snap)
        })
        .await
    }

    /// Records that `build` stacks on snapshot `snap` (a template the team built before).
    pub async fn add_build_layer(&self, build: &str, snap: &str) -> Result<()> {
        let (build, snap) = (build.to_string(), snap.to_string());
        self.run(move |c| {
            c.execute(
                "INSERT OR IGNORE INTO tpl_build_layers (build_id, snapshot_id) VALUES (?1, ?2)",
                params![build, snap],
            )?;
            Ok(())
        })
        .await
    }

    /// Caches `snap` as `team`'s layer of step `key`, made by `build` (from the uploaded
    /// archive `files_hash`, for a COPY).
    pub async fn put_layer(
        &self,
        team: &str,
        key: &str,
        snap: &str,
        build: &str,
        files_hash: Option<&str>,
        now_ms: i64,
    ) -> Result<()> {
        let (team, key) = (team.to_string(), key.to_string());
        let (snap, build) = (snap.to_string(), build.to_string());
        let files_hash = files_hash.map(str::to_string);
        self.run(move |c| {
            let tx = c.transaction()?;
            tx.execute(
                "INSERT INTO tpl_layers (team, key, snapshot_id, created_at, files_hash)
                 VALUES (?1, ?2, ?3, ?4, ?5)
                 ON CONFLICT (team, key) DO UPDATE SET snapshot_id = ?3, created_at = ?4,
                   files_hash = ?5",
                params![team, key, snap, now_ms, files_hash],
            )?;
            tx.execute(
                "INSERT OR IGNORE INTO tpl_build_layers (build_id, snapshot_id) VALUES (?1, ?2)",
                params![build, snap],
            )?;
            tx.commit()?;
            Ok(())
        })
        .await
    }

    /// Teams with anything a collection looks at: templates, cache entries, deleted
    /// templates' snapshots or uploaded archives.
    pub async fn teams_with_builds(&self) -> Result<Vec<String>> {
        self.run(move |c| {
            let mut st = c.prepare(
                "SELECT team FROM tpl_templates UNION SELECT team FROM tpl_layers
                 UNION SELECT team FROM tpl_orphans UNION SELECT team FROM tpl_files",
            )?;
            let rows = st.query_map([], |r| r.get::<_, String>(0))?;
            Ok(rows.collect::<rusqlite::Result<Vec<_>>>()?)
        })
        .await
    }

    /// Forgets `team`'s uploaded archives stored before `cutoff_ms` that no step-cache entry
    /// and no running build (its request's COPY steps) name; returns their hashes (the caller
    /// removes the files).
    pub async fn collect_files(&self, team: &str, cutoff_ms: i64) -> Result<Vec<String>> {
        let team = team.to_string();
        self.run(move |c| {
            let tx = c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            let mut named: HashSet<String> = strings(
                &tx,
                "SELECT files_hash FROM tpl_layers WHERE team = ?1 AND files_hash IS NOT NULL",
                &team,
            )?
            .into_iter()
            .collect();
            for spec in strings(
                &tx,
                "SELECT b.spec FROM tpl_builds b JOIN tpl_templates t ON t.id = b.template_id
                 WHERE t.team = ?1 AND b.status IN ('waiting', 'building')
                   AND b.spec IS NOT NULL",
                &team,
            )? {
                let v: serde_json::Value = serde_json::from_str(&spec).unwrap_or_default();
                let steps = v.get("steps").and_then(|s| s.as_array());
                named.extend(
                    steps
                        .into_iter()
                        .flatten()
                        .filter_map(|s| s.get("filesHash")?.as_str().map(str::to_string)),
                );
            }
            let old = {
                let mut st =
                    tx.prepare("SELECT hash FROM tpl_files WHERE team = ?1 AND created_at < ?2")?;
                let rows = st.query_map(params![team, cutoff_ms], |r| r.get::<_, String>(0))?;
                rows.collect::<rusqlite::Result<Vec<_>>>()?
            };
            let mut gone = Vec::new();
            for h in old.into_iter().filter(|h| !named.contains(h)) {
                tx.execute(
                    "DELETE FROM tpl_files WHERE team = ?1 AND hash = ?2",
                    params![team, h],
                )?;
                gone.push(h);
            }
            tx.commit()?;
            Ok(gone)
        })
        .await
    }

    /// One collection over `team`'s builds, step cache and deleted templates' snapshots (see
    /// the module's text). `protect`: snapshots sandboxes run or are paused on.
    pub async fn collect(&self, team: &str, protect: HashSet<String>) -> Result<GcPlan> {
        let team = team.to_string();
        self.run(move |c| {
            let tx = c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            let of_team = "JOIN tpl_templates t ON t.id = b.template_id WHERE t.team = ?1";
            let kept: BTreeSet<String> = strings(
                &tx,
                &format!(
                    "SELECT b.id FROM tpl_builds b {of_team} AND (b.status IN ('waiting',
                       'building') OR b.id IN (SELECT build_id FROM tpl_tags)
                       OR b.id = (SELECT id FROM tpl_builds WHERE template_id = b.template_id
                         AND status = 'ready' ORDER BY finished_at DESC LIMIT 1))"
                ),
                &team,
            )?
            .into_iter()
            .collect();
            let mut keep_snaps: HashSet<String> = protect;
            let mut gone = Vec::new();
            let mut candidates: BTreeSet<String> = strings(
                &tx,
                "SELECT snapshot_id FROM tpl_orphans WHERE team = ?1",
                &team,
            )?
            .into_iter()
            .collect();
            let ready = strings(
                &tx,
                &format!(
                    "SELECT b.id || ' ' || COALESCE(substr(b.target, 6), '') FROM tpl_builds b
                     {of_team} AND b.status = 'ready'"
                ),
                &team,
            )?;
            let layers_of = |build: &str| -> rusqlite::Result<Vec<String>> {
                let mut st = tx.prepare_cached(
                    "SELECT snapshot_id FROM tpl_build_layers WHERE build_id = ?1",
                )?;
                let rows = st.query_map(params![build], |r| r.get::<_, String>(0))?;
                rows.collect()
            };
            // A version a sandbox started from stays with everything under it.
            let mut kept = kept;
            for row in &ready {
                let (id, target) = row.split_once(' ').unwrap_or((row, ""));
                if !target.is_empty() && keep_snaps.contains(target) {
                    kept.insert(id.to_string());
                }
            }
            for row in &ready {
                let (id, target) = row.split_once(' ').unwrap_or((row, ""));
                let mut snaps = layers_of(id)?;
                if !target.is_empty() {
                    snaps.push(target.to_string());
                }
                if kept.contains(id) {
                    keep_snaps.extend(snaps);
                } else {
                    gone.push(id.to_string());
                    candidates.extend(snaps);
                }
            }
            for id in &kept {
                keep_snaps.extend(layers_of(id)?);
            }
            let cached = {
                let mut st =
                    tx.prepare("SELECT key, snapshot_id FROM tpl_layers WHERE team = ?1")?;
                let rows = st.query_map(params![team], |r| {
                    Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?))
                })?;
                rows.collect::<rusqlite::Result<Vec<_>>>()?
            };
            let mut layers = 0;
            for (key, snap) in cached {
                if !keep_snaps.contains(&snap) {
                    layers += tx.execute(
                        "DELETE FROM tpl_layers WHERE team = ?1 AND key = ?2",
                        params![team, key],
                    )?;
                    candidates.insert(snap);
                }
            }
            for id in &gone {
                for sql in [
                    "DELETE FROM tpl_build_logs WHERE build_id = ?1",
                    "DELETE FROM tpl_build_layers WHERE build_id = ?1",
                    "DELETE FROM tpl_tag_assignments WHERE build_id = ?1",
                    "DELETE FROM tpl_builds WHERE id = ?1",
                ] {
                    tx.execute(sql, params![id])?;
                }
            }
            // Failed builds name the layers of the steps before their failure: those rows go
            // with the layers.
            for s in &candidates {
                if !keep_snaps.contains(s) {
                    tx.execute(
                        "DELETE FROM tpl_build_layers WHERE snapshot_id = ?1",
                        params![s],
                    )?;
                    tx.execute(
                        "DELETE FROM tpl_orphans WHERE team = ?1 AND snapshot_id = ?2",
                        params![team, s],
                    )?;
                }
            }
            tx.commit()?;
            Ok(GcPlan {
                builds: gone,
                layers,
                snapshots: candidates
                    .into_iter()
                    .filter(|s| !keep_snaps.contains(s))
                    .collect(),
            })
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::BuildRow;

    async fn build(db: &BuildsDb, tpl: &str, id: &str, status: &str, target: Option<&str>) {
        let b = BuildRow {
            id: id.into(),
            template_id: tpl.into(),
            status: "waiting".into(),
            created_at_ms: 1,
            ..Default::default()
        };
        db.insert_build(&b).await.unwrap();
        let done = BuildRow {
            status: status.into(),
            target: target.map(|t| format!("snap:{t}")),
            ..b
        };
        if status != "waiting" {
            db.finish_build(&done, id.len() as i64).await.unwrap();
        }
    }

    /// v1 (replaced by v2 under `default`) goes with its own layers; v2's and the shared base
    /// layer stay; a failed build's layer goes; v1 stays while a sandbox runs on it.
    #[tokio::test]
    async fn unnamed_versions_and_unused_layers_are_collected() {
        let db = BuildsDb::open_in_memory().unwrap();
        let t = db
            .ensure_template("red", "app", "tid", None, None, 1)
            .await
            .unwrap();
        build(&db, &t.id, "v1", "ready", Some("s-v1")).await;
        db.put_layer("red", "k0", "s-base", "v1", None, 1)
            .await
            .unwrap();
        db.put_layer("red", "k1", "s-v1", "v1", None, 1)
            .await
            .unwrap();
        db.assign_tags(&t.id, &["default".into()], "v1", 1)
            .await
            .unwrap();
        build(&db, &t.id, "v2xx", "ready", Some("s-v2")).await;
        assert_eq!(
            db.use_layer("red", "k0", "v2xx").await.unwrap().as_deref(),
            Some("s-base")
        );
        db.put_layer("red", "k2", "s-v2", "v2xx", None, 2)
            .await
            .unwrap();
        db.assign_tags(&t.id, &["default".into()], "v2xx", 2)
            .await
            .unwrap();
        build(&db, &t.id, "bad", "error", None).await;
        db.put_layer("red", "k3", "s-bad", "bad", None, 3)
            .await
            .unwrap();

        let protect: HashSet<String> = ["s-v1".to_string()].into();
        let p = db.collect("red", protect).await.unwrap();
        assert_eq!(p.builds, Vec::<String>::new(), "v1 has a sandbox on it");
        assert_eq!(p.snapshots, ["s-bad"]);

        let p = db.collect("red", HashSet::new()).await.unwrap();
        assert_eq!(p.builds, ["v1"]);
        assert_eq!(p.layers, 1);
        assert_eq!(p.snapshots, ["s-v1"]);
        assert!(db.get_build("v1").await.unwrap().is_none());
        assert!(
            db.get_build("bad").await.unwrap().is_some(),
            "failed builds keep their log"
        );
        assert_eq!(
            db.use_layer("red", "k0", "x").await.unwrap().as_deref(),
            Some("s-base")
        );
        let again = db.collect("red", HashSet::new()).await.unwrap();
        assert_eq!(again, GcPlan::default());
        // A deleted template's snapshots wait while a sandbox runs on one of them.
        db.delete_template(&t.id).await.unwrap();
        let protect: HashSet<String> = ["s-v2".to_string()].into();
        let p = db.collect("red", protect).await.unwrap();
        assert_eq!(p.snapshots, ["s-base"]);
        let p = db.collect("red", HashSet::new()).await.unwrap();
        assert_eq!(p.snapshots, ["s-v2"]);
        // Another team's collection touches nothing of this one.
        let other = db.collect("blue", HashSet::new()).await.unwrap();
        assert_eq!(other, GcPlan::default());
    }

    /// Archives a cache entry or a running build names stay; others go once older than the
    /// cutoff; another team's are not touched.
    #[tokio::test]
    async fn unnamed_old_archives_are_collected() {
        let db = BuildsDb::open_in_memory().unwrap();
        let t = db
            .ensure_template("red", "app", "tid", None, None, 1)
            .await
            .unwrap();
        for h in ["cached", "running", "old", "young"] {
            let at = if h == "young" { 50 } else { 1 };
            db.put_file("red", h, 1, at).await.unwrap();
        }
        db.put_file("blue", "old", 1, 1).await.unwrap();
        db.put_layer("red", "k", "s", "b0", Some("cached"), 1)
            .await
            .unwrap();
        build(&db, &t.id, "b1", "waiting", None).await;
        let spec = r#"{"steps":[{"type":"COPY","args":["a","b"],"filesHash":"running"}]}"#;
        assert!(db.start_build("b1", spec).await.unwrap());
        assert_eq!(
            db.teams_with_builds().await.unwrap(),
            ["blue".to_string(), "red".to_string()]
        );
        assert_eq!(db.collect_files("red", 10).await.unwrap(), ["old"]);
        assert!(!db.file_present("red", "old").await.unwrap());
        assert!(db.file_present("blue", "old").await.unwrap());
        for h in ["cached", "running", "young"] {
            assert!(db.file_present("red", h).await.unwrap(), "{h}");
        }
        db.touch_file("red", "young", 5).await.unwrap();
        assert_eq!(db.collect_files("red", 10).await.unwrap(), ["young"]);
    }
}
