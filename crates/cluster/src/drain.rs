//! Draining a node (`kiln node drain`): a mark under `draining/{name}`, apart from the node's
//! own registration (which the node rewrites every second) and not on its lease, so it stays
//! while the node restarts, until `kiln node undrain`. Control replicas place no new sandbox
//! on a draining node and refuse forks there (a fork's children run on their parent's node);
//! what already runs on it keeps running; its paused sandboxes whose checkpoint is in object
//! storage resume on another node at their next resume, the others there.

use etcd_client::{PutOptions, TxnOp};
use kiln_server::store::{now_ms, SandboxState};
use serde::{Deserialize, Serialize};

use crate::docs::{json, parse};
use crate::error::Result;
use crate::store::EtcdStore;

/// The stored mark.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DrainMark {
    pub since_ms: i64,
}

/// What a drain found on the node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DrainReport {
    /// Whether the node was registered (alive) when it was marked.
    pub live: bool,
    /// Whether the node was draining already.
    pub already: bool,
    /// Running (or starting) sandboxes left on it: they run until they end.
    pub running: Vec<String>,
    /// Its paused sandboxes: those with a checkpoint in object storage move off it, the
    /// others stay and resume on it.
    pub paused: Vec<String>,
}

impl EtcdStore {
    /// Marks node `name` draining; what stays on it.
    pub async fn drain_node(&self, name: &str) -> Result<DrainReport> {
        let key = self.keys().draining(name);
        let mark = json(&DrainMark { since_ms: now_ms() });
        let put = TxnOp::put(key.as_str(), mark, None::<PutOptions>);
        let already = !self.create(std::slice::from_ref(&key), vec![put]).await?;
        let live = self.get_one(&self.keys().node(name)).await?.is_some();
        let mut report = DrainReport {
            live,
            already,
            ..DrainReport::default()
        };
        for id in self.sandboxes_of(name).await? {
            match self.get_sandbox_doc(&id).await?.map(|s| s.state) {
                Some(SandboxState::Running | SandboxState::Starting) => report.running.push(id),
                Some(SandboxState::Paused) => report.paused.push(id),
                _ => {}
            }
        }
        report.running.sort();
        report.paused.sort();
        Ok(report)
    }

    /// Lifts the drain of node `name`; whether it was draining.
    pub async fn undrain_node(&self, name: &str) -> Result<bool> {
        let key = self.keys().draining(name);
        let mut c = self.client();
        Ok(c.delete(key.as_str(), None).await?.deleted() > 0)
    }

    /// The nodes marked draining, by name, with their marks.
    pub async fn draining_nodes(&self) -> Result<Vec<(String, DrainMark)>> {
        let dir = self.keys().dir("draining");
        let mut out = Vec::new();
        for kv in self.get_prefix(&dir, 0).await? {
            let Some(name) = std::str::from_utf8(kv.key())
                .ok()
                .and_then(|k| k.strip_prefix(&dir))
                .and_then(crate::keys::unescape)
            else {
                continue;
            };
            out.push((name, parse(kv.key(), kv.value())?));
        }
        Ok(out)
    }
}
