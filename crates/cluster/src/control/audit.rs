//! A control replica's audit store ([`NodeAudit`]): the records the replica makes (API calls
//! naming a sandbox, the envd operations its proxy forwards) go to the node that runs the
//! sandbox, which appends them to the sandbox's chain; reads go to the node that keeps the
//! chain. The server's audit log runs over it unchanged ([`kiln_server::audit::AuditLog::start_remote`]):
//! its writer thread batches, this store sends each node its part. See [`crate::audit`].
//!
//! A sandbox's node is the one etcd names as its owner (kept after it ends); a sandbox no
//! live node is known for is looked for on every live node. Records about a sandbox no live
//! node runs (an id that never existed, a sandbox whose node is lost) are not kept; those a
//! node refuses (the sandbox moved: its chain is extended elsewhere now) are handed on to the
//! node that extends it. A chain that moved is kept in parts by the nodes its head in etcd
//! names ([`crate::heads`]): its reads merge their pages, its verification joins the parts
//! and checks them against that head. Reads of every sandbox merge every live node's pages
//! ([`super::pages`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kiln_server::audit::cursor::{Cursor, Page};
use kiln_server::audit::{AuditRecord, Filter, NewRecord};
use kiln_server::driver::DriverError;
use kiln_server::store::alerts_sql::{AlertFilter, AlertRecord};
use kiln_server::store::{AuditStore, Result, StoreError, StoredChain};
use kiln_server::Error;

use super::pages::{merge, positions};
use super::{Cache, NodeClient};
use crate::audit::{AuditAnswer, AuditCall, MovedDoc, NewRecordDoc};
use crate::heads::HeadDoc;
use crate::nodes::NodeInfo;
use crate::store::EtcdStore;

/// The most chains whose node a replica remembers having found them on.
const MOST_FOUND: usize = 10_000;

/// How long one call to a node may take.
const CALL_LIMIT: Duration = Duration::from_secs(10);
/// Attempts at handing one node its records before they are given up.
const APPEND_TRIES: u32 = 5;
/// Nodes records refused by one are handed on to, one after another, at most.
const MOST_HOPS: u32 = 3;

/// The replica's audit store: its nodes' audit logs.
pub struct NodeAudit {
    cache: Arc<Cache>,
    /// The chains' heads (which nodes keep a chain).
    etcd: EtcdStore,
    client: NodeClient,
    /// The runtime the calls run on (the store's methods are called from the audit writer's
    /// thread and the blocking pool).
    rt: tokio::runtime::Handle,
    /// Where a chain was found on a node that does not own its sandbox (a sandbox that moved,
    /// or whose owner record is gone), at most [`MOST_FOUND`].
    found: Mutex<HashMap<String, String>>,
}

impl NodeAudit {
    pub fn new(
        cache: Arc<Cache>,
        etcd: EtcdStore,
        client: NodeClient,
        rt: tokio::runtime::Handle,
    ) -> Self {
        Self {
            cache,
            etcd,
            client,
            rt,
            found: Mutex::new(HashMap::new()),
        }
    }

    fn call(&self, node: &NodeInfo, call: &AuditCall) -> std::result::Result<AuditAnswer, Error> {
        let (client, address, call) = (self.client.clone(), node.address.clone(), call.clone());
        crate::blocking::on_runtime(&self.rt, async move {
            tokio::time::timeout(CALL_LIMIT, client.audit(&address, &call))
                .await
                .unwrap_or_else(|_| Err(Error::Unavailable("the node did not answer".into())))
        })
        .unwrap_or_else(|| Err(Error::Unavailable("the replica is stopping".into())))
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
        // A cache, bounded: forgotten, a chain is looked for on every node again.
        if f.len() >= MOST_FOUND && !f.contains_key(id) {
            f.clear();
        }
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
    fn hand(&self, node: &NodeInfo, records: Vec<NewRecordDoc>, hops: u32) -> bool {
        let call = AuditCall::Append { records };
        for attempt in 1..=APPEND_TRIES {
            match self.call(node, &call) {
                Ok(a) => {
                    for m in a.moved {
                        self.hand_on(node, m, hops);
                    }
                    return true;
                }
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

    /// Hands records `from` refused on to the node that extends their chains now.
    fn hand_on(&self, from: &NodeInfo, moved: MovedDoc, hops: u32) {
        let next = moved.node.as_deref().and_then(|n| self.live(n));
        match next {
            Some(next) if next.name != from.name && hops < MOST_HOPS => {
                for r in &moved.records {
                    self.remember(&r.sandbox_id, &next.name);
                }
                self.hand(&next, moved.records, hops + 1);
            }
            _ => {
                tracing::warn!(node = %from.name, records = moved.records.len(), to = ?moved.node, "audit records refused by their node (the sandbox moved) have no live node to go to; they are lost")
            }
        }
    }

    /// The head etcd keeps of `id`'s chain.
    fn head_doc(&self, id: &str) -> Result<Option<HeadDoc>> {
        let (etcd, id) = (self.etcd.clone(), id.to_string());
        let seen = crate::blocking::on_runtime(&self.rt, async move { etcd.audit_head(&id).await })
            .ok_or_else(|| StoreError::Task("the replica is stopping".into()))?
            .map_err(|e| StoreError::Task(format!("reading an audit chain's head: {e}")))?;
        Ok(seen.map(|s| s.doc))
    }

    /// The live nodes keeping parts of `id`'s chain, oldest part first (`doc`: its head).
    fn parts_of(&self, id: &str, doc: Option<&HeadDoc>) -> Result<Vec<NodeInfo>> {
        if let Some(doc) = doc {
            let live = self.cache.nodes();
            for n in doc
                .nodes
                .iter()
                .filter(|n| !live.iter().any(|l| &&l.name == n))
            {
                tracing::warn!(sandbox = id, node = %n, "a node keeping part of a sandbox's audit chain is away: that part is not read");
            }
            let parts: Vec<NodeInfo> = doc
                .nodes
                .iter()
                .filter_map(|n| live.iter().find(|l| &l.name == n).cloned())
                .collect();
            if !parts.is_empty() {
                return Ok(parts);
            }
        }
        Ok(self.keeper(id)?.into_iter().collect())
    }
}

impl NodeAudit {
    /// The live nodes a read of `sandbox` (every sandbox: None) asks.
    fn readers(&self, sandbox: Option<&str>) -> Result<Vec<NodeInfo>> {
        match sandbox {
            Some(id) => self.parts_of(id, self.head_doc(id)?.as_ref()),
            None => Ok(self.cache.nodes()),
        }
    }

    /// The first answer to `call` of the nodes keeping parts of `id`'s chain, oldest part
    /// first.
    fn first_text(&self, id: &str, call: &AuditCall) -> Result<Option<String>> {
        for node in self.readers(Some(id))? {
            if let Some(t) = self.read(&node, call)?.text {
                return Ok(Some(t));
            }
        }
        Ok(None)
    }

    /// One page of what the nodes keeping `sandbox`'s chain (every live node: None) answer
    /// to `call(their position in after)`, merged by `order` (time, then the node's own
    /// position). A node whose log is
    /// off refuses a read of one sandbox and is left out of a read of every sandbox (it keeps
    /// no records); one that does not answer is left out (its position stays, so what it
    /// keeps is read on a later page).
    fn paged<T>(
        &self,
        sandbox: Option<&str>,
        after: Option<&Cursor>,
        limit: usize,
        call: impl Fn(Cursor) -> AuditCall,
        items: impl Fn(AuditAnswer) -> Vec<T>,
        order: impl Fn(&T) -> (i64, i64),
    ) -> Result<Page<T>> {
        let start = positions(after)?;
        let mut pages = Vec::new();
        for node in self.readers(sandbox)? {
            let at = Cursor::At(start.get(&node.name).copied().unwrap_or(0));
            match self.read(&node, &call(at)) {
                Ok(a) => pages.push((node.name.clone(), items(a))),
                Err(StoreError::Unsupported(_)) if sandbox.is_none() => {}
                Err(e @ StoreError::Unsupported(_)) => return Err(e),
                Err(e) => {
                    tracing::warn!(node = %node.name, error = %e, "a node's audit log is left out of a page; it is read on the next");
                }
            }
        }
        Ok(merge(pages, start, limit, order))
    }
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
            self.hand(&node, records, 0);
        }
        // Stored on the nodes: nothing is published or evaluated on the replica.
        Ok(Vec::new())
    }

    fn prune(&self, _before_ms: Option<i64>, _keep: Option<u64>, _now_ms: i64) -> Result<usize> {
        // Each node applies its own retention to the chains it keeps.
        Ok(0)
    }

    fn query(&self, f: &Filter) -> Result<Vec<AuditRecord>> {
        Ok(self.page(f)?.items)
    }

    fn page(&self, f: &Filter) -> Result<Page<AuditRecord>> {
        let call = |at| AuditCall::Query {
            filter: Filter {
                after: Some(at),
                ..f.clone()
            },
        };
        let records = |a: AuditAnswer| a.records.into_iter().map(AuditRecord::from).collect();
        let (sandbox, after) = (f.sandbox_id.as_deref(), f.after.as_ref());
        self.paged(sandbox, after, f.limit, call, records, |r| {
            (r.ts_ms, r.cursor)
        })
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
        // The head first: a part read after it holds at least what the head names.
        let doc = self.head_doc(sandbox_id)?;
        let call = AuditCall::Chain {
            sandbox_id: sandbox_id.to_string(),
        };
        let mut parts = Vec::new();
        for node in self.parts_of(sandbox_id, doc.as_ref())? {
            if let Some(c) = self.read(&node, &call)?.chain {
                parts.push(StoredChain::from(c));
            }
        }
        Ok(crate::heads::assemble(parts, doc.as_ref()))
    }

    fn record_hash(&self, sandbox_id: &str, seq: i64) -> Result<Option<String>> {
        let call = AuditCall::RecordHash {
            sandbox_id: sandbox_id.to_string(),
            seq,
        };
        self.first_text(sandbox_id, &call)
    }

    fn owner(&self, sandbox_id: &str) -> Result<Option<String>> {
        // Its create's record is on the part of the node it started on (the first).
        let call = AuditCall::Owner {
            sandbox_id: sandbox_id.to_string(),
        };
        self.first_text(sandbox_id, &call)
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

    fn alerts(&self, f: &AlertFilter) -> Result<Page<AlertRecord>> {
        let call = |at| AuditCall::Alerts {
            filter: AlertFilter {
                after: Some(at),
                ..f.clone()
            },
        };
        let alerts = |a: AuditAnswer| a.alerts.into_iter().map(AlertRecord::from).collect();
        let (sandbox, after) = (f.sandbox_id.as_deref(), f.after.as_ref());
        self.paged(sandbox, after, f.limit, call, alerts, |a| (a.ts_ms, a.id))
    }
}
