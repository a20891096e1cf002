//! kiln's state: one SQLite file (`<state>/kiln.db`) with sandboxes, templates, API keys and
//! lifecycle events. Every write is a single statement, so a `kill -9` never leaves half a row.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Mutex;

use rusqlite::{params, Connection, OptionalExtension, Row};
use serde::{Deserialize, Serialize};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("corrupt JSON column: {0}")]
    Json(#[from] serde_json::Error),
    #[error("opening {path}: {source}")]
    Open {
        path: String,
        #[source]
        source: rusqlite::Error,
    },
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// Where a sandbox is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SandboxState {
    /// Being created (driver work in progress).
    Starting,
    Running,
    Paused,
    /// Ended: killed by request, expired, or cleaned up after a crash.
    Killed,
    /// Creation failed.
    Failed,
}

impl SandboxState {
    pub fn as_str(self) -> &'static str {
        match self {
            SandboxState::Starting => "starting",
            SandboxState::Running => "running",
            SandboxState::Paused => "paused",
            SandboxState::Killed => "killed",
            SandboxState::Failed => "failed",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "starting" => SandboxState::Starting,
            "running" => SandboxState::Running,
            "paused" => SandboxState::Paused,
            "killed" => SandboxState::Killed,
            "failed" => SandboxState::Failed,
            _ => return None,
        })
    }
    /// Whether the sandbox still holds host resources.
    pub fn is_live(self) -> bool {
        matches!(
            self,
            SandboxState::Starting | SandboxState::Running | SandboxState::Paused
        )
    }
}

/// One sandbox row.
#[derive(Debug, Clone, PartialEq)]
pub struct SandboxRecord {
    pub id: String,
    pub template_id: String,
    pub alias: Option<String>,
    pub client_id: String,
    pub state: SandboxState,
    pub metadata: BTreeMap<String, String>,
    pub env_vars: BTreeMap<String, String>,
    pub cpu_count: u32,
    pub memory_mb: u32,
    pub disk_size_mb: u32,
    pub envd_token: Option<String>,
    pub started_at_ms: i64,
    pub end_at_ms: i64,
    pub ended_at_ms: Option<i64>,
    pub end_reason: Option<String>,
    pub auto_pause: bool,
    pub driver: String,
}

/// One API key row (the key itself is never stored, only its SHA-256).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRecord {
    pub id: String,
    pub name: String,
    /// First characters of the key, shown by `kiln keys list` to recognise it.
    pub prefix: String,
    pub hash: String,
    pub created_at_ms: i64,
    pub last_used_ms: Option<i64>,
    pub revoked_at_ms: Option<i64>,
}

/// One lifecycle event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Event {
    pub ts_ms: i64,
    pub sandbox_id: String,
    pub kind: String,
    pub detail: String,
}

/// A template the server has seen (spawn statistics for `GET /templates`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TemplateRecord {
    pub name: String,
    pub key: String,
    pub built_at_ms: i64,
    pub size_bytes: u64,
    pub spawn_count: u64,
    pub last_spawned_ms: Option<i64>,
}

pub fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY,
    template_id TEXT NOT NULL,
    alias TEXT,
    client_id TEXT NOT NULL,
    state TEXT NOT NULL,
    metadata TEXT NOT NULL,
    env_vars TEXT NOT NULL,
    cpu_count INTEGER NOT NULL,
    memory_mb INTEGER NOT NULL,
    disk_size_mb INTEGER NOT NULL,
    envd_token TEXT,
    started_at INTEGER NOT NULL,
    end_at INTEGER NOT NULL,
    ended_at INTEGER,
    end_reason TEXT,
    auto_pause INTEGER NOT NULL DEFAULT 0,
    driver TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS sandboxes_state ON sandboxes(state);
CREATE TABLE IF NOT EXISTS api_keys (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    prefix TEXT NOT NULL,
    hash TEXT NOT NULL UNIQUE,
    created_at INTEGER NOT NULL,
    last_used INTEGER,
    revoked_at INTEGER
);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    ts INTEGER NOT NULL,
    sandbox_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    detail TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_sandbox ON events(sandbox_id);
CREATE TABLE IF NOT EXISTS templates (
    name TEXT PRIMARY KEY,
    key TEXT NOT NULL,
    built_at INTEGER NOT NULL,
    size_bytes INTEGER NOT NULL,
    spawn_count INTEGER NOT NULL DEFAULT 0,
    last_spawned INTEGER
);
";

/// The state database.
pub struct Store {
    conn: Mutex<Connection>,
}

fn sandbox_from_row(r: &Row<'_>) -> rusqlite::Result<(SandboxRecord, String, String)> {
    let state: String = r.get("state")?;
    Ok((
        SandboxRecord {
            id: r.get("id")?,
            template_id: r.get("template_id")?,
            alias: r.get("alias")?,
            client_id: r.get("client_id")?,
            state: SandboxState::parse(&state).unwrap_or(SandboxState::Failed),
            metadata: BTreeMap::new(),
            env_vars: BTreeMap::new(),
            cpu_count: r.get("cpu_count")?,
            memory_mb: r.get("memory_mb")?,
            disk_size_mb: r.get("disk_size_mb")?,
            envd_token: r.get("envd_token")?,
            started_at_ms: r.get("started_at")?,
            end_at_ms: r.get("end_at")?,
            ended_at_ms: r.get("ended_at")?,
            end_reason: r.get("end_reason")?,
            auto_pause: r.get::<_, i64>("auto_pause")? != 0,
            driver: r.get("driver")?,
        },
        r.get("metadata")?,
        r.get("env_vars")?,
    ))
}

fn finish(row: (SandboxRecord, String, String)) -> Result<SandboxRecord> {
    let (mut s, md, env) = row;
    s.metadata = serde_json::from_str(&md)?;
    s.env_vars = serde_json::from_str(&env)?;
    Ok(s)
}

fn key_from_row(r: &Row<'_>) -> rusqlite::Result<KeyRecord> {
    Ok(KeyRecord {
        id: r.get("id")?,
        name: r.get("name")?,
        prefix: r.get("prefix")?,
        hash: r.get("hash")?,
        created_at_ms: r.get("created_at")?,
        last_used_ms: r.get("last_used")?,
        revoked_at_ms: r.get("revoked_at")?,
    })
}

impl Store {
    /// Opens (creating if needed) the database at `path`.
    pub fn open(path: &Path) -> Result<Self> {
        let conn = Connection::open(path).map_err(|source| StoreError::Open {
            path: path.display().to_string(),
            source,
        })?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.execute_batch(SCHEMA)?;
        Ok(Self {
            conn: Mutex::new(conn),
        })
    }

    /// An in-memory database (tests).
    pub fn open_in_memory() -> Result<Self> {
        let conn = Connection::open_in_memory()?;
        conn.execute_batch(SCHEMA)?;
        Ok(Self {
            conn: Mutex::new(conn),
        })
    }

    fn conn(&self) -> std::sync::MutexGuard<'_, Connection> {
        // A panic while holding the lock cannot leave SQLite inconsistent (every write is one
        // statement), so a poisoned lock is still safe to use.
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    // ---- sandboxes ----

    pub fn insert_sandbox(&self, s: &SandboxRecord) -> Result<()> {
        self.conn().execute(
            "INSERT INTO sandboxes (id, template_id, alias, client_id, state, metadata, env_vars,
               cpu_count, memory_mb, disk_size_mb, envd_token, started_at, end_at, ended_at,
               end_reason, auto_pause, driver)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17)",
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
            ],
        )?;
        Ok(())
    }

    pub fn get_sandbox(&self, id: &str) -> Result<Option<SandboxRecord>> {
        let row = self
            .conn()
            .query_row(
                "SELECT * FROM sandboxes WHERE id = ?1",
                [id],
                sandbox_from_row,
            )
            .optional()?;
        row.map(finish).transpose()
    }

    /// Sandboxes in any of `states` (all when empty), oldest first.
    pub fn list_sandboxes(&self, states: &[SandboxState]) -> Result<Vec<SandboxRecord>> {
        let conn = self.conn();
        let mut stmt = conn.prepare("SELECT * FROM sandboxes ORDER BY started_at, id")?;
        let rows = stmt.query_map([], sandbox_from_row)?;
        let mut out = Vec::new();
        for r in rows {
            let s = finish(r?)?;
            if states.is_empty() || states.contains(&s.state) {
                out.push(s);
            }
        }
        Ok(out)
    }

    /// Moves a sandbox to `state`; ending states also record when and why.
    pub fn set_state(&self, id: &str, state: SandboxState, reason: Option<&str>) -> Result<()> {
        let ended = (!state.is_live()).then(now_ms);
        self.conn().execute(
            "UPDATE sandboxes SET state = ?2, ended_at = COALESCE(?3, ended_at),
               end_reason = COALESCE(?4, end_reason) WHERE id = ?1",
            params![id, state.as_str(), ended, reason],
        )?;
        Ok(())
    }

    pub fn set_end_at(&self, id: &str, end_at_ms: i64) -> Result<()> {
        self.conn().execute(
            "UPDATE sandboxes SET end_at = ?2 WHERE id = ?1",
            params![id, end_at_ms],
        )?;
        Ok(())
    }

    // ---- events ----

    pub fn add_event(&self, sandbox_id: &str, kind: &str, detail: &str) -> Result<()> {
        self.conn().execute(
            "INSERT INTO events (ts, sandbox_id, kind, detail) VALUES (?1, ?2, ?3, ?4)",
            params![now_ms(), sandbox_id, kind, detail],
        )?;
        Ok(())
    }

    pub fn events(&self, sandbox_id: &str) -> Result<Vec<Event>> {
        let conn = self.conn();
        let mut stmt = conn.prepare(
            "SELECT ts, sandbox_id, kind, detail FROM events WHERE sandbox_id = ?1 ORDER BY seq",
        )?;
        let rows = stmt.query_map([sandbox_id], |r| {
            Ok(Event {
                ts_ms: r.get(0)?,
                sandbox_id: r.get(1)?,
                kind: r.get(2)?,
                detail: r.get(3)?,
            })
        })?;
        Ok(rows.collect::<rusqlite::Result<Vec<_>>>()?)
    }

    // ---- keys ----

    pub fn insert_key(&self, k: &KeyRecord) -> Result<()> {
        self.conn().execute(
            "INSERT INTO api_keys (id, name, prefix, hash, created_at, last_used, revoked_at)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
            params![
                k.id,
                k.name,
                k.prefix,
                k.hash,
                k.created_at_ms,
                k.last_used_ms,
                k.revoked_at_ms
            ],
        )?;
        Ok(())
    }

    pub fn list_keys(&self) -> Result<Vec<KeyRecord>> {
        let conn = self.conn();
        let mut stmt = conn.prepare("SELECT * FROM api_keys ORDER BY created_at, id")?;
        let rows = stmt.query_map([], key_from_row)?;
        Ok(rows.collect::<rusqlite::Result<Vec<_>>>()?)
    }

    pub fn key_by_hash(&self, hash: &str) -> Result<Option<KeyRecord>> {
        Ok(self
            .conn()
            .query_row(
                "SELECT * FROM api_keys WHERE hash = ?1",
                [hash],
                key_from_row,
            )
            .optional()?)
    }

    pub fn touch_key(&self, id: &str) -> Result<()> {
        self.conn().execute(
            "UPDATE api_keys SET last_used = ?2 WHERE id = ?1",
            params![id, now_ms()],
        )?;
        Ok(())
    }

    /// Revokes the key whose id is `id`; false when no such unrevoked key exists.
    pub fn revoke_key(&self, id: &str) -> Result<bool> {
        let n = self.conn().execute(
            "UPDATE api_keys SET revoked_at = ?2 WHERE id = ?1 AND revoked_at IS NULL",
            params![id, now_ms()],
        )?;
        Ok(n > 0)
    }

    // ---- templates ----

    pub fn upsert_template(&self, t: &TemplateRecord) -> Result<()> {
        self.conn().execute(
            "INSERT INTO templates (name, key, built_at, size_bytes, spawn_count, last_spawned)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)
             ON CONFLICT(name) DO UPDATE SET key = ?2, built_at = ?3, size_bytes = ?4",
            params![
                t.name,
                t.key,
                t.built_at_ms,
                t.size_bytes as i64,
                t.spawn_count as i64,
                t.last_spawned_ms
            ],
        )?;
        Ok(())
    }

    pub fn template_spawned(&self, name: &str) -> Result<()> {
        self.conn().execute(
            "UPDATE templates SET spawn_count = spawn_count + 1, last_spawned = ?2 WHERE name = ?1",
            params![name, now_ms()],
        )?;
        Ok(())
    }

    pub fn get_template(&self, name: &str) -> Result<Option<TemplateRecord>> {
        Ok(self
            .conn()
            .query_row(
                "SELECT name, key, built_at, size_bytes, spawn_count, last_spawned
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
                    })
                },
            )
            .optional()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(id: &str, state: SandboxState) -> SandboxRecord {
        SandboxRecord {
            id: id.into(),
            template_id: "base".into(),
            alias: Some("base".into()),
            client_id: "kiln".into(),
            state,
            metadata: BTreeMap::from([("k".into(), "v".into())]),
            env_vars: BTreeMap::from([("A".into(), "1".into())]),
            cpu_count: 2,
            memory_mb: 512,
            disk_size_mb: 1024,
            envd_token: Some("tok".into()),
            started_at_ms: 1000,
            end_at_ms: 2000,
            ended_at_ms: None,
            end_reason: None,
            auto_pause: false,
            driver: "gvisor".into(),
        }
    }

    #[test]
    fn sandbox_roundtrip_and_state_changes_persist_on_disk() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("kiln.db");
        {
            let s = Store::open(&db).unwrap();
            s.insert_sandbox(&sample("a", SandboxState::Running))
                .unwrap();
            s.insert_sandbox(&sample("b", SandboxState::Starting))
                .unwrap();
            s.set_end_at("a", 5000).unwrap();
            s.set_state("b", SandboxState::Killed, Some("expired"))
                .unwrap();
            s.add_event("a", "created", "template base").unwrap();
        }
        // Reopen: everything was written through to the file.
        let s = Store::open(&db).unwrap();
        let a = s.get_sandbox("a").unwrap().unwrap();
        let mut want = sample("a", SandboxState::Running);
        want.end_at_ms = 5000;
        assert_eq!(a, want);
        let b = s.get_sandbox("b").unwrap().unwrap();
        assert_eq!(b.state, SandboxState::Killed);
        assert_eq!(b.end_reason.as_deref(), Some("expired"));
        assert!(b.ended_at_ms.is_some());
        let running = s.list_sandboxes(&[SandboxState::Running]).unwrap();
        assert_eq!(running.len(), 1);
        assert_eq!(running[0].id, "a");
        assert_eq!(s.list_sandboxes(&[]).unwrap().len(), 2);
        assert!(s.get_sandbox("zzz").unwrap().is_none());
        let ev = s.events("a").unwrap();
        assert_eq!(ev.len(), 1);
        assert_eq!(ev[0].kind, "created");
    }

    #[test]
    fn duplicate_sandbox_id_is_rejected() {
        let s = Store::open_in_memory().unwrap();
        s.insert_sandbox(&sample("a", SandboxState::Running))
            .unwrap();
        assert!(s
            .insert_sandbox(&sample("a", SandboxState::Running))
            .is_err());
    }

    #[test]
    fn keys_and_templates() {
        let s = Store::open_in_memory().unwrap();
        let k = KeyRecord {
            id: "k1".into(),
            name: "first".into(),
            prefix: "e2b_12".into(),
            hash: "h".into(),
            created_at_ms: 1,
            last_used_ms: None,
            revoked_at_ms: None,
        };
        s.insert_key(&k).unwrap();
        assert_eq!(s.key_by_hash("h").unwrap().unwrap().id, "k1");
        assert!(s.key_by_hash("nope").unwrap().is_none());
        s.touch_key("k1").unwrap();
        assert!(s.list_keys().unwrap()[0].last_used_ms.is_some());
        assert!(s.revoke_key("k1").unwrap());
        assert!(!s.revoke_key("k1").unwrap(), "second revoke is a no-op");
        assert!(s.key_by_hash("h").unwrap().unwrap().revoked_at_ms.is_some());

        let t = TemplateRecord {
            name: "base".into(),
            key: "abc".into(),
            built_at_ms: 7,
            size_bytes: 9,
            spawn_count: 0,
            last_spawned_ms: None,
        };
        s.upsert_template(&t).unwrap();
        s.template_spawned("base").unwrap();
        s.upsert_template(&t).unwrap(); // re-upsert keeps the counters
        let got = s.get_template("base").unwrap().unwrap();
        assert_eq!(got.spawn_count, 1);
        assert!(got.last_spawned_ms.is_some());
    }
}
