//! Who may extend a chain. On one host, the host's store holds every chain. On a cluster a
//! sandbox's chain is extended by the node that runs it, and continued by the next node it
//! moves to; the head of each chain is kept where every node sees it (etcd). A
//! [`ChainGuard`] installed in a store ([`crate::store::AuditStore::set_guard`]) is asked,
//! inside each append's write, to move the heads that append moves; the records of a chain
//! another host holds now are refused (not kept here), so a chain never forks.

use std::collections::HashSet;

use super::chain::Head;

/// A chain's head moved by one append: from `prev` (None: the chain starts here) to `next`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeadMove {
    pub sandbox_id: String,
    pub prev: Option<Head>,
    pub next: Head,
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
