//! Which node runs which sandbox: a node publishes its sandboxes' records (and their events)
//! under `sandboxes/` with `owners/{id}` naming itself, each write guarded by its own lease
//! (a node whose lease is gone writes nothing); when a node is lost, its running sandboxes
//! are ended as `died: node-lost` ([`EtcdStore::end_lost_node`]), and a node's later
//! publication never brings such a sandbox back.

use etcd_client::{Compare, CompareOp, Txn, TxnOp};
use kiln_server::manager::LifecycleEvent;
use kiln_server::store::{SandboxRecord, SandboxState};

use crate::docs::{json, parse, EventDoc, SandboxDoc};
use crate::error::{ClusterError, Result};
use crate::retry::Kind;
use crate::sandboxes::Transition;
use crate::store::{backoff, EtcdStore, MAX_TRIES};

/// What became of a node's publication.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Published {
    /// Written at this etcd revision.
    At(i64),
    /// Not written: the cluster ended the sandbox already (its node was counted lost).
    Ended,
    /// Not written: the node no longer holds its lease.
    LeaseGone,
    /// Not written: another node owns the sandbox now (it moved while paused).
    Moved,
}

/// The end reason of a sandbox whose node was lost.
pub const NODE_LOST_REASON: &str = "died: node-lost";

impl EtcdStore {
    /// Publishes node `node`'s sandbox `rec` (and the event `event`, when given) provided the
    /// node still holds lease `lease` and no other node owns the sandbox, and never brings
    /// back a sandbox the cluster ended (a live `rec` over an ended record is refused). A
    /// sandbox published in a state other than paused loses its checkpoint record.
    pub async fn publish_sandbox(
        &self,
        node: &str,
        lease: i64,
        rec: &SandboxRecord,
        event: Option<&LifecycleEvent>,
    ) -> Result<Published> {
        let k = self.keys();
        let key = k.sandbox(&rec.id);
        let okey = k.owner(&rec.id);
        for attempt in 0..MAX_TRIES {
            let owner = self.get_one(&okey).await?;
            if owner
                .as_ref()
                .is_some_and(|kv| kv.value() != node.as_bytes())
            {
                return Ok(Published::Moved);
            }
            let seen = self.get_one(&key).await?;
            if let Some(kv) = &seen {
                let old: SandboxRecord = parse::<SandboxDoc>(kv.key(), kv.value())?.into();
                if !old.state.is_live() && rec.state.is_live() {
                    return Ok(Published::Ended);
                }
            }
            let mut ops = vec![
                TxnOp::put(key.as_str(), json(&SandboxDoc::from(rec)), None),
                TxnOp::put(okey.as_str(), node.as_bytes(), None),
            ];
            if rec.state != SandboxState::Paused {
                ops.push(TxnOp::delete(k.checkpoint(&rec.id), None));
            }
            if let Some(e) = event {
                let doc = EventDoc {
                    ts_ms: e.ts_ms,
                    sandbox_id: e.sandbox_id.clone(),
                    kind: e.kind.clone(),
                    detail: e.detail.clone(),
                };
                ops.push(TxnOp::put(
                    k.new_event(&e.sandbox_id, e.ts_ms),
                    json(&doc),
                    None,
                ));
            }
            let same = match &seen {
                Some(kv) => {
                    Compare::mod_revision(key.as_str(), CompareOp::Equal, kv.mod_revision())
                }
                None => Compare::create_revision(key.as_str(), CompareOp::Equal, 0),
            };
            let held = Compare::lease(k.node(node), CompareOp::Equal, lease);
            let owned = match &owner {
                Some(kv) => {
                    Compare::mod_revision(okey.as_str(), CompareOp::Equal, kv.mod_revision())
                }
                None => Compare::create_revision(okey.as_str(), CompareOp::Equal, 0),
            };
            let r = self
                .txn(
                    Kind::Write,
                    Txn::new().when([same, held, owned]).and_then(ops),
                )
                .await?;
            if r.succeeded() {
                return Ok(Published::At(r.header().map_or(0, |h| h.revision())));
            }
            let holder = self.get_one(&k.node(node)).await?.map(|kv| kv.lease());
            if holder != Some(lease) {
                return Ok(Published::LeaseGone);
            }
            tokio::time::sleep(backoff(attempt)).await;
        }
        Err(ClusterError::Contended {
            key,
            tries: MAX_TRIES,
        })
    }

    /// Every sandbox recorded as run by `node`.
    pub async fn sandboxes_of(&self, node: &str) -> Result<Vec<String>> {
        let dir = self.keys().dir("owners");
        Ok(self
            .get_prefix(&dir, 0)
            .await?
            .iter()
            .filter(|kv| kv.value() == node.as_bytes())
            .filter_map(|kv| {
                let rest = std::str::from_utf8(kv.key()).ok()?.strip_prefix(&dir)?;
                crate::keys::unescape(rest)
            })
            .collect())
    }

    /// Ends the running (or starting) sandboxes of lost node `node` as `died: node-lost`,
    /// each with a `died` event; returns their ids. Paused ones stay as they are. Safe to
    /// repeat, and to race with another replica (each sandbox is ended once).
    pub async fn end_lost_node(&self, node: &str) -> Result<Vec<String>> {
        let live = [SandboxState::Running, SandboxState::Starting];
        let mut ended = Vec::new();
        for id in self.sandboxes_of(node).await? {
            let t = self
                .transition(&id, &live, SandboxState::Killed, Some(NODE_LOST_REASON))
                .await?;
            if let Transition::Done(_) = t {
                let detail = format!("node-lost: node {node} stopped renewing its lease");
                self.add_event_doc(&id, "died", &detail).await?;
                ended.push(id);
            }
        }
        Ok(ended)
    }
}
