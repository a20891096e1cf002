//! The store's aggregates, each behind a trait of its own so that another backend (etcd in a
//! cluster) carries each one whole: sandboxes and snapshots ([`SandboxStore`]), the event log
//! and webhook queue ([`EventStore`]), keys and teams ([`AccessStore`]), templates
//! ([`TemplateStore`]), idempotent answers ([`IdempotencyStore`]), the audit chain
//! ([`AuditStore`]) and the metrics history ([`MetricsStore`]). [`super::StateStore`] is the
//! first five together. The SQLite implementations are [`super::SqliteStore`],
//! [`super::audit_sql`] and [`super::metrics_sql`]; [`super::StateDb`] hands them out.

use crate::audit::chain::Head;
use crate::audit::cursor::Page;
use crate::audit::filter::Filter;
use crate::audit::record::{Append, AuditRecord};
use crate::obs::ring::MetricSample;

use super::alerts_sql::{AlertFilter, AlertRecord};
use super::{
    Attempt, DeliveryRecord, Event, EventQuery, IdempotentAnswer, Ingress, KeyRecord, PauseMode,
    Result, SandboxRecord, SandboxState, SecretCursor, SecretRecord, SnapshotRecord, StoredEvent,
    TeamRecord, TemplateRecord, WebhookRecord,
};

/// What verifying one sandbox's chain reads.
#[derive(Debug, Clone, Default)]
pub struct StoredChain {
    /// Its stored records in seq order.
    pub records: Vec<AuditRecord>,
    /// Where retention cut it: the last removed record's seq and hash.
    pub anchor: Option<(i64, String)>,
    /// Its head as recorded.
    pub head: Option<Head>,
}

/// The audit log's records: one append-only hash chain per sandbox, its head, and the anchors
/// retention leaves. Calls block: the audit writer is a thread of its own, and readers call
/// from the blocking pool. Appends and pruning come from that one writer only.
pub trait AuditStore: Send + Sync + 'static {
    /// Appends `batch` in one atomic write, each record after its chain's head (a link starts
    /// the child's chain at its parent's head); the records as stored, in order.
    fn append(&self, batch: &[Append]) -> Result<Vec<AuditRecord>>;
    /// Retention: removes records older than `before_ms` and all but the newest `keep`,
    /// leaving each cut chain an anchor so what remains still verifies; how many went.
    fn prune(&self, before_ms: Option<i64>, keep: Option<u64>, now_ms: i64) -> Result<usize>;
    /// Records matching `f`, oldest first, at most `f.limit`.
    fn query(&self, f: &Filter) -> Result<Vec<AuditRecord>>;
    /// [`AuditStore::query`] as a page with the cursor that follows it (a store whose records
    /// several hosts keep merges their pages).
    fn page(&self, f: &Filter) -> Result<Page<AuditRecord>> {
        let items = self.query(f)?;
        Ok(Page::local(items, f.after.as_ref(), |r| r.cursor))
    }
    /// Every sandbox with a chain (of `team`'s sandboxes only, when given), in the order the
    /// chains started.
    fn chains(&self, team: Option<&str>) -> Result<Vec<String>>;
    /// One sandbox's chain as stored, for verification.
    fn chain(&self, sandbox_id: &str) -> Result<StoredChain>;
    /// The hash of record `seq` of `sandbox_id`'s chain (None: no such record, e.g. pruned).
    fn record_hash(&self, sandbox_id: &str, seq: i64) -> Result<Option<String>>;
    /// The key that created `sandbox_id`, from its chain's first API record.
    fn owner(&self, sandbox_id: &str) -> Result<Option<String>>;
    /// The team sandbox `id` belongs (or belonged) to, if known.
    fn team_of(&self, id: &str) -> Result<Option<String>>;
    /// The rule engine's alerts matching `f` (raised from audit records; read beside them).
    fn alerts(&self, f: &AlertFilter) -> Result<Page<AlertRecord>>;
    /// Installs `guard` over this store's appends (once); false when this store takes none.
    fn set_guard(&self, _guard: std::sync::Arc<dyn crate::audit::guard::ChainGuard>) -> bool {
        false
    }
}

/// The metrics history: the samples each sandbox's ring keeps, so that a restarted server
/// still has the history of its live and paused sandboxes.
#[async_trait::async_trait]
pub trait MetricsStore: Send + Sync + 'static {
    /// Adds (or replaces, at the same time) a sample of `id`.
    async fn add_sample(&self, id: &str, s: MetricSample) -> Result<()>;
    /// Replaces the samples of `id` with `samples` in one write.
    async fn replace_samples(&self, id: &str, samples: Vec<MetricSample>) -> Result<()>;
    /// The samples of `id`, oldest first.
    async fn samples(&self, id: &str) -> Result<Vec<MetricSample>>;
    /// Deletes the histories of `ids` in one write.
    async fn delete_samples(&self, ids: Vec<String>) -> Result<()>;
    /// Deletes every history but those of `live` in one write.
    async fn keep_only(&self, live: Vec<String>) -> Result<()>;
}

/// Seals a secret's new value for the secret's id (see [`SecretStore::new_version`]).
pub type Sealer = Box<dyn Fn(&str) -> Vec<u8> + Send + Sync>;

/// Teams' secrets, each record holding its current value sealed by [`crate::vault`] (a store
/// never sees a value in clear). Keys of one team never name another team's secret; a `key` is
/// a secret's id or its (case-insensitive) name.
#[async_trait::async_trait]
pub trait SecretStore: Send + Sync + 'static {
    /// Stores a new secret; false when its team already has one of that name.
    async fn insert(&self, s: &SecretRecord) -> Result<bool>;
    /// The secret of `team` whose id or name is `key`.
    async fn get(&self, team: &str, key: &str) -> Result<Option<SecretRecord>>;
    /// Up to `limit` secrets of `team` in creation order (then id), after `after` when given.
    async fn list(
        &self,
        team: &str,
        after: Option<SecretCursor>,
        limit: u32,
    ) -> Result<Vec<SecretRecord>>;
    /// Makes the value `seal` seals for the secret's id the next version of `team`'s secret
    /// `key` (and `metadata` its metadata when given); the record after the change, `None`
    /// when there is none. `seal` may be called more than once (a write that lost a race is
    /// planned again).
    async fn new_version(
        &self,
        team: &str,
        key: &str,
        seal: Sealer,
        metadata: Option<std::collections::BTreeMap<String, String>>,
        now_ms: i64,
    ) -> Result<Option<SecretRecord>>;
    /// Deletes `team`'s secret `key` (its value is gone with it); false when there is none.
    async fn delete(&self, team: &str, key: &str) -> Result<bool>;
}

/// Sandboxes and their snapshots: which exist, their state and when they end.
#[async_trait::async_trait]
pub trait SandboxStore: Send + Sync + 'static {
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

    async fn insert_snapshot(&self, s: &SnapshotRecord) -> Result<()>;
    /// The snapshot whose id or name is `key`.
    async fn get_snapshot(&self, key: &str) -> Result<Option<SnapshotRecord>>;
    /// Every snapshot, oldest first.
    async fn list_snapshots(&self) -> Result<Vec<SnapshotRecord>>;
    /// Deletes the snapshot `id`; false when there is none.
    async fn delete_snapshot(&self, id: &str) -> Result<bool>;
}

/// The lifecycle event log and the webhook queue fed from it.
#[async_trait::async_trait]
pub trait EventStore: Send + Sync + 'static {
    async fn add_event(&self, sandbox_id: &str, kind: &str, detail: &str) -> Result<()>;
    async fn events(&self, sandbox_id: &str) -> Result<Vec<Event>>;
    /// A page of the event log in sequence order (the events API).
    async fn events_page(&self, q: &EventQuery) -> Result<Vec<StoredEvent>>;

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
}

/// API keys and the teams they belong to.
#[async_trait::async_trait]
pub trait AccessStore: Send + Sync + 'static {
    async fn insert_key(&self, k: &KeyRecord) -> Result<()>;
    async fn list_keys(&self) -> Result<Vec<KeyRecord>>;
    async fn key_by_hash(&self, hash: &str) -> Result<Option<KeyRecord>>;
    async fn touch_key(&self, id: &str) -> Result<()>;
    /// Revokes the key whose id is `id`; false when no such unrevoked key exists.
    async fn revoke_key(&self, id: &str) -> Result<bool>;

    /// Records a team's quotas (replacing them when it exists; its creation time is kept).
    async fn upsert_team(&self, t: &TeamRecord) -> Result<()>;
    async fn get_team(&self, name: &str) -> Result<Option<TeamRecord>>;
    /// Teams with quotas of their own, by name.
    async fn list_teams(&self) -> Result<Vec<TeamRecord>>;
}

/// The templates sandboxes are made from, with their spawn counters.
#[async_trait::async_trait]
pub trait TemplateStore: Send + Sync + 'static {
    /// Records a template (keeps its spawn counters when it exists).
    async fn upsert_template(&self, t: &TemplateRecord) -> Result<()>;
    async fn get_template(&self, name: &str) -> Result<Option<TemplateRecord>>;
}

/// The answers of creates made with an idempotency key.
#[async_trait::async_trait]
pub trait IdempotencyStore: Send + Sync + 'static {
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
