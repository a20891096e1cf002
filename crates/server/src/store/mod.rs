//! kiln's state, the one place that speaks SQL. Each aggregate sits behind a trait of its own
//! (in `aggregates`): sandboxes and snapshots, events and webhooks, keys and teams, templates,
//! idempotent answers, the audit chain and the metrics history; [`StateStore`] is the first
//! five together. The embedded default is SQLite: one file
//! `<state>/kiln.db` that [`StateDb`] opens and migrates once (versioned migrations in
//! `migrations`) and that hands out each aggregate — [`SqliteStore`], `audit_sql`,
//! `metrics_sql`, and the side tables (`secrets_sql`, `volumes_sql`, `tplbuild*_sql`,
//! `console_sql`; `alerts_sql` for the rule engine) on connections made by `side_db`. A
//! clustered store implements the same traits.
//!
//! The store is the authority on which sandboxes exist, their state and when they end; the
//! manager's in-memory registry is a cache of it that [`crate::manager::Manager::recover`]
//! rebuilds.

mod aggregates;
pub mod alerts_sql;
mod audit_sql;
#[cfg(test)]
mod busy_writer;
mod console_sql;
mod idempotency_sql;
mod metrics_sql;
mod migrations;
mod obs_sql;
mod records;
mod rows;
mod secrets_sql;
mod side_db;
mod sqlite;
mod state_db;
mod teams;
mod tplbuild_gc_sql;
mod tplbuild_list_sql;
mod tplbuild_sql;
mod tplbuild_tags_sql;
mod volumes_sql;

pub use aggregates::{
    AccessStore, AuditStore, EventStore, IdempotencyStore, MetricsStore, SandboxStore, Sealer,
    SecretStore, StoredChain, TemplateStore,
};
pub use audit_sql::SqliteAuditStore;
pub use console_sql::{ConsoleDb, SessionRow};
pub use metrics_sql::SqliteMetricsStore;
pub use migrations::{CURRENT_VERSION, MIGRATIONS};
pub use obs_sql::{event_payload, wants as webhook_wants};
pub use records::*;
pub use secrets_sql::{SecretCursor, SecretRecord, SecretsDb};
pub use sqlite::SqliteStore;
pub use state_db::StateDb;
pub use tplbuild_gc_sql::GcPlan;
pub use tplbuild_list_sql::{BuildSummary, MAX_BUILDS};
pub use tplbuild_sql::{BuildLogRow, BuildRow, BuildsDb, TagRow, TplRow, LEVELS};
pub use tplbuild_tags_sql::AssignmentRow;
pub use volumes_sql::{Inserted, MountRecord, VolumeRecord, VolumesDb};

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
    #[error(
        "the state database has schema version {found}, newer than this kiln knows ({known}): \
         upgrade kiln, or point --state-dir at another directory"
    )]
    TooNew { found: i64, known: i64 },
    #[error(
        "the state database has schema version {found} and this kiln reads version {known}: \
         run the kiln that matches it, or start `kiln serve` to migrate it"
    )]
    OtherVersion { found: i64, known: i64 },
    #[error("migrating the state database to schema version {version}: {source}")]
    Migration {
        version: i64,
        #[source]
        source: rusqlite::Error,
    },
    #[error("state database task failed: {0}")]
    Task(String),
    /// What this store cannot do (a cluster's store for a read only one host can answer);
    /// the message names it.
    #[error("{0}")]
    Unsupported(String),
    /// A request this store cannot read (a cursor of another kind of log); the message says
    /// what to pass instead.
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

pub fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// Everything kiln keeps about sandboxes, templates, keys and events: every aggregate's
/// trait at once, for the code that wires a backend in. Each method is one atomic write or
/// one consistent read, so a `kill -9` never leaves half a change; code that needs one
/// aggregate takes its trait alone (an `Arc<dyn StateStore>` coerces to any of them).
pub trait StateStore:
    SandboxStore + EventStore + AccessStore + TemplateStore + IdempotencyStore
{
}

impl<T> StateStore for T where
    T: SandboxStore + EventStore + AccessStore + TemplateStore + IdempotencyStore
{
}
