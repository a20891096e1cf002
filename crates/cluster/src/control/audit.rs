//! A control replica's audit store ([`NodeAudit`]): the records the replica makes (API calls
//! naming a sandbox, the envd operations its proxy forwards) go to the node that runs the
//! sandbox, which appends them to the sandbox's chain; reads go to the node that keeps the
//! chain. The server's audit log runs over it unchanged ([`kiln_server::audit::AuditLog::start_remote`]):
//! its writer thread batches, this store sends each node its part. See [`crate::audit`].
//!
//! A sandbox's node is the one etcd names as its owner (kept after it ends); a sandbox no
//! live node is known for is looked for on every live node. Records about a sandbox no live
//! node runs (an id that never existed, a sandbox whose node is lost) are not kept.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kiln_server::audit::{AuditRecord, Filter, NewRecord};
use kiln_server::driver::DriverError;
use kiln_server::store::alerts_sql::{AlertFilter, AlertRecord};
use kiln_server::store::{AuditStore, Result, StoreError, StoredChain};
use kiln_server::Error;

use super::{Cache, NodeClient};
use crate::audit::{AuditAnswer, AuditCall, NewRecordDoc};
use crate::nodes::NodeInfo;

/// How long one call to a node may take.
const CALL_LIMIT: Duration = Duration::from_secs(10);
/// Attempts at handing one node its records before they are given up.
const APPEND_TRIES: u32 = 5;

/// The replica's audit store: its nodes' audit logs.
pub struct NodeAudit {
    cache: Arc<Cache>,
    client: NodeClient,
    /// The runtime the calls run on (the store's methods are called from the audit writer's
    /// thread and the blocking pool).
    rt: tokio::runtime::Handle,
    /// Where a chain was found on a node that does not own its sandbox (a sandbox that moved,
    /// or whose owner record is gone).
    found: Mutex<HashMap<String, String>>,
}

impl NodeAudit {
    pub fn new(cache: Arc<Cache>, client: NodeClient, rt: tokio::runtime::Handle) -> Self {
        Self {
            cache,
            client,
            rt,
            found: Mutex::new(HashMap::new()),
        }
    }

    fn call(&self, node: &NodeInfo, call: &AuditCall) -> std::result::Result<AuditAnswer, Error> {
        let fut = self.client.audit(&node.address, call);
        self.rt.block_on(async {
            tokio::time::timeout(CALL_LIMIT, fut)
                .await
                .unwrap_or_else(|_| Err(Error::Unavailable("the node did not answer".into())))
        })
    }

    /// A node's answer to a read, its refusal as the store's error.
    fn read(&self, node: &NodeInfo, call: &AuditCall) -> Result<AuditAnswer> {
        self.call(node, call).map_err(|e| match e {
            Error::Driver(DriverError::NotImplemented(_)) => StoreError::Unsupported(format!(
                "the audit log is off on node {} (its kiln node runs with --audit off)",
                node.name
            )),
            other => StoreError::Task(format!(
                "reading the audit log of node {}: {other}",
                node.name
            )),
        })
    }

    fn live(&self, name: &str) -> Option<NodeInfo> {
        self.cache.nodes().into_iter().find(|n| n.name == name)
    }

    /// The live node known to keep `id`'s chain: its owner, or where it was found.
    fn known(&self, id: &str) -> Option<NodeInfo> {
        if let Some(n) = self.cache.owner(id) {
            return Some(n);
        }
        let name = self
            .found
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .cloned()?;
        self.live(&name)
    }

    fn remember(&self, id: &str, node: &str) {
        let mut f = self.found.lock().unwrap_or_else(|p| p.into_inner());
        f.insert(id.to_string(), node.to_string());
    }

    /// The live node that keeps `id`'s chain, looked for on every live node when not known.
    fn keeper(&self, id: &str) -> Result<Option<NodeInfo>> {
        if let Some(n) = self.known(id) {
            return Ok(Some(n));
        }
        let probe = AuditCall::Query {
            filter: Filter {
                sandbox_id: Some(id.to_string()),
                limit: 1,
                ..Filter::default()
            },
        };
        for node in self.cache.nodes() {
            if !self.read(&node, &probe)?.records.is_empty() {
                self.remember(id, &node.name);
                return Ok(Some(node));
            }
        }
        Ok(None)
    }

    /// Hands `node` its records, trying again a few times; false when they are lost.
    fn hand(&self, node: &NodeInfo, records: Vec<NewRecordDoc>) -> bool {
        let call = AuditCall::Append { records };
        for attempt in 1..=APPEND_TRIES {
            match self.call(node, &call) {
                Ok(_) => return true,
                Err(e) if attempt == APPEND_TRIES => {
                    tracing::error!(node = %node.name, error = %e, "handing audit records to their node failed for good; they are lost");
                }
                Err(e) => {
                    tracing::warn!(node = %node.name, error = %e, attempt, "handing audit records to their node; retrying");
                    std::thread::sleep(Duration::from_millis(200 * u64::from(attempt)));
                }
            }
        }
        false
    }
}

fn unsupported(what: &str) -> StoreError {
    StoreError::Unsupported(format!(
        "{what} in a cluster is not implemented in kiln yet"
    ))
}

impl AuditStore for NodeAudit {
    fn append(&self, batch: &[kiln_server::audit::record::Append]) -> Result<Vec<AuditRecord>> {
        use kiln_server::audit::record::Append;
        let mut by_node: HashMap<String, (NodeInfo, Vec<NewRecordDoc>)> = HashMap::new();
        let mut unplaced = 0usize;
        for a in batch {
            let Append::Record(r) = a else {
                // Links start a fork's chain: the node that runs the fork makes them.
                continue;
            };
            match self.known(&r.sandbox_id) {
                Some(n) => by_node
                    .entry(n.name.clone())
                    .or_insert_with(|| (n, Vec::new()))
                    .1
                    .push(NewRecordDoc::from(r as &NewRecord)),
                None => unplaced += 1,
            }
        }
        if unplaced > 0 {
            tracing::debug!(
                records = unplaced,
                "audit records about sandboxes no live node runs are not kept"
            );
        }
        for (_, (node, records)) in by_node {
            self.hand(&node, records);
        }
        // Stored on the nodes: nothing is published or evaluated on the replica.
        Ok(Vec::new())
    }

    fn prune(&self, _before_ms: Option<i64>, _keep: Option<u64>, _now_ms: i64) -> Result<usize> {
        // Each node applies its own retention to the chains it keeps.
        Ok(0)
    }

    fn query(&self, f: &Filter) -> Result<Vec<AuditRecord>> {
        let Some(id) = f.sandbox_id.as_deref() else {
            return Err(unsupported(
                "reading the audit log of every sandbox at once",
            ));
        };
        let Some(node) = self.keeper(id)? else {
            return Ok(Vec::new());
        };
        let a = self.read(&node, &AuditCall::Query { filter: f.clone() })?;
        Ok(a.records.into_iter().map(AuditRecord::from).collect())
    }

    fn chains(&self, team: Option<&str>) -> Result<Vec<String>> {
        let mut ids = Vec::new();
        let call = AuditCall::Chains {
            team: team.map(str::to_string),
        };
        for node in self.cache.nodes() {
            for id in self.read(&node, &call)?.ids {
                if self.cache.owner(&id).is_none() {
                    self.remember(&id, &node.name);
                }
                ids.push(id);
            }
        }
        // A sandbox that moved has a chain on each node it ran on; it is verified once, on
        // the node it runs on now.
        let mut seen = std::collections::HashSet::new();
        ids.retain(|id| seen.insert(id.clone()));
        Ok(ids)
    }

    fn chain(&self, sandbox_id: &str) -> Result<StoredChain> {
        let Some(node) = self.keeper(sandbox_id)? else {
            return Ok(StoredChain::default());
        };
        let call = AuditCall::Chain {
            sandbox_id: sandbox_id.to_string(),
        };
        let chain = self.read(&node, &call)?.chain;
        Ok(chain.map(StoredChain::from).unwrap_or_default())
    }

    fn record_hash(&self, sandbox_id: &str, seq: i64) -> Result<Option<String>> {
        let Some(node) = self.keeper(sandbox_id)? else {
            return Ok(None);
        };
        let call = AuditCall::RecordHash {
            sandbox_id: sandbox_id.to_string(),
            seq,
        };
        Ok(self.read(&node, &call)?.text)
    }

    fn owner(&self, sandbox_id: &str) -> Result<Option<String>> {
        let Some(node) = self.known(sandbox_id) else {
            return Ok(None);
        };
        let call = AuditCall::Owner {
            sandbox_id: sandbox_id.to_string(),
        };
        Ok(self.read(&node, &call)?.text)
    }

    fn team_of(&self, id: &str) -> Result<Option<String>> {
        if let Some(r) = self.cache.sandbox(id) {
            return Ok(Some(r.team));
        }
        let Some(node) = self.keeper(id)? else {
            return Ok(None);
        };
        let call = AuditCall::TeamOf {
            sandbox_id: id.to_string(),
        };
        Ok(self.read(&node, &call)?.text)
    }

    fn alerts(&self, _f: &AlertFilter) -> Result<Vec<AlertRecord>> {
        Err(unsupported("reading the rule engine's alerts"))
    }
}
