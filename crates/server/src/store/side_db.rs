//! Connections of their own to the state database, for the aggregates that keep one (secrets,
//! volumes, template builds, the console, alerts, the audit chain, the metrics history):
//! [`connect`] opens one on the file the state store migrated; [`SideDb`] runs each call on
//! tokio's blocking pool under its connection's lock.

use std::path::Path;
use std::sync::{Arc, Mutex};

use rusqlite::Connection;

use super::{Result, StoreError};

/// The `synchronous` setting of a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Synchronous {
    /// SQLite's default (`FULL`).
    Default,
    /// `NORMAL`: in WAL mode a commit is durable once the WAL is checkpointed (the audit log's
    /// connections, which write often).
    Normal,
}

/// Opens a connection to the (already migrated) state database at `path`: WAL, a 10 s busy
/// timeout, and `sync`.
pub(crate) fn connect(path: &Path, sync: Synchronous) -> Result<Connection> {
    let c = Connection::open(path).map_err(|source| StoreError::Open {
        path: path.display().to_string(),
        source,
    })?;
    c.busy_timeout(std::time::Duration::from_secs(10))?;
    c.pragma_update(None, "journal_mode", "WAL")?;
    if sync == Synchronous::Normal {
        c.pragma_update(None, "synchronous", "NORMAL")?;
    }
    Ok(c)
}

#[derive(Clone)]
pub(crate) struct SideDb(Arc<Mutex<Connection>>);

impl SideDb {
    /// Opens the state database at `path` (already migrated by the state store).
    pub(crate) fn open(path: &Path) -> Result<Self> {
        connect(path, Synchronous::Default).map(|c| Self(Arc::new(Mutex::new(c))))
    }

    /// An in-memory database with the current schema (tests).
    pub(crate) fn open_in_memory() -> Result<Self> {
        let mut c = Connection::open_in_memory()?;
        super::migrations::migrate(&mut c)?;
        Ok(Self(Arc::new(Mutex::new(c))))
    }

    /// Runs `f` on the connection, off the async runtime.
    pub(crate) async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Connection) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let c = self.0.clone();
        tokio::task::spawn_blocking(move || f(&mut c.lock().unwrap_or_else(|p| p.into_inner())))
            .await
            .map_err(|e| StoreError::Task(e.to_string()))?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_are_wal_with_a_busy_timeout_and_their_synchronous_setting() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kiln.db");
        crate::store::StateDb::open(&path).unwrap();
        // synchronous: FULL is 2, NORMAL is 1.
        for (sync, want) in [(Synchronous::Default, 2), (Synchronous::Normal, 1)] {
            let c = connect(&path, sync).unwrap();
            let journal: String = c
                .query_row("PRAGMA journal_mode", [], |r| r.get(0))
                .unwrap();
            let synchronous: i64 = c.query_row("PRAGMA synchronous", [], |r| r.get(0)).unwrap();
            let busy: i64 = c
                .query_row("PRAGMA busy_timeout", [], |r| r.get(0))
                .unwrap();
            assert_eq!(
                (journal.as_str(), synchronous, busy),
                ("wal", want, 10_000),
                "{sync:?}"
            );
        }
    }
}
