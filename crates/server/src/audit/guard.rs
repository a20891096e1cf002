//! Who may extend a chain. On one host, the host's store holds every chain. On a cluster a
//! sandbox's chain is extended by the node that runs it, and continued by the next node it
//! moves to; the head of each chain is kept where every node sees it (etcd). A
//! [`ChainGuard`] installed in a store ([`crate::store::AuditStore::set_guard`]) is asked,
//! before each append is written, to move the heads that append moves; the records of a chain
//! another host holds now are refused (not kept here), so a chain never forks. Given with the
//! log's settings ([`Given`]), it is installed before anything is recorded.

use std::collections::HashSet;

use super::chain::Head;

/// A chain's head moved by one append: from `prev` (None: the chain starts here) to `next`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeadMove {
    pub sandbox_id: String,
    pub prev: Option<Head>,
    pub next: Head,
}

/// A guard given with the log's settings ([`super::AuditConfig::guard`]): installed as the
/// log starts, so nothing the server records (its recovery's records included) escapes it.
#[derive(Clone)]
pub struct Given(pub std::sync::Arc<dyn ChainGuard>);

impl std::fmt::Debug for Given {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ChainGuard")
    }
}

/// Where chains' heads are kept beyond this host's store.
pub trait ChainGuard: Send + Sync + 'static {
    /// Records `moves` (called before the records are written); the sandboxes whose chains
    /// another host holds (their records are not kept: the append is written again without
    /// them). An error keeps nothing of the append.
    fn advance(&self, moves: &[HeadMove]) -> Result<HashSet<String>, String>;

    /// The head of `sandbox_id`'s chain when another host holds it (None: this host holds
    /// it, or nobody does): what a fork of it here links to.
    fn elsewhere(&self, sandbox_id: &str) -> Result<Option<Head>, String>;
}
