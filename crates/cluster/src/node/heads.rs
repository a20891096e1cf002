//! A node's guard over its audit chains ([`kiln_server::audit::guard`], etcd's side in
//! [`crate::heads`]): each append's new heads go to etcd before the node's database commits
//! them, each revision-checked, and a chain another node extends now is refused (the records
//! go back to whoever handed them). A sandbox that moves here is taken over ([`Heads::take`]):
//! its head's doc names this node, and its chain here continues from that head.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use kiln_server::audit::chain::Head;
use kiln_server::audit::guard::{ChainGuard, HeadMove};

use crate::error::{ClusterError, Result};
use crate::heads::{HeadDoc, HeadWrite, SeenHead};
use crate::store::EtcdStore;

/// Most heads written in one txn (etcd caps the operations of one).
const PER_TXN: usize = 64;
/// Attempts at writing one group of heads that keep changing under it.
const TRIES: u32 = 8;
/// Most heads remembered (past it, the memory starts again: a head not remembered is read).
const MOST_SEEN: usize = 10_000;

/// The node's chains' heads in etcd (cheap to clone: clones share what they saw).
#[derive(Clone)]
pub struct Heads {
    etcd: EtcdStore,
    node: String,
    /// The runtime etcd is called on (the guard is called from the audit writer's thread).
    rt: tokio::runtime::Handle,
    /// The heads this node last wrote or read.
    seen: Arc<Mutex<HashMap<String, SeenHead>>>,
}

/// The guard's answer when the runtime is shutting down.
const STOPPING: &str = "the node is stopping";

impl std::fmt::Debug for Heads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Heads").field("node", &self.node).finish()
    }
}

impl Heads {
    pub fn new(etcd: EtcdStore, node: String, rt: tokio::runtime::Handle) -> Self {
        Self {
            etcd,
            node,
            rt,
            seen: Arc::default(),
        }
    }

    fn seen(&self) -> std::sync::MutexGuard<'_, HashMap<String, SeenHead>> {
        self.seen.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn remember(&self, id: &str, s: SeenHead) {
        let mut seen = self.seen();
        if seen.len() >= MOST_SEEN && !seen.contains_key(id) {
            seen.clear();
        }
        seen.insert(id.to_string(), s);
    }

    /// The node that extends `id`'s chain, as last seen here.
    pub fn holder(&self, id: &str) -> Option<String> {
        self.seen().get(id).map(|s| s.doc.node.clone())
    }

    /// Makes `id`'s chain this node's (a sandbox that moved here): the head it continues
    /// from, None when no node recorded one.
    pub async fn take(&self, id: &str) -> Result<Option<Head>> {
        let me = &self.node;
        let doc = self
            .rewrite(id, "taken over", |d| {
                (d.node != *me).then(|| {
                    let mut d = d.clone();
                    d.node = me.clone();
                    if !d.nodes.contains(me) {
                        d.nodes.push(me.clone());
                    }
                    d
                })
            })
            .await?;
        Ok(doc.map(|d| d.head()))
    }

    /// Hands `id`'s chain back to node `to` (a take-over that failed), if it is this node's.
    pub async fn give(&self, id: &str, to: &str) -> Result<()> {
        self.rewrite(id, "handed back", |d| {
            (d.node == self.node).then(|| HeadDoc {
                node: to.to_string(),
                ..d.clone()
            })
        })
        .await?;
        Ok(())
    }

    /// Writes `change` of `id`'s head doc (None: left as it is), revision-checked and read
    /// again when it moved meanwhile; the doc as it stands after (None: no node recorded one).
    async fn rewrite(
        &self,
        id: &str,
        what: &str,
        change: impl Fn(&HeadDoc) -> Option<HeadDoc>,
    ) -> Result<Option<HeadDoc>> {
        for _ in 0..TRIES {
            let Some(s) = self.etcd.audit_head(id).await? else {
                return Ok(None);
            };
            let Some(doc) = change(&s.doc) else {
                let doc = s.doc.clone();
                self.remember(id, s);
                return Ok(Some(doc));
            };
            let write: HeadWrite = (id.to_string(), doc.clone(), s.revision);
            if let Some(revision) = self.etcd.put_heads(&[write]).await? {
                self.remember(
                    id,
                    SeenHead {
                        doc: doc.clone(),
                        revision,
                    },
                );
                return Ok(Some(doc));
            }
        }
        Err(ClusterError::Store(kiln_server::store::StoreError::Task(
            format!("the audit chain head of sandbox {id} kept changing while it was {what}"),
        )))
    }

    /// Writes `moves`' heads (those of chains this node extends); the chains refused.
    async fn advance(&self, moves: &[HeadMove]) -> Result<HashSet<String>> {
        let mut refused = HashSet::new();
        for group in moves.chunks(PER_TXN) {
            let mut written = false;
            for _ in 0..TRIES {
                let mut writes = Vec::with_capacity(group.len());
                for m in group {
                    let known = self.seen().get(&m.sandbox_id).cloned();
                    let seen = match known {
                        Some(s) => Some(s),
                        None => self.etcd.audit_head(&m.sandbox_id).await?,
                    };
                    match seen {
                        Some(s) if s.doc.node != self.node => {
                            self.remember(&m.sandbox_id, s);
                            refused.insert(m.sandbox_id.clone());
                        }
                        seen => {
                            let (nodes, revision) = match seen {
                                Some(s) => {
                                    if m.prev.as_ref().map_or(0, |h| h.seq) != s.doc.seq {
                                        tracing::warn!(sandbox = %m.sandbox_id, here = ?m.prev.as_ref().map(|h| h.seq), etcd = s.doc.seq, "this node's audit chain and its head in etcd disagree; etcd's head moves to this node's");
                                    }
                                    (s.doc.nodes, s.revision)
                                }
                                None => (vec![self.node.clone()], 0),
                            };
                            let doc = HeadDoc {
                                node: self.node.clone(),
                                seq: m.next.seq,
                                hash: m.next.hash.clone(),
                                nodes,
                            };
                            writes.push((m.sandbox_id.clone(), doc, revision));
                        }
                    }
                }
                if writes.is_empty() {
                    written = true;
                    break;
                }
                if let Some(revision) = self.etcd.put_heads(&writes).await? {
                    for (id, doc, _) in writes {
                        self.remember(&id, SeenHead { doc, revision });
                    }
                    written = true;
                    break;
                }
                // One changed meanwhile (a take-over): read them again.
                let mut seen = self.seen();
                for m in group {
                    seen.remove(&m.sandbox_id);
                }
            }
            if !written {
                return Err(ClusterError::Store(kiln_server::store::StoreError::Task(
                    "audit chain heads kept changing while they were written".into(),
                )));
            }
        }
        Ok(refused)
    }
}

impl ChainGuard for Heads {
    fn advance(&self, moves: &[HeadMove]) -> std::result::Result<HashSet<String>, String> {
        let (me, moves) = (self.clone(), moves.to_vec());
        let refused =
            crate::blocking::on_runtime(&self.rt, async move { Heads::advance(&me, &moves).await })
                .ok_or(STOPPING)?
                .map_err(|e| e.to_string())?;
        if !refused.is_empty() {
            tracing::info!(sandboxes = ?refused, "audit records of chains another node extends now are not kept here");
        }
        Ok(refused)
    }

    fn elsewhere(&self, id: &str) -> std::result::Result<Option<Head>, String> {
        let (etcd, id) = (self.etcd.clone(), id.to_string());
        let seen = crate::blocking::on_runtime(&self.rt, async move { etcd.audit_head(&id).await })
            .ok_or(STOPPING)?
            .map_err(|e| e.to_string())?;
        Ok(seen
            .filter(|s| s.doc.node != self.node)
            .map(|s| s.doc.head()))
    }
}
