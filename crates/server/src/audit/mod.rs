//! The audit log: an append-only, hash-chained record per sandbox of every process, file
//! operation, connection, DNS query, lifecycle transition and API call that touched it.
//!
//! - [`record`]: kinds and the stored record; [`chain`]: hashing and verification;
//! - [`filter`]: what a query asks for; [`cursor`]: where a reader stands; [`query`]:
//!   verifying a stored chain; [`guard`]: who may extend a chain (a cluster's nodes);
//! - `writer`: the single writer thread behind a bounded channel, with retention;
//! - [`tap`]: what the sandbox proxy records of the envd traffic it forwards;
//! - [`net`]: what kiln-net's egress proxy and DNS forwarder report;
//! - [`api`]: the HTTP routes (`/sandboxes/{id}/audit`, `/audit`, `/audit/verify`).
//!
//! Records come from what the server itself routes or decides (the proxy, the API, the
//! manager, kiln-net's egress proxy and DNS forwarder), so a sandbox cannot forge or suppress
//! them. The records are kept by a [`crate::store::AuditStore`] (SQLite: the state
//! database's audit tables, `store/audit_sql.rs`). See docs/audit.md.

pub mod api;
pub mod chain;
pub mod cursor;
pub mod filter;
pub mod guard;
pub mod net;
pub mod query;
pub mod record;
pub mod tap;
mod tap_body;
mod tap_parse;
mod tap_record;
mod writer;

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use serde_json::Value;
use tokio::sync::{broadcast, mpsc, oneshot};

use crate::store::{AuditStore, SqliteAuditStore};

pub use filter::Filter;
pub use query::Report;
use record::Append;
pub use record::{AuditRecord, Kind, NewRecord};
pub use writer::{Retention, RulesTap};

/// `kiln serve` settings of the audit log.
#[derive(Debug, Clone)]
pub struct AuditConfig {
    pub enabled: bool,
    pub retention: Retention,
    /// Capacity of the channel to the writer (senders wait when it is full).
    pub queue: usize,
    /// A guard over the store's appends (a cluster node's), installed before the first record.
    pub guard: Option<guard::Given>,
}

impl Default for AuditConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            retention: Retention::default(),
            queue: 4096,
            guard: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    #[error("audit log: {0}")]
    Store(#[from] crate::store::StoreError),
    #[error("audit log: {0}")]
    Task(String),
    #[error("the audit log is off on this server (kiln serve --audit off)")]
    Off,
}

pub(crate) struct Inner {
    tx: mpsc::Sender<writer::Msg>,
    store: Arc<dyn AuditStore>,
    live: broadcast::Sender<Arc<AuditRecord>>,
    /// The API key that created each sandbox (recorded on its process records); None: looked
    /// up and not known (e.g. created by a pool or a bench, not through the API).
    owners: Mutex<HashMap<String, Option<String>>>,
    /// Stored records for the rule engine.
    rules_tap: Arc<RulesTap>,
    /// The records are kept elsewhere (a cluster's nodes): nothing is published live, so
    /// followers poll the store.
    remote: bool,
}

/// Handle to the audit log (cheap to clone). A disabled log records nothing.
#[derive(Clone, Default)]
pub struct AuditLog(Option<Arc<Inner>>);

impl AuditLog {
    /// A log that records nothing (`--audit off`).
    pub fn disabled() -> Self {
        Self(None)
    }

    /// Opens the audit log in the (already migrated) state database `db` and starts its writer.
    pub fn open(db: &Path, cfg: &AuditConfig) -> Result<Self, AuditError> {
        if !cfg.enabled {
            return Ok(Self::disabled());
        }
        Self::start(Arc::new(SqliteAuditStore::open(db)?), cfg)
    }

    /// Starts the audit log's writer over `store` (a disabled log when `cfg` says so).
    pub fn start(store: Arc<dyn AuditStore>, cfg: &AuditConfig) -> Result<Self, AuditError> {
        Self::start_over(store, cfg, false)
    }

    /// Starts a log whose `store` keeps the records somewhere else (a cluster replica's
    /// forwarding store): the writer hands each batch to it, nothing is published live or
    /// evaluated here, and followers poll the store.
    pub fn start_remote(store: Arc<dyn AuditStore>, cfg: &AuditConfig) -> Result<Self, AuditError> {
        Self::start_over(store, cfg, true)
    }

    fn start_over(
        store: Arc<dyn AuditStore>,
        cfg: &AuditConfig,
        remote: bool,
    ) -> Result<Self, AuditError> {
        if !cfg.enabled {
            return Ok(Self::disabled());
        }
        if let Some(g) = &cfg.guard {
            store.set_guard(g.0.clone());
        }
        let (tx, rx) = mpsc::channel(cfg.queue.max(1));
        let (live, _) = broadcast::channel(4096);
        let rules_tap = Arc::new(RulesTap::default());
        let w = writer::Writer {
            store: store.clone(),
            rx,
            live: live.clone(),
            retention: cfg.retention,
            rules_tap: rules_tap.clone(),
            linger: match remote {
                true => writer::REMOTE_LINGER,
                false => std::time::Duration::ZERO,
            },
        };
        std::thread::Builder::new()
            .name("kiln-audit".into())
            .spawn(move || w.run())
            .map_err(|e| AuditError::Task(format!("starting the writer: {e}")))?;
        Ok(Self(Some(Arc::new(Inner {
            tx,
            store,
            live,
            owners: Mutex::new(HashMap::new()),
            rules_tap,
            remote,
        }))))
    }

    pub fn enabled(&self) -> bool {
        self.0.is_some()
    }

    /// Records `body` about `sandbox_id`; waits while the writer is behind (never drops).
    pub async fn record(&self, sandbox_id: &str, kind: Kind, body: Value) {
        let Some(i) = &self.0 else { return };
        let r = NewRecord {
            sandbox_id: sandbox_id.to_string(),
            ts_ms: crate::store::now_ms(),
            kind,
            body,
        };
        if i.tx
            .send(writer::Msg::Append(Append::Record(r)))
            .await
            .is_err()
        {
            tracing::error!(sandbox = sandbox_id, "the audit writer has stopped");
        }
    }

    /// Appends records made elsewhere (a cluster replica's, about a sandbox this server
    /// runs), each after its chain's head, and waits until they are stored; those of chains
    /// another host holds now are not kept and come back (see [`guard`]). A disabled log
    /// takes them and keeps nothing.
    pub async fn append_records(&self, records: Vec<NewRecord>) -> Vec<NewRecord> {
        let Some(i) = &self.0 else { return Vec::new() };
        let (tx, rx) = oneshot::channel();
        if i.tx.send(writer::Msg::Handed(records, tx)).await.is_err() {
            tracing::error!("the audit writer has stopped");
            return Vec::new();
        }
        rx.await.unwrap_or_default()
    }

    /// Continues `sandbox_id`'s chain here from `head`, its head on the host that kept it
    /// before; answers once recorded (the sandbox's next record follows it).
    pub async fn continue_chain(&self, sandbox_id: &str, head: chain::Head) {
        let Some(i) = &self.0 else { return };
        let m = writer::Msg::Append(Append::Continue {
            sandbox_id: sandbox_id.to_string(),
            seq: head.seq,
            hash: head.hash,
        });
        if i.tx.send(m).await.is_err() {
            tracing::error!(sandbox = sandbox_id, "the audit writer has stopped");
            return;
        }
        self.flush().await;
    }

    /// A sender usable from `poll` code ([`tap`]'s response bodies).
    fn sender(&self) -> Option<mpsc::Sender<writer::Msg>> {
        self.0.as_ref().map(|i| i.tx.clone())
    }

    /// Starts `child`'s chain with a record pointing at `parent`'s head (fork, create from a
    /// snapshot); `body` says how (e.g. the snapshot id).
    pub async fn link(&self, child: &str, parent: &str, body: Value) {
        let Some(i) = &self.0 else { return };
        if let Some(Some(k)) = self.owner_cached(parent) {
            self.set_owner(child, &k);
        }
        let m = writer::Msg::Append(Append::Link {
            child: child.to_string(),
            parent: parent.to_string(),
            ts_ms: crate::store::now_ms(),
            body: if body.is_object() {
                body
            } else {
                serde_json::json!({})
            },
        });
        let _ = i.tx.send(m).await;
    }

    /// Waits until every record sent before this call is stored.
    pub async fn flush(&self) {
        let Some(i) = &self.0 else { return };
        let (tx, rx) = oneshot::channel();
        if i.tx.send(writer::Msg::Flush(tx)).await.is_ok() {
            let _ = rx.await;
        }
    }

    /// Runs retention now; how many records it removed.
    pub async fn prune_now(&self) -> usize {
        let Some(i) = &self.0 else { return 0 };
        let (tx, rx) = oneshot::channel();
        if i.tx.send(writer::Msg::Prune(tx)).await.is_ok() {
            return rx.await.unwrap_or(0);
        }
        0
    }

    /// The tap handing stored records to the rule engine (None: the log is off).
    pub fn rules_tap(&self) -> Option<&Arc<RulesTap>> {
        self.0.as_ref().map(|i| &i.rules_tap)
    }

    /// Stored records as they are written (None: the log is off, or its records are kept
    /// elsewhere and nothing is published here).
    pub fn subscribe(&self) -> Option<broadcast::Receiver<Arc<AuditRecord>>> {
        self.0
            .as_ref()
            .filter(|i| !i.remote)
            .map(|i| i.live.subscribe())
    }

    pub fn set_owner(&self, sandbox_id: &str, key_id: &str) {
        if let Some(i) = &self.0 {
            let mut o = i.owners.lock().unwrap_or_else(|p| p.into_inner());
            o.insert(sandbox_id.to_string(), Some(key_id.to_string()));
        }
    }

    fn owner_cached(&self, sandbox_id: &str) -> Option<Option<String>> {
        let i = self.0.as_ref()?;
        let o = i.owners.lock().unwrap_or_else(|p| p.into_inner());
        o.get(sandbox_id).cloned()
    }

    /// The API key that created `sandbox_id`, if known (after a restart: from its chain,
    /// looked up once).
    pub async fn owner(&self, sandbox_id: &str) -> Option<String> {
        if let Some(k) = self.owner_cached(sandbox_id) {
            return k;
        }
        let id = sandbox_id.to_string();
        let k = self.read(move |s| s.owner(&id)).await.ok().flatten();
        if let Some(i) = &self.0 {
            let mut o = i.owners.lock().unwrap_or_else(|p| p.into_inner());
            o.entry(sandbox_id.to_string()).or_insert(k.clone());
        }
        k
    }

    /// Runs `f` over the store on the blocking pool (records sent before the call may still
    /// be on their way: [`AuditLog::flush`] first to include them).
    pub async fn read<T: Send + 'static>(
        &self,
        f: impl FnOnce(&dyn AuditStore) -> crate::store::Result<T> + Send + 'static,
    ) -> Result<T, AuditError> {
        let Some(i) = self.0.clone() else {
            return Err(AuditError::Off);
        };
        tokio::task::spawn_blocking(move || f(i.store.as_ref()).map_err(AuditError::from))
            .await
            .map_err(|e| AuditError::Task(e.to_string()))?
    }

    /// Stored records matching `f` (everything recorded before the call is included).
    pub async fn query(&self, f: Filter) -> Result<Vec<AuditRecord>, AuditError> {
        self.flush().await;
        self.read(move |s| s.query(&f)).await
    }

    /// [`AuditLog::query`] as a page with the cursor that follows it.
    pub async fn page(&self, f: Filter) -> Result<cursor::Page<AuditRecord>, AuditError> {
        self.flush().await;
        self.read(move |s| s.page(&f)).await
    }

    /// Stored alerts matching `f` (the rule engine's `alerts` table is in the same database).
    pub async fn alerts(
        &self,
        f: crate::store::alerts_sql::AlertFilter,
    ) -> Result<cursor::Page<crate::store::alerts_sql::AlertRecord>, AuditError> {
        self.read(move |s| s.alerts(&f)).await
    }

    /// The team sandbox `id` belongs (or belonged) to, if known.
    pub async fn team_of(&self, id: &str) -> Result<Option<String>, AuditError> {
        let id = id.to_string();
        self.read(move |s| s.team_of(&id)).await
    }

    /// Verifies one sandbox's chain, or every chain (of `team`'s sandboxes only, when given).
    pub async fn verify(
        &self,
        sandbox_id: Option<String>,
        team: Option<String>,
    ) -> Result<Vec<Report>, AuditError> {
        self.flush().await;
        self.read(move |s| {
            let ids = match sandbox_id {
                Some(id) => vec![id],
                None => s.chains(team.as_deref())?,
            };
            ids.iter().map(|id| query::verify(s, id)).collect()
        })
        .await
    }
}

#[cfg(test)]
pub(crate) mod tests_support {
    use super::*;

    /// An enabled log's insides without a writer (its queue is never read): for taps that
    /// only parse.
    pub(crate) fn inner() -> Inner {
        let (tx, _rx) = mpsc::channel(1);
        let (live, _) = broadcast::channel(1);
        Inner {
            tx,
            store: Arc::new(SqliteAuditStore::open_in_memory().expect("in-memory SQLite")),
            live,
            owners: Mutex::new(HashMap::new()),
            rules_tap: Arc::default(),
            remote: false,
        }
    }
}
