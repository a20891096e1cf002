//! A connection of its own to the state database, for the table families that keep one
//! (secrets, volumes, template builds): opened on the file the state store migrated, each call
//! run on tokio's blocking pool under the connection's lock.

use std::path::Path;
use std::sync::{Arc, Mutex};

use rusqlite::Connection;

use super::{Result, StoreError};

#[derive(Clone)]
pub(crate) struct SideDb(Arc<Mutex<Connection>>);

impl SideDb {
    /// Opens the state database at `path` (already migrated by the state store).
    pub(crate) fn open(path: &Path) -> Result<Self> {
        let c = Connection::open(path).map_err(|source| StoreError::Open {
            path: path.display().to_string(),
            source,
        })?;
        c.busy_timeout(std::time::Duration::from_secs(10))?;
        c.pragma_update(None, "journal_mode", "WAL")?;
        Ok(Self(Arc::new(Mutex::new(c))))
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
