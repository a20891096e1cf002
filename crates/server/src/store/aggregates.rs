//! The aggregates kept beside [`super::StateStore`], each behind a trait of its own so that
//! another backend can carry them too: the audit chain ([`AuditStore`]) and the metrics
//! history ([`MetricsStore`]). Their SQLite implementations are [`super::audit_sql`] and
//! [`super::metrics_sql`]; [`super::StateDb`] hands them out.

use crate::audit::chain::Head;
use crate::audit::filter::Filter;
use crate::audit::record::{Append, AuditRecord};
use crate::obs::ring::MetricSample;

use super::alerts_sql::{AlertFilter, AlertRecord};
use super::Result;

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
    fn alerts(&self, f: &AlertFilter) -> Result<Vec<AlertRecord>>;
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
