//! The state database, opened once: [`StateDb::open`] migrates `<state>/kiln.db` and hands
//! out every aggregate kiln keeps in it — the state store, the audit chain, the metrics
//! history, and the side tables (secrets, volumes, template builds, the console) —
//! each on a connection of its own made here, with the pragmas [`super::side_db::connect`]
//! sets.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::aggregates::{AuditStore, MetricsStore};
use super::audit_sql::SqliteAuditStore;
use super::metrics_sql::SqliteMetricsStore;
use super::{BuildsDb, ConsoleDb, Result, SecretsDb, SqliteStore, StateStore, VolumesDb};

/// The open, migrated state database.
pub struct StateDb {
    path: PathBuf,
    state: SqliteStore,
}

impl StateDb {
    /// Opens (creating if needed) the database at `path` and migrates it to the current
    /// schema.
    pub fn open(path: &Path) -> Result<Self> {
        Ok(Self {
            state: SqliteStore::open(path)?,
            path: path.to_path_buf(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Sandboxes, snapshots, templates, keys, teams, events and webhooks.
    pub fn state(&self) -> Arc<dyn StateStore> {
        Arc::new(self.state.clone())
    }

    /// The audit chain.
    pub fn audit(&self) -> Result<Arc<dyn AuditStore>> {
        Ok(Arc::new(SqliteAuditStore::open(&self.path)?))
    }

    /// The metrics history.
    pub fn metrics(&self) -> Result<Arc<dyn MetricsStore>> {
        Ok(Arc::new(SqliteMetricsStore::open(&self.path)?))
    }

    pub fn secrets(&self) -> Result<SecretsDb> {
        SecretsDb::open(&self.path)
    }

    pub fn volumes(&self) -> Result<VolumesDb> {
        VolumesDb::open(&self.path)
    }

    pub fn builds(&self) -> Result<BuildsDb> {
        BuildsDb::open(&self.path)
    }

    pub fn console(&self) -> Result<ConsoleDb> {
        ConsoleDb::open(&self.path)
    }
}
