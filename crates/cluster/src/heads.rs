//! Audit chain heads in etcd. A sandbox's chain is extended by the node that runs it and
//! continued by the next node it moves to; `audit-heads/{id}` ([`HeadDoc`]) holds the chain's
//! head (seq, hash), the node extending it now, and every node that keeps a part of it. A node
//! moves a head in the same step as it stores the records (before its database commits,
//! revision-checked: [`crate::node::heads`]), so etcd always has the head of what is stored,
//! a node that no longer holds a chain can add nothing to it, and a replica verifying the chain
//! reads its parts from those nodes and checks it against this head ([`assemble`]).

use etcd_client::{Compare, CompareOp, Txn, TxnOp};
use kiln_server::audit::chain::Head;
use kiln_server::store::StoredChain;
use serde::{Deserialize, Serialize};

use crate::docs::{json, parse};
use crate::error::Result;
use crate::retry::Kind;
use crate::store::EtcdStore;

/// A chain's head as etcd keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeadDoc {
    /// The node that extends the chain now.
    pub node: String,
    pub seq: i64,
    pub hash: String,
    /// Every node that keeps a part of the chain, in the order the chain came to them.
    pub nodes: Vec<String>,
}

impl HeadDoc {
    pub fn head(&self) -> Head {
        Head {
            seq: self.seq,
            hash: self.hash.clone(),
        }
    }
}

/// A head as read: the doc and the revision its key was last written at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeenHead {
    pub doc: HeadDoc,
    pub revision: i64,
}

/// One head write: the sandbox, its new doc, and the revision it replaces (0: none yet).
pub type HeadWrite = (String, HeadDoc, i64);

impl EtcdStore {
    /// The head of sandbox `id`'s chain, if any node recorded one.
    pub async fn audit_head(&self, id: &str) -> Result<Option<SeenHead>> {
        match self.get_one(&self.keys().audit_head(id)).await? {
            Some(kv) => Ok(Some(SeenHead {
                doc: parse(kv.key(), kv.value())?,
                revision: kv.mod_revision(),
            })),
            None => Ok(None),
        }
    }

    /// Writes `writes` in one txn if none of their keys changed since the revision each
    /// replaces; the revision written at, None when one changed (nothing is written).
    pub async fn put_heads(&self, writes: &[HeadWrite]) -> Result<Option<i64>> {
        let k = self.keys();
        let mut when = Vec::with_capacity(writes.len());
        let mut ops = Vec::with_capacity(writes.len());
        for (id, doc, rev) in writes {
            let key = k.audit_head(id);
            when.push(match rev {
                0 => Compare::create_revision(key.as_str(), CompareOp::Equal, 0),
                r => Compare::mod_revision(key.as_str(), CompareOp::Equal, *r),
            });
            ops.push(TxnOp::put(key, json(doc), None));
        }
        let r = self
            .txn(Kind::Write, Txn::new().when(when).and_then(ops))
            .await?;
        Ok(r.succeeded()
            .then(|| r.header().map(|h| h.revision()).unwrap_or(0)))
    }
}

/// One chain from the parts its nodes keep (`parts`, each a node's stored part) checked
/// against the head etcd holds: records in seq order, the pruning anchor of the part that
/// starts first, etcd's head (else the newest part's).
pub fn assemble(parts: Vec<StoredChain>, head: Option<&HeadDoc>) -> StoredChain {
    let first = parts
        .iter()
        .filter_map(|p| p.records.first().map(|r| (r.seq, p.anchor.clone())))
        .min_by_key(|(seq, _)| *seq);
    let anchor = match first {
        Some((_, anchor)) => anchor,
        // Nothing stored (all pruned): the newest anchor.
        None => parts
            .iter()
            .filter_map(|p| p.anchor.clone())
            .max_by_key(|a| a.0),
    };
    let newest = parts
        .iter()
        .filter_map(|p| p.head.clone())
        .max_by_key(|h| h.seq);
    let mut records: Vec<_> = parts.into_iter().flat_map(|p| p.records).collect();
    records.sort_by_key(|r| (r.seq, r.cursor));
    StoredChain {
        records,
        anchor,
        head: head.map(HeadDoc::head).or(newest),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_server::audit::chain::{self, GENESIS};
    use kiln_server::audit::{AuditRecord, Kind, NewRecord};

    /// A chain of `n` records sealed one after another.
    fn chain_of(n: i64) -> Vec<AuditRecord> {
        let mut out: Vec<AuditRecord> = Vec::new();
        for i in 1..=n {
            let prev = out.last().map(|r| Head {
                seq: r.seq,
                hash: r.hash.clone(),
            });
            let rec = NewRecord {
                sandbox_id: "sbx".into(),
                ts_ms: i,
                kind: Kind::Process,
                body: serde_json::json!({ "n": i }),
            };
            out.push(chain::seal(&rec, prev.as_ref(), GENESIS));
        }
        out
    }

    fn head_of(r: &AuditRecord) -> Head {
        Head {
            seq: r.seq,
            hash: r.hash.clone(),
        }
    }

    #[test]
    fn parts_on_two_nodes_make_one_chain_checked_against_etcds_head() {
        let all = chain_of(5);
        let a = StoredChain {
            records: all[..3].to_vec(),
            anchor: None,
            head: Some(head_of(&all[2])),
        };
        // The second node's part starts where the first node's head was.
        let b = StoredChain {
            records: all[3..].to_vec(),
            anchor: Some((3, all[2].hash.clone())),
            head: Some(head_of(&all[4])),
        };
        let doc = HeadDoc {
            node: "n2".into(),
            seq: 5,
            hash: all[4].hash.clone(),
            nodes: vec!["n1".into(), "n2".into()],
        };
        let c = assemble(vec![b.clone(), a.clone()], Some(&doc));
        assert_eq!(c.records, all);
        assert_eq!(c.anchor, None, "the first part's anchor: none");
        let start = chain::Start {
            seq: 0,
            hash: Some(GENESIS.to_string()),
        };
        assert!(chain::verify(&c.records, &start, c.head.as_ref()).is_ok());
        // The last record removed from the node that holds the chain: etcd's head catches it.
        let mut short = b;
        short.records.pop();
        short.head = Some(head_of(&all[3]));
        let c = assemble(vec![a, short], Some(&doc));
        assert!(chain::verify(&c.records, &start, c.head.as_ref()).is_err());
    }
}
