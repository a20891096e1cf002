//! The tables of templates built through E2B's Template API (migration 11): templates per
//! team, their builds and build logs, tags and the uploaded COPY archives (`tpl_files`); the
//! step cache (`tpl_layers`) is in [`super::tplbuild_gc_sql`], the tags' history in
//! [`super::tplbuild_tags_sql`]. [`BuildsDb`] has a connection of its own to the state
//! database, like the secrets and the audit log.

use std::path::Path;

use rusqlite::{params, Connection, OptionalExtension, Row};

use super::side_db::SideDb;
use super::Result;

/// A template of a team.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TplRow {
    pub id: String,
    pub team: String,
    pub name: String,
    pub public: bool,
    pub cpu_count: Option<i64>,
    pub memory_mb: Option<i64>,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
}

/// One build of a template.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BuildRow {
    pub id: String,
    pub template_id: String,
    /// `waiting`, `building`, `ready` or `error`.
    pub status: String,
    /// Tags the build gets once it is ready.
    pub tags: Vec<String>,
    /// The start request (JSON); set once, when the build is started.
    pub spec: Option<String>,
    pub reason: Option<String>,
    pub reason_step: Option<String>,
    /// What sandboxes of the finished build start from: `snap:<id>` or `tpl:<name>`.
    pub target: Option<String>,
    pub user: Option<String>,
    pub workdir: Option<String>,
    pub created_at_ms: i64,
    pub finished_at_ms: Option<i64>,
}

/// One line of a build's log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuildLogRow {
    pub seq: i64,
    pub ts_ms: i64,
    pub level: String,
    pub step: Option<String>,
    pub message: String,
}

/// A tag of a template and the build it names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TagRow {
    pub tag: String,
    pub build_id: String,
    pub assigned_at_ms: i64,
}

/// Log levels, lowest first.
pub const LEVELS: &[&str] = &["debug", "info", "warn", "error"];

fn tpl_row(r: &Row<'_>) -> rusqlite::Result<TplRow> {
    Ok(TplRow {
        id: r.get("id")?,
        team: r.get("team")?,
        name: r.get("name")?,
        public: r.get::<_, i64>("public")? != 0,
        cpu_count: r.get("cpu_count")?,
        memory_mb: r.get("memory_mb")?,
        created_at_ms: r.get("created_at")?,
        updated_at_ms: r.get("updated_at")?,
    })
}

fn build_row(r: &Row<'_>) -> rusqlite::Result<BuildRow> {
    let tags: String = r.get("tags")?;
    Ok(BuildRow {
        id: r.get("id")?,
        template_id: r.get("template_id")?,
        status: r.get("status")?,
        tags: serde_json::from_str(&tags).unwrap_or_default(),
        spec: r.get("spec")?,
        reason: r.get("reason")?,
        reason_step: r.get("reason_step")?,
        target: r.get("target")?,
        user: r.get("user_name")?,
        workdir: r.get("workdir")?,
        created_at_ms: r.get("created_at")?,
        finished_at_ms: r.get("finished_at")?,
    })
}

/// A connection to the state database for template builds.
#[derive(Clone)]
pub struct BuildsDb(SideDb);

impl BuildsDb {
    /// Opens the state database at `path` (already migrated by the state store).
    pub fn open(path: &Path) -> Result<Self> {
        SideDb::open(path).map(Self)
    }

    /// An in-memory database with the current schema (tests).
    pub fn open_in_memory() -> Result<Self> {
        SideDb::open_in_memory().map(Self)
    }

    pub(super) async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Connection) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        self.0.run(f).await
    }

    // ---- templates ----

    /// The template of `team` named `name`, made with id `new_id` when there is none; its
    /// resources are updated to the request's.
    pub async fn ensure_template(
        &self,
        team: &str,
        name: &str,
        new_id: &str,
        cpu_count: Option<i64>,
        memory_mb: Option<i64>,
        now_ms: i64,
    ) -> Result<TplRow> {
        let (team, name, id) = (team.to_string(), name.to_string(), new_id.to_string());
        self.run(move |c| {
            let tx = c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            tx.execute(
                "INSERT INTO tpl_templates (id, team, name, cpu_count, memory_mb, created_at,
                   updated_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?6)
                 ON CONFLICT (team, name) DO UPDATE SET cpu_count = ?4, memory_mb = ?5,
                   updated_at = ?6",
                params![id, team, name, cpu_count, memory_mb, now_ms],
            )?;
            let row = tx.query_row(
                "SELECT * FROM tpl_templates WHERE team = ?1 AND name = ?2",
                params![team, name],
                tpl_row,
            )?;
            tx.commit()?;
            Ok(row)
        })
        .await
    }

    /// Templates whose id or name is `key`, of any team.
    pub async fn templates_named(&self, key: &str) -> Result<Vec<TplRow>> {
        let key = key.to_string();
        self.run(move |c| {
            let mut st =
                c.prepare_cached("SELECT * FROM tpl_templates WHERE id = ?1 OR name = ?1")?;
            let rows = st.query_map(params![key], tpl_row)?;
            Ok(rows.collect::<rusqlite::Result<Vec<_>>>()?)
        })
        .await
    }

    /// The templates of `team`, oldest first.
    pub async fn list_templates(&self, team: &str) -> Result<Vec<TplRow>> {
        let team = team.to_string();
        self.run(move |c| {
            let mut st = c.prepare_cached(
                "SELECT * FROM tpl_templates WHERE team = ?1 ORDER BY created_at, id",
            )?;
            let rows = st.query_map(params![team], tpl_row)?;
            Ok(rows.collect::<rusqlite::Result<Vec<_>>>()?)
        })
        .await
    }

    pub async fn set_public(&self, id: &str, public: bool, now_ms: i64) -> Result<()> {
        let id = id.to_string();
        self.run(move |c| {
            c.execute(
                "UPDATE tpl_templates SET public = ?2, updated_at = ?3 WHERE id = ?1",
                params![id, public as i64, now_ms],
            )?;
            Ok(())
        })
        .await
    }

    /// Deletes a template with its builds, logs, tags and their history; the snapshots its
    /// builds made or ended on are left to the garbage collection (`tpl_orphans`).
    pub async fn delete_template(&self, id: &str) -> Result<()> {
        let id = id.to_string();
        self.run(move |c| {
            let tx = c.transaction()?;
            tx.execute(
                "INSERT OR IGNORE INTO tpl_orphans (team, snapshot_id)
                 SELECT t.team, s.snap FROM tpl_templates t, (
                   SELECT l.snapshot_id AS snap FROM tpl_build_layers l JOIN tpl_builds b
                     ON b.id = l.build_id WHERE b.template_id = ?1 UNION
                   SELECT substr(target, 6) FROM tpl_builds
                     WHERE template_id = ?1 AND target LIKE 'snap:%') s
                 WHERE t.id = ?1",
                params![id],
            )?;
            tx.execute(
                "DELETE FROM tpl_build_logs WHERE build_id IN
                   (SELECT id FROM tpl_builds WHERE template_id = ?1)",
                params![id],
            )?;
            tx.execute(
                "DELETE FROM tpl_build_layers WHERE build_id IN
                   (SELECT id FROM tpl_builds WHERE template_id = ?1)",
                params![id],
            )?;
            tx.execute("DELETE FROM tpl_builds WHERE template_id = ?1", params![id])?;
            tx.execute("DELETE FROM tpl_tags WHERE template_id = ?1", params![id])?;
            tx.execute(
                "DELETE FROM tpl_tag_assignments WHERE template_id = ?1",
                params![id],
            )?;
            tx.execute("DELETE FROM tpl_templates WHERE id = ?1", params![id])?;
            tx.commit()?;
            Ok(())
        })
        .await
    }

    // ---- builds ----

    pub async fn insert_build(&self, b: &BuildRow) -> Result<()> {
        let b = b.clone();
        self.run(move |c| {
            c.execute(
                "INSERT INTO tpl_builds (id, template_id, status, tags, created_at)
                 VALUES (?1, ?2, ?3, ?4, ?5)",
                params![
                    b.id,
                    b.template_id,
                    b.status,
                    serde_json::to_string(&b.tags)?,
                    b.created_at_ms
                ],
            )?;
            Ok(())
        })
        .await
    }

    pub async fn get_build(&self, id: &str) -> Result<Option<BuildRow>> {
        let id = id.to_string();
        self.run(move |c| {
            Ok(c.query_row(
                "SELECT * FROM tpl_builds WHERE id = ?1",
                params![id],
                build_row,
            )
            .optional()?)
        })
        .await
    }

    /// The newest ready build of a template.
    pub async fn latest_ready(&self, template_id: &str) -> Result<Option<BuildRow>> {
        let id = template_id.to_string();
        self.run(move |c| {
            Ok(c.query_row(
                "SELECT * FROM tpl_builds WHERE template_id = ?1 AND status = 'ready'
                 ORDER BY finished_at DESC LIMIT 1",
                params![id],
                build_row,
            )
            .optional()?)
        })
        .await
    }

    /// Records the start request of a waiting build and moves it to `building`; false when
    /// it was started before.
    pub async fn start_build(&self, id: &str, spec: &str) -> Result<bool> {
        let (id, spec) = (id.to_string(), spec.to_string());
        self.run(move |c| {
            let n = c.execute(
                "UPDATE tpl_builds SET spec = ?2, status = 'building'
                 WHERE id = ?1 AND spec IS NULL AND status = 'waiting'",
                params![id, spec],
            )?;
            Ok(n == 1)
        })
        .await
    }

    /// Ends a build: `ready` with what its sandboxes start from, or `error` with a reason.
    pub async fn finish_build(&self, b: &BuildRow, now_ms: i64) -> Result<()> {
        let b = b.clone();
        self.run(move |c| {
            c.execute(
                "UPDATE tpl_builds SET status = ?2, reason = ?3, reason_step = ?4, target = ?5,
                   user_name = ?6, workdir = ?7, finished_at = ?8 WHERE id = ?1",
                params![
                    b.id,
                    b.status,
                    b.reason,
                    b.reason_step,
                    b.target,
                    b.user,
                    b.workdir,
                    now_ms
                ],
            )?;
            Ok(())
        })
        .await
    }

    /// Ends every build still `building` (a server that stopped mid-build) with `reason`;
    /// returns their ids.
    pub async fn fail_unfinished(&self, reason: &str, now_ms: i64) -> Result<Vec<String>> {
        let reason = reason.to_string();
        self.run(move |c| {
            // IMMEDIATE: read, then write (an upgrading read transaction fails at once when
            // another connection wrote in between).
            let tx = c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            let ids = {
                let mut st = tx.prepare("SELECT id FROM tpl_builds WHERE status = 'building'")?;
                let rows = st.query_map([], |r| r.get::<_, String>(0))?;
                rows.collect::<rusqlite::Result<Vec<_>>>()?
            };
            tx.execute(
                "UPDATE tpl_builds SET status = 'error', reason = ?1, reason_step = 'finalize',
                   finished_at = ?2 WHERE status = 'building'",
                params![reason, now_ms],
            )?;
            tx.commit()?;
            Ok(ids)
        })
        .await
    }

    // ---- logs ----

    /// Appends a line to a build's log.
    pub async fn add_log(
        &self,
        build_id: &str,
        level: &str,
        step: Option<String>,
        message: String,
        ts_ms: i64,
    ) -> Result<()> {
        let (id, level) = (build_id.to_string(), level.to_string());
        self.run(move |c| {
            c.execute(
                "INSERT INTO tpl_build_logs (build_id, seq, ts, level, step, message)
                 VALUES (?1, (SELECT COALESCE(MAX(seq), 0) + 1 FROM tpl_build_logs
                   WHERE build_id = ?1), ?2, ?3, ?4, ?5)",
                params![id, ts_ms, level, step, message],
            )?;
            Ok(())
        })
        .await
    }

    /// Up to `limit` log lines of a build at `min_level` or above, skipping the first
    /// `offset` of them; newest first when `backward`.
    pub async fn logs(
        &self,
        build_id: &str,
        offset: u64,
        limit: u32,
        min_level: usize,
        backward: bool,
    ) -> Result<Vec<BuildLogRow>> {
        let id = build_id.to_string();
        let levels: Vec<String> = LEVELS[min_level.min(LEVELS.len() - 1)..]
            .iter()
            .map(|s| s.to_string())
            .collect();
        self.run(move |c| {
            let order = if backward { "DESC" } else { "ASC" };
            let mut st = c.prepare(&format!(
                "SELECT seq, ts, level, step, message FROM tpl_build_logs
                 WHERE build_id = ?1 AND level IN (SELECT value FROM json_each(?2))
                 ORDER BY seq {order} LIMIT ?3 OFFSET ?4"
            ))?;
            let rows = st.query_map(
                params![id, serde_json::to_string(&levels)?, limit, offset as i64],
                |r| {
                    Ok(BuildLogRow {
                        seq: r.get(0)?,
                        ts_ms: r.get(1)?,
                        level: r.get(2)?,
                        step: r.get(3)?,
                        message: r.get(4)?,
                    })
                },
            )?;
            Ok(rows.collect::<rusqlite::Result<Vec<_>>>()?)
        })
        .await
    }

    // ---- tags ----

    /// Points `tags` of a template at `build_id`, recording each assignment.
    pub async fn assign_tags(
        &self,
        template_id: &str,
        tags: &[String],
        build_id: &str,
        now_ms: i64,
    ) -> Result<()> {
        let (id, tags, build) = (template_id.to_string(), tags.to_vec(), build_id.to_string());
        self.run(move |c| {
            let tx = c.transaction()?;
            for t in &tags {
                tx.execute(
                    "INSERT INTO tpl_tags (template_id, tag, build_id, assigned_at)
                     VALUES (?1, ?2, ?3, ?4) ON CONFLICT (template_id, tag)
                     DO UPDATE SET build_id = ?3, assigned_at = ?4",
                    params![id, t, build, now_ms],
                )?;
                tx.execute(
                    "INSERT INTO tpl_tag_assignments (id, template_id, tag, build_id, assigned_at)
                     VALUES (?1, ?2, ?3, ?4, ?5)",
                    params![uuid::Uuid::new_v4().to_string(), id, t, build, now_ms],
                )?;
            }
            tx.commit()?;
            Ok(())
        })
        .await
    }

    /// Removes tags of a template (and their assignment history); how many existed.
    pub async fn remove_tags(&self, template_id: &str, tags: &[String]) -> Result<usize> {
        let (id, tags) = (template_id.to_string(), tags.to_vec());
        self.run(move |c| {
            let tx = c.transaction()?;
            let mut n = 0;
            for t in &tags {
                n += tx.execute(
                    "DELETE FROM tpl_tags WHERE template_id = ?1 AND tag = ?2",
                    params![id, t],
                )?;
                tx.execute(
                    "DELETE FROM tpl_tag_assignments WHERE template_id = ?1 AND tag = ?2",
                    params![id, t],
                )?;
            }
            tx.commit()?;
            Ok(n)
        })
        .await
    }

    /// The tags of a template, by name.
    pub async fn tags(&self, template_id: &str) -> Result<Vec<TagRow>> {
        let id = template_id.to_string();
        self.run(move |c| {
            let mut st = c.prepare_cached(
                "SELECT tag, build_id, assigned_at FROM tpl_tags WHERE template_id = ?1
                 ORDER BY tag",
            )?;
            let rows = st.query_map(params![id], |r| {
                Ok(TagRow {
                    tag: r.get(0)?,
                    build_id: r.get(1)?,
                    assigned_at_ms: r.get(2)?,
                })
            })?;
            Ok(rows.collect::<rusqlite::Result<Vec<_>>>()?)
        })
        .await
    }

    // ---- step cache ----

    /// Snapshot ids the step cache and finished builds use (hidden from `GET /snapshots`).
    pub async fn build_snapshot_ids(&self) -> Result<Vec<String>> {
        self.run(move |c| {
            let mut st = c.prepare_cached(
                "SELECT snapshot_id FROM tpl_layers UNION
                 SELECT snapshot_id FROM tpl_build_layers UNION
                 SELECT snapshot_id FROM tpl_orphans UNION
                 SELECT substr(target, 6) FROM tpl_builds WHERE target LIKE 'snap:%'",
            )?;
            let rows = st.query_map([], |r| r.get::<_, String>(0))?;
            Ok(rows.collect::<rusqlite::Result<Vec<_>>>()?)
        })
        .await
    }

    // ---- uploaded files ----

    pub async fn file_present(&self, team: &str, hash: &str) -> Result<bool> {
        let (team, hash) = (team.to_string(), hash.to_string());
        self.run(move |c| {
            Ok(c.query_row(
                "SELECT 1 FROM tpl_files WHERE team = ?1 AND hash = ?2",
                params![team, hash],
                |_| Ok(()),
            )
            .optional()?
            .is_some())
        })
        .await
    }

    /// Restarts the grace period of `team`'s archive `hash` (a client was just told it is
    /// present, so its build will need it).
    pub async fn touch_file(&self, team: &str, hash: &str, now_ms: i64) -> Result<()> {
        let (team, hash) = (team.to_string(), hash.to_string());
        self.run(move |c| {
            c.execute(
                "UPDATE tpl_files SET created_at = ?3 WHERE team = ?1 AND hash = ?2",
                params![team, hash, now_ms],
            )?;
            Ok(())
        })
        .await
    }

    pub async fn put_file(&self, team: &str, hash: &str, size: u64, now_ms: i64) -> Result<()> {
        let (team, hash) = (team.to_string(), hash.to_string());
        self.run(move |c| {
            c.execute(
                "INSERT INTO tpl_files (team, hash, size, created_at) VALUES (?1, ?2, ?3, ?4)
                 ON CONFLICT (team, hash) DO UPDATE SET size = ?3, created_at = ?4",
                params![team, hash, size as i64, now_ms],
            )?;
            Ok(())
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn builds_start_once_and_logs_page() {
        let db = BuildsDb::open_in_memory().unwrap();
        let t = db
            .ensure_template("red", "app", "tid1", Some(2), None, 1)
            .await
            .unwrap();
        let again = db
            .ensure_template("red", "app", "tid2", None, Some(512), 2)
            .await
            .unwrap();
        assert_eq!((t.id.as_str(), again.id.as_str()), ("tid1", "tid1"));
        assert_eq!(again.memory_mb, Some(512));
        let b = BuildRow {
            id: "b1".into(),
            template_id: t.id.clone(),
            status: "waiting".into(),
            created_at_ms: 3,
            ..Default::default()
        };
        db.insert_build(&b).await.unwrap();
        assert!(db.start_build("b1", "{}").await.unwrap());
        assert!(!db.start_build("b1", "{}").await.unwrap());
        for (i, lvl) in ["info", "debug", "error"].iter().enumerate() {
            db.add_log("b1", lvl, Some("1".into()), format!("m{i}"), 5)
                .await
                .unwrap();
        }
        let all = db.logs("b1", 0, 100, 0, false).await.unwrap();
        assert_eq!(all.iter().map(|l| l.seq).collect::<Vec<_>>(), [1, 2, 3]);
        let info = db.logs("b1", 1, 100, 1, false).await.unwrap();
        assert_eq!(info.len(), 1);
        assert_eq!(info[0].message, "m2");
        assert_eq!(db.fail_unfinished("restart", 9).await.unwrap(), ["b1"]);
        let b = db.get_build("b1").await.unwrap().unwrap();
        assert_eq!(
            (b.status.as_str(), b.reason.as_deref()),
            ("error", Some("restart"))
        );
    }
}
