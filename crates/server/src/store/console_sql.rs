//! SQL of the web console ([`crate::console`]): its sessions, in the `console_sessions` table
//! (migration 15) — a row per open session, keyed by the SHA-256 of its id (the
//! cookie's value, which is never stored), with the SHA-256 of the API key it was opened with
//! and its end, so a restarted server finds them again.

use std::path::Path;

use rusqlite::{params, Connection, OptionalExtension};

use super::side_db::SideDb;
use super::Result;

/// One stored session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionRow {
    /// SHA-256 (hex) of the session id.
    pub id_hash: String,
    /// SHA-256 (hex) of the API key it was opened with.
    pub key_hash: String,
    pub created_at_ms: i64,
    pub expires_at_ms: i64,
}

/// The console's connection to the state database.
#[derive(Clone)]
pub struct ConsoleDb(SideDb);

impl std::fmt::Debug for ConsoleDb {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ConsoleDb")
    }
}

impl ConsoleDb {
    /// Opens the state database at `path` (already migrated by the state store).
    pub fn open(path: &Path) -> Result<Self> {
        SideDb::open(path).map(Self)
    }

    /// A database in memory with the current schema (a server without a state directory,
    /// tests): its sessions end with the process.
    pub fn open_in_memory() -> Result<Self> {
        SideDb::open_in_memory().map(Self)
    }

    async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    ) -> Result<T> {
        self.0.run(move |c| f(c).map_err(Into::into)).await
    }

    /// Drops the sessions ended by `now_ms`, then stores `row` unless `max` sessions are
    /// open already; whether it was stored.
    pub async fn insert_within(&self, row: SessionRow, now_ms: i64, max: usize) -> Result<bool> {
        self.run(move |c| {
            c.execute(
                "DELETE FROM console_sessions WHERE expires_at <= ?1",
                [now_ms],
            )?;
            let open: i64 =
                c.query_row("SELECT COUNT(*) FROM console_sessions", [], |r| r.get(0))?;
            if open as usize >= max {
                return Ok(false);
            }
            c.execute(
                "INSERT INTO console_sessions (id_hash, key_hash, created_at, expires_at)
                 VALUES (?1, ?2, ?3, ?4)",
                params![
                    row.id_hash,
                    row.key_hash,
                    row.created_at_ms,
                    row.expires_at_ms
                ],
            )?;
            Ok(true)
        })
        .await
    }

    /// The session whose id hashes to `id_hash`, if stored.
    pub async fn get(&self, id_hash: &str) -> Result<Option<SessionRow>> {
        let id_hash = id_hash.to_string();
        self.run(move |c| {
            c.query_row(
                "SELECT id_hash, key_hash, created_at, expires_at FROM console_sessions
                 WHERE id_hash = ?1",
                [id_hash],
                |r| {
                    Ok(SessionRow {
                        id_hash: r.get(0)?,
                        key_hash: r.get(1)?,
                        created_at_ms: r.get(2)?,
                        expires_at_ms: r.get(3)?,
                    })
                },
            )
            .optional()
        })
        .await
    }

    /// Removes the sessions ended by `now_ms`; how many.
    pub async fn delete_ended(&self, now_ms: i64) -> Result<usize> {
        self.run(move |c| {
            c.execute(
                "DELETE FROM console_sessions WHERE expires_at <= ?1",
                [now_ms],
            )
        })
        .await
    }

    /// Removes a session; whether there was one.
    pub async fn delete(&self, id_hash: &str) -> Result<bool> {
        let id_hash = id_hash.to_string();
        self.run(move |c| {
            Ok(c.execute("DELETE FROM console_sessions WHERE id_hash = ?1", [id_hash])? > 0)
        })
        .await
    }

    /// Sessions stored (ended ones included until the next sign-in sweeps them).
    pub async fn count(&self) -> Result<usize> {
        self.run(|c| {
            c.query_row("SELECT COUNT(*) FROM console_sessions", [], |r| {
                r.get::<_, i64>(0)
            })
        })
        .await
        .map(|n| n.max(0) as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: &str, expires: i64) -> SessionRow {
        SessionRow {
            id_hash: id.into(),
            key_hash: format!("k-{id}"),
            created_at_ms: 1,
            expires_at_ms: expires,
        }
    }

    #[tokio::test]
    async fn rows_round_trip_expire_and_stay_bounded() {
        let db = ConsoleDb::open_in_memory().unwrap();
        assert!(db.insert_within(row("a", 100), 10, 2).await.unwrap());
        assert!(db.insert_within(row("b", 50), 10, 2).await.unwrap());
        assert!(
            !db.insert_within(row("c", 100), 10, 2).await.unwrap(),
            "two open: the third is refused"
        );
        assert_eq!(db.get("a").await.unwrap(), Some(row("a", 100)));
        assert!(db.get("c").await.unwrap().is_none());
        // At 60, b has ended: it is swept and c fits.
        assert!(db.insert_within(row("c", 100), 60, 2).await.unwrap());
        assert!(db.get("b").await.unwrap().is_none());
        assert!(db.delete("a").await.unwrap());
        assert!(!db.delete("a").await.unwrap());
        assert_eq!(db.count().await.unwrap(), 1);
        assert_eq!(db.delete_ended(99).await.unwrap(), 0);
        assert_eq!(db.delete_ended(100).await.unwrap(), 1, "c ends at 100");
        assert_eq!(db.count().await.unwrap(), 0);
    }

    #[tokio::test]
    async fn sessions_outlive_the_connection_on_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kiln.db");
        // The state store makes the file and migrates it.
        drop(crate::store::SqliteStore::open(&path).unwrap());
        let db = ConsoleDb::open(&path).unwrap();
        db.insert_within(row("x", i64::MAX), 0, 10).await.unwrap();
        drop(db);
        let again = ConsoleDb::open(&path).unwrap();
        assert_eq!(again.get("x").await.unwrap(), Some(row("x", i64::MAX)));
    }
}
