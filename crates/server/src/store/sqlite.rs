//! The embedded [`StateStore`]: one SQLite file (`<state>/kiln.db`, WAL). Calls run on tokio's
//! blocking pool, so async code never waits on SQLite's file locks on a runtime thread.

use std::path::Path;
use std::sync::{Arc, Mutex};

use rusqlite::{params, Connection, OptionalExtension};

use super::rows::{finish, finish_snapshot, key_from_row, sandbox_from_row, snapshot_from_row};
use super::{idempotency_sql, migrations, obs_sql, IdempotentAnswer};
use super::{
    now_ms, teams, Attempt, DeliveryRecord, Event, EventQuery, Ingress, KeyRecord, PauseMode,
    Result, SandboxRecord, SandboxState, SnapshotRecord, StoreError, StoredEvent, TeamRecord,
    TemplateRecord, WebhookRecord,
};
use super::{AccessStore, EventStore, IdempotencyStore, SandboxStore, TemplateStore};

/// The SQLite state database.
#[derive(Clone)]
pub struct SqliteStore {
    conn: Arc<Mutex<Connection>>,
}

impl SqliteStore {
    /// Opens (creating if needed) the database at `path` and migrates it to the current
    /// schema. The file is made readable by its owner only (it holds key hashes and tokens).
    pub fn open(path: &Path) -> Result<Self> {
        let mut conn = Connection::open(path).map_err(|source| StoreError::Open {
            path: path.display().to_string(),
            source,
        })?;
        {
            use std::os::unix::fs::PermissionsExt;
            let _ = std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600));
        }
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        migrations::migrate(&mut conn)?;
        Ok(Self::wrap(conn))
    }

    /// Opens an existing database for reading only (`kiln doctor` beside a running server):
    /// nothing is created or migrated, and a database at another schema version is refused.
    pub fn open_read_only(path: &Path) -> Result<Self> {
        use rusqlite::OpenFlags;
        let conn = Connection::open_with_flags(
            path,
            OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(|source| StoreError::Open {
            path: path.display().to_string(),
            source,
        })?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        let found = migrations::version(&conn)?;
        if found != migrations::CURRENT_VERSION {
            return Err(StoreError::OtherVersion {
                found,
                known: migrations::CURRENT_VERSION,
            });
        }
        Ok(Self::wrap(conn))
    }

    /// An in-memory database (tests).
    pub fn open_in_memory() -> Result<Self> {
        let mut conn = Connection::open_in_memory()?;
        migrations::migrate(&mut conn)?;
        Ok(Self::wrap(conn))
    }

    fn wrap(conn: Connection) -> Self {
        Self {
            conn: Arc::new(Mutex::new(conn)),
        }
    }

    /// Schema version of the open database.
    pub fn schema_version(&self) -> Result<i64> {
        migrations::version(&self.lock())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Connection> {
        // A panic while holding the lock cannot leave SQLite inconsistent (every write is one
        // statement), so a poisoned lock is still safe to use.
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` on the connection on the blocking pool.
    async fn with<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let me = self.clone();
        tokio::task::spawn_blocking(move || f(&me.lock()))
            .await
            .map_err(|e| StoreError::Task(e.to_string()))?
    }

    /// Runs `f` on the connection (for transactions) on the blocking pool.
    async fn with_mut<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Connection) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let me = self.clone();
        tokio::task::spawn_blocking(move || f(&mut me.lock()))
            .await
            .map_err(|e| StoreError::Task(e.to_string()))?
    }
}

#[async_trait::async_trait]
impl SandboxStore for SqliteStore {
    async fn insert_sandbox(&self, s: &SandboxRecord) -> Result<()> {
        let s = s.clone();
        self.with(move |c| {
            c.execute(
                "INSERT INTO sandboxes (id, template_id, alias, client_id, state, metadata,
                   env_vars, cpu_count, memory_mb, disk_size_mb, envd_token, started_at, end_at,
                   ended_at, end_reason, auto_pause, driver, pause_mode, auto_resume,
                   auto_pause_memory, team, traffic_token, mask_request_host)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16,
                   ?17, ?18, ?19, ?20, ?21, ?22, ?23)",
                params![
                    s.id,
                    s.template_id,
                    s.alias,
                    s.client_id,
                    s.state.as_str(),
                    serde_json::to_string(&s.metadata)?,
                    serde_json::to_string(&s.env_vars)?,
                    s.cpu_count,
                    s.memory_mb,
                    s.disk_size_mb,
                    s.envd_token,
                    s.started_at_ms,
                    s.end_at_ms,
                    s.ended_at_ms,
                    s.end_reason,
                    s.auto_pause as i64,
                    s.driver,
                    s.pause_mode.map(PauseMode::as_str),
                    s.auto_resume as i64,
                    s.auto_pause_memory as i64,
                    s.team,
                    s.ingress.traffic_token,
                    s.ingress.mask_request_host,
                ],
            )?;
            Ok(())
        })
        .await
    }
    async fn get_sandbox(&self, id: &str) -> Result<Option<SandboxRecord>> {
        let id = id.to_string();
        self.with(move |c| {
            c.query_row(
                "SELECT * FROM sandboxes WHERE id = ?1",
                [id],
                sandbox_from_row,
            )
            .optional()?
            .map(finish)
            .transpose()
        })
        .await
    }
    async fn list_sandboxes(&self, states: &[SandboxState]) -> Result<Vec<SandboxRecord>> {
        let states = states.to_vec();
        self.with(move |c| {
            let mut stmt = c.prepare("SELECT * FROM sandboxes ORDER BY started_at, id")?;
            let rows = stmt.query_map([], sandbox_from_row)?;
            let mut out = Vec::new();
            for r in rows {
                let s = finish(r?)?;
                if states.is_empty() || states.contains(&s.state) {
                    out.push(s);
                }
            }
            Ok(out)
        })
        .await
    }
    async fn set_state(&self, id: &str, state: SandboxState, reason: Option<&str>) -> Result<()> {
        let (id, reason) = (id.to_string(), reason.map(str::to_string));
        self.with(move |c| {
            let ended = (!state.is_live()).then(now_ms);
            c.execute(
                "UPDATE sandboxes SET state = ?2, ended_at = COALESCE(?3, ended_at),
                   end_reason = COALESCE(?4, end_reason) WHERE id = ?1",
                params![id, state.as_str(), ended, reason],
            )?;
            Ok(())
        })
        .await
    }
    async fn set_paused(&self, id: &str, mode: PauseMode) -> Result<()> {
        let id = id.to_string();
        self.with(move |c| {
            c.execute(
                "UPDATE sandboxes SET state = 'paused', pause_mode = ?2 WHERE id = ?1",
                params![id, mode.as_str()],
            )?;
            Ok(())
        })
        .await
    }

    async fn set_ingress(&self, id: &str, ingress: &Ingress) -> Result<()> {
        let (id, i) = (id.to_string(), ingress.clone());
        self.with(move |c| {
            c.execute(
                "UPDATE sandboxes SET traffic_token = ?2, mask_request_host = ?3 WHERE id = ?1",
                params![id, i.traffic_token, i.mask_request_host],
            )?;
            Ok(())
        })
        .await
    }

    async fn set_end_at(&self, id: &str, end_at_ms: i64) -> Result<()> {
        let id = id.to_string();
        self.with(move |c| {
            c.execute(
                "UPDATE sandboxes SET end_at = ?2 WHERE id = ?1",
                params![id, end_at_ms],
            )?;
            Ok(())
        })
        .await
    }
    async fn set_running(&self, id: &str, end_at_ms: i64, template: &str) -> Result<()> {
        let (id, template) = (id.to_string(), template.to_string());
        self.with_mut(move |c| {
            let tx = c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            tx.execute(
                "UPDATE sandboxes SET state = 'running', end_at = ?2 WHERE id = ?1",
                params![id, end_at_ms],
            )?;
            tx.execute(
                "UPDATE templates SET spawn_count = spawn_count + 1, last_spawned = ?2
                 WHERE name = ?1",
                params![template, now_ms()],
            )?;
            tx.commit()?;
            Ok(())
        })
        .await
    }
    async fn expired(&self, now: i64) -> Result<Vec<String>> {
        self.with(move |c| {
            let mut stmt = c.prepare(
                "SELECT id FROM sandboxes WHERE state = 'running' AND end_at <= ?1
                 ORDER BY end_at, id",
            )?;
            let rows = stmt.query_map([now], |r| r.get::<_, String>(0))?;
            Ok(rows.collect::<rusqlite::Result<Vec<_>>>()?)
        })
        .await
    }
    async fn insert_snapshot(&self, s: &SnapshotRecord) -> Result<()> {
        let s = s.clone();
        self.with(move |c| {
            c.execute(
                "INSERT INTO snapshots (id, name, sandbox_id, template_id, envd_token, env_vars,
                   created_at, size_bytes, team) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
                params![
                    s.id,
                    s.name,
                    s.sandbox_id,
                    s.template_id,
                    s.envd_token,
                    serde_json::to_string(&s.env_vars)?,
                    s.created_at_ms,
                    s.size_bytes as i64,
                    s.team,
                ],
            )?;
            Ok(())
        })
        .await
    }
    async fn get_snapshot(&self, key: &str) -> Result<Option<SnapshotRecord>> {
        let key = key.to_string();
        self.with(move |c| {
            c.query_row(
                "SELECT * FROM snapshots WHERE id = ?1 OR name = ?1",
                [key],
                snapshot_from_row,
            )
            .optional()?
            .map(finish_snapshot)
            .transpose()
        })
        .await
    }
    async fn list_snapshots(&self) -> Result<Vec<SnapshotRecord>> {
        self.with(|c| {
            let mut stmt = c.prepare("SELECT * FROM snapshots ORDER BY created_at, id")?;
            let rows = stmt.query_map([], snapshot_from_row)?;
            let mut out = Vec::new();
            for r in rows {
                out.push(finish_snapshot(r?)?);
            }
            Ok(out)
        })
        .await
    }
    async fn delete_snapshot(&self, id: &str) -> Result<bool> {
        let id = id.to_string();
        self.with(move |c| Ok(c.execute("DELETE FROM snapshots WHERE id = ?1", [id])? > 0))
            .await
    }
}

#[async_trait::async_trait]
impl EventStore for SqliteStore {
    async fn add_event(&self, sandbox_id: &str, kind: &str, detail: &str) -> Result<()> {
        let (sid, kind, detail) = (sandbox_id.to_string(), kind.to_string(), detail.to_string());
        self.with(move |c| {
            c.execute(
                "INSERT INTO events (ts, sandbox_id, kind, detail) VALUES (?1, ?2, ?3, ?4)",
                params![now_ms(), sid, kind, detail],
            )?;
            Ok(())
        })
        .await
    }
    async fn events(&self, sandbox_id: &str) -> Result<Vec<Event>> {
        let sid = sandbox_id.to_string();
        self.with(move |c| {
            let mut stmt = c.prepare(
                "SELECT ts, sandbox_id, kind, detail FROM events WHERE sandbox_id = ?1
                 ORDER BY seq",
            )?;
            let rows = stmt.query_map([sid], |r| {
                Ok(Event {
                    ts_ms: r.get(0)?,
                    sandbox_id: r.get(1)?,
                    kind: r.get(2)?,
                    detail: r.get(3)?,
                })
            })?;
            Ok(rows.collect::<rusqlite::Result<Vec<_>>>()?)
        })
        .await
    }
    async fn events_page(&self, q: &EventQuery) -> Result<Vec<StoredEvent>> {
        let q = q.clone();
        self.with(move |c| obs_sql::events_page(c, &q)).await
    }
    async fn insert_webhook(&self, w: &WebhookRecord) -> Result<()> {
        let w = w.clone();
        self.with(move |c| obs_sql::insert_webhook(c, &w)).await
    }
    async fn list_webhooks(&self, team: &str) -> Result<Vec<WebhookRecord>> {
        let team = team.to_string();
        self.with(move |c| obs_sql::list_webhooks(c, &team)).await
    }
    async fn get_webhook(&self, team: &str, id: &str) -> Result<Option<WebhookRecord>> {
        let (team, id) = (team.to_string(), id.to_string());
        self.with(move |c| obs_sql::get_webhook(c, &team, &id))
            .await
    }
    async fn delete_webhook(&self, team: &str, id: &str) -> Result<bool> {
        let (team, id) = (team.to_string(), id.to_string());
        self.with_mut(move |c| obs_sql::delete_webhook(c, &team, &id))
            .await
    }
    async fn queue_deliveries(&self, now: i64, max_events: u32) -> Result<usize> {
        self.with_mut(move |c| obs_sql::queue_deliveries(c, now, max_events))
            .await
    }
    async fn enqueue_delivery(&self, webhook_id: &str, kind: &str, payload: &str) -> Result<i64> {
        let (w, k, p) = (
            webhook_id.to_string(),
            kind.to_string(),
            payload.to_string(),
        );
        self.with(move |c| obs_sql::enqueue_delivery(c, &w, &k, &p, now_ms()))
            .await
    }
    async fn due_deliveries(
        &self,
        now: i64,
        limit: u32,
    ) -> Result<Vec<(DeliveryRecord, WebhookRecord)>> {
        self.with(move |c| obs_sql::due_deliveries(c, now, limit))
            .await
    }
    async fn record_attempt(&self, id: i64, a: &Attempt) -> Result<()> {
        let a = a.clone();
        self.with(move |c| obs_sql::record_attempt(c, id, &a)).await
    }
    async fn deliveries(
        &self,
        webhook_id: &str,
        before: Option<i64>,
        limit: u32,
    ) -> Result<Vec<DeliveryRecord>> {
        let w = webhook_id.to_string();
        self.with(move |c| obs_sql::deliveries(c, &w, before, limit))
            .await
    }
}

#[async_trait::async_trait]
impl AccessStore for SqliteStore {
    async fn insert_key(&self, k: &KeyRecord) -> Result<()> {
        let k = k.clone();
        self.with(move |c| {
            c.execute(
                "INSERT INTO api_keys (id, name, prefix, hash, created_at, last_used, revoked_at,
                   team) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
                params![
                    k.id,
                    k.name,
                    k.prefix,
                    k.hash,
                    k.created_at_ms,
                    k.last_used_ms,
                    k.revoked_at_ms,
                    k.team,
                ],
            )?;
            Ok(())
        })
        .await
    }
    async fn list_keys(&self) -> Result<Vec<KeyRecord>> {
        self.with(|c| {
            let mut stmt = c.prepare("SELECT * FROM api_keys ORDER BY created_at, id")?;
            let rows = stmt.query_map([], key_from_row)?;
            Ok(rows.collect::<rusqlite::Result<Vec<_>>>()?)
        })
        .await
    }
    async fn key_by_hash(&self, hash: &str) -> Result<Option<KeyRecord>> {
        let hash = hash.to_string();
        self.with(move |c| {
            Ok(c.query_row(
                "SELECT * FROM api_keys WHERE hash = ?1",
                [hash],
                key_from_row,
            )
            .optional()?)
        })
        .await
    }
    async fn touch_key(&self, id: &str) -> Result<()> {
        let id = id.to_string();
        self.with(move |c| {
            c.execute(
                "UPDATE api_keys SET last_used = ?2 WHERE id = ?1",
                params![id, now_ms()],
            )?;
            Ok(())
        })
        .await
    }
    async fn revoke_key(&self, id: &str) -> Result<bool> {
        let id = id.to_string();
        self.with(move |c| {
            let n = c.execute(
                "UPDATE api_keys SET revoked_at = ?2 WHERE id = ?1 AND revoked_at IS NULL",
                params![id, now_ms()],
            )?;
            Ok(n > 0)
        })
        .await
    }
    async fn upsert_team(&self, t: &TeamRecord) -> Result<()> {
        let t = t.clone();
        self.with(move |c| teams::upsert(c, &t)).await
    }
    async fn get_team(&self, name: &str) -> Result<Option<TeamRecord>> {
        let name = name.to_string();
        self.with(move |c| teams::get(c, &name)).await
    }
    async fn list_teams(&self) -> Result<Vec<TeamRecord>> {
        self.with(teams::list).await
    }
}

#[async_trait::async_trait]
impl TemplateStore for SqliteStore {
    async fn upsert_template(&self, t: &TemplateRecord) -> Result<()> {
        let t = t.clone();
        self.with(move |c| {
            c.execute(
                "INSERT INTO templates (name, key, built_at, size_bytes, spawn_count,
                   last_spawned, image)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)
                 ON CONFLICT(name) DO UPDATE SET key = ?2, built_at = ?3, size_bytes = ?4,
                   image = ?7",
                params![
                    t.name,
                    t.key,
                    t.built_at_ms,
                    t.size_bytes as i64,
                    t.spawn_count as i64,
                    t.last_spawned_ms,
                    t.image,
                ],
            )?;
            Ok(())
        })
        .await
    }
    async fn get_template(&self, name: &str) -> Result<Option<TemplateRecord>> {
        let name = name.to_string();
        self.with(move |c| {
            Ok(c.query_row(
                "SELECT name, key, built_at, size_bytes, spawn_count, last_spawned, image
                 FROM templates WHERE name = ?1",
                [name],
                |r| {
                    Ok(TemplateRecord {
                        name: r.get(0)?,
                        key: r.get(1)?,
                        built_at_ms: r.get(2)?,
                        size_bytes: r.get::<_, i64>(3)? as u64,
                        spawn_count: r.get::<_, i64>(4)? as u64,
                        last_spawned_ms: r.get(5)?,
                        image: r.get(6)?,
                    })
                },
            )
            .optional()?)
        })
        .await
    }
}

#[async_trait::async_trait]
impl IdempotencyStore for SqliteStore {
    async fn put_idempotent(&self, a: &IdempotentAnswer) -> Result<()> {
        let a = a.clone();
        self.with(move |c| idempotency_sql::put(c, &a)).await
    }
    async fn get_idempotent(
        &self,
        s: &str,
        k: &str,
        since: i64,
    ) -> Result<Option<IdempotentAnswer>> {
        let (s, k) = (s.to_string(), k.to_string());
        self.with(move |c| idempotency_sql::get(c, &s, &k, since))
            .await
    }
}

#[cfg(test)]
#[path = "sqlite_tests.rs"]
pub(super) mod tests;
