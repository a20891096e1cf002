//! kiln's state, the one place that speaks SQL. [`StateStore`] (one async trait) holds
//! sandboxes, snapshots, templates, API keys, teams, lifecycle events and webhooks; the audit
//! chain and the metrics history sit behind traits of their own ([`AuditStore`],
//! [`MetricsStore`] in `aggregates`). The embedded default is SQLite: one file
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
mod tplbuild_sql;
mod tplbuild_tags_sql;
mod volumes_sql;

pub use aggregates::{AuditStore, MetricsStore, StoredChain};
pub use audit_sql::SqliteAuditStore;
pub use console_sql::{BuildSummary, ConsoleDb, SessionRow, MAX_BUILDS};
pub use metrics_sql::SqliteMetricsStore;
pub use migrations::{CURRENT_VERSION, MIGRATIONS};
pub use obs_sql::{event_payload, wants as webhook_wants};
pub use records::*;
pub use secrets_sql::{SecretCursor, SecretRecord, SecretsDb};
pub use sqlite::SqliteStore;
pub use state_db::StateDb;
pub use tplbuild_gc_sql::GcPlan;
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
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

pub fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// Everything kiln keeps about sandboxes, templates, keys and events. Every method is one
/// atomic write or one consistent read, so a `kill -9` never leaves half a change.
#[async_trait::async_trait]
pub trait StateStore: Send + Sync + 'static {
    // ---- sandboxes ----
    async fn insert_sandbox(&self, s: &SandboxRecord) -> Result<()>;
    async fn get_sandbox(&self, id: &str) -> Result<Option<SandboxRecord>>;
    /// Sandboxes in any of `states` (all when empty), oldest first.
    async fn list_sandboxes(&self, states: &[SandboxState]) -> Result<Vec<SandboxRecord>>;
    /// Moves a sandbox to `state`; ending states also record when and why.
    async fn set_state(&self, id: &str, state: SandboxState, reason: Option<&str>) -> Result<()>;
    /// Marks a sandbox paused, recording what its pause saved.
    async fn set_paused(&self, id: &str, mode: PauseMode) -> Result<()>;
    async fn set_end_at(&self, id: &str, end_at_ms: i64) -> Result<()>;
    /// Records a sandbox's ingress settings (a sandbox of an older kiln, at recovery).
    async fn set_ingress(&self, id: &str, ingress: &Ingress) -> Result<()>;
    /// A created sandbox became usable: running until `end_at_ms`, and one more spawn of
    /// `template` (one write, where a create used to make three).
    async fn set_running(&self, id: &str, end_at_ms: i64, template: &str) -> Result<()>;
    /// Ids of running sandboxes whose end time is at or before `now_ms`.
    async fn expired(&self, now_ms: i64) -> Result<Vec<String>>;

    // ---- snapshots ----
    async fn insert_snapshot(&self, s: &SnapshotRecord) -> Result<()>;
    /// The snapshot whose id or name is `key`.
    async fn get_snapshot(&self, key: &str) -> Result<Option<SnapshotRecord>>;
    /// Every snapshot, oldest first.
    async fn list_snapshots(&self) -> Result<Vec<SnapshotRecord>>;
    /// Deletes the snapshot `id`; false when there is none.
    async fn delete_snapshot(&self, id: &str) -> Result<bool>;

    // ---- events ----
    async fn add_event(&self, sandbox_id: &str, kind: &str, detail: &str) -> Result<()>;
    async fn events(&self, sandbox_id: &str) -> Result<Vec<Event>>;
    /// A page of the event log in sequence order (the events API).
    async fn events_page(&self, q: &EventQuery) -> Result<Vec<StoredEvent>>;

    // ---- webhooks ----
    async fn insert_webhook(&self, w: &WebhookRecord) -> Result<()>;
    /// The webhooks of `team`, oldest first.
    async fn list_webhooks(&self, team: &str) -> Result<Vec<WebhookRecord>>;
    async fn get_webhook(&self, team: &str, id: &str) -> Result<Option<WebhookRecord>>;
    /// Deletes a webhook and its deliveries; false when `team` has no such webhook.
    async fn delete_webhook(&self, team: &str, id: &str) -> Result<bool>;
    /// Turns events not yet seen by the webhook dispatcher into pending deliveries for every
    /// webhook that wants them, and advances its cursor — in one transaction, so an event is
    /// queued exactly once across restarts. Returns how many deliveries were queued.
    async fn queue_deliveries(&self, now_ms: i64, max_events: u32) -> Result<usize>;
    /// Queues one delivery of `payload` (a test delivery); returns its id.
    async fn enqueue_delivery(&self, webhook_id: &str, kind: &str, payload: &str) -> Result<i64>;
    /// Pending deliveries due at `now_ms`, with their webhook's URL and secret.
    async fn due_deliveries(
        &self,
        now_ms: i64,
        limit: u32,
    ) -> Result<Vec<(DeliveryRecord, WebhookRecord)>>;
    /// Records one attempt of delivery `id`.
    async fn record_attempt(&self, id: i64, a: &Attempt) -> Result<()>;
    /// The deliveries of a webhook, newest first, before delivery id `before` when given.
    async fn deliveries(
        &self,
        webhook_id: &str,
        before: Option<i64>,
        limit: u32,
    ) -> Result<Vec<DeliveryRecord>>;

    // ---- API keys ----
    async fn insert_key(&self, k: &KeyRecord) -> Result<()>;
    async fn list_keys(&self) -> Result<Vec<KeyRecord>>;
    async fn key_by_hash(&self, hash: &str) -> Result<Option<KeyRecord>>;
    async fn touch_key(&self, id: &str) -> Result<()>;
    /// Revokes the key whose id is `id`; false when no such unrevoked key exists.
    async fn revoke_key(&self, id: &str) -> Result<bool>;

    // ---- templates ----
    /// Records a template (keeps its spawn counters when it exists).
    async fn upsert_template(&self, t: &TemplateRecord) -> Result<()>;
    async fn get_template(&self, name: &str) -> Result<Option<TemplateRecord>>;

    // ---- teams ----
    /// Records a team's quotas (replacing them when it exists; its creation time is kept).
    async fn upsert_team(&self, t: &TeamRecord) -> Result<()>;
    async fn get_team(&self, name: &str) -> Result<Option<TeamRecord>>;
    /// Teams with quotas of their own, by name.
    async fn list_teams(&self) -> Result<Vec<TeamRecord>>;

    // ---- idempotency keys ----
    /// Records the answer of a create made with an idempotency key.
    async fn put_idempotent(&self, a: &IdempotentAnswer) -> Result<()>;
    /// The answer recorded for `scope` and `key` at or after `since_ms` (older ones go).
    async fn get_idempotent(
        &self,
        scope: &str,
        key: &str,
        since_ms: i64,
    ) -> Result<Option<IdempotentAnswer>>;
}
