//! Node membership on etcd leases: a node registers under `nodes/{name}` with a key attached
//! to its lease and keeps the lease alive; when it stops (crash, cut link) the lease expires,
//! etcd deletes the key, and every watcher hears that the node is lost.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use etcd_client::{
    Client, Compare, CompareOp, EventType, KeyValue, PutOptions, Txn, TxnOp, WatchOptions,
    WatchStream,
};
use kiln_server::manager::TemplateView;
use kiln_server::store::now_ms;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::docs::{json, parse};
use crate::error::{ClusterError, Result};
use crate::retry::{self, Kind};
use crate::store::EtcdStore;

/// What a node offers.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeCapacity {
    pub cpus: u32,
    pub memory_mb: u64,
    pub disk_mb: u64,
    pub max_sandboxes: u32,
}

/// What a node has in use, as it last reported.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeLoad {
    /// Memory available for new sandboxes (the host's `MemAvailable`).
    pub free_memory_mb: u64,
    /// Running and paused sandboxes.
    pub sandboxes: u32,
    /// CPUs not busy (thousandths): the CPU count less the 1-minute load average.
    #[serde(default)]
    pub free_cpu_milli: u32,
}

/// A template a node holds: what `GET /templates` shows through a replica, and what placement
/// matches a create's template against.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeTemplate {
    pub name: String,
    /// The build: the template's content hash.
    pub key: String,
    pub cpu_count: u32,
    pub memory_mb: u32,
    pub disk_mb: u64,
    pub built_at_unix: u64,
    pub size_bytes: u64,
    /// Sandboxes the node started from it, and when it last did.
    #[serde(default)]
    pub spawn_count: u64,
    #[serde(default)]
    pub last_spawned_ms: Option<i64>,
}

impl From<&TemplateView> for NodeTemplate {
    fn from(v: &TemplateView) -> Self {
        Self {
            name: v.info.name.clone(),
            key: v.info.key.clone(),
            cpu_count: v.cpu_count,
            memory_mb: v.memory_mb,
            disk_mb: v.disk_mb,
            built_at_unix: v.info.built_at_unix,
            size_bytes: v.info.size_bytes,
            spawn_count: v.record.as_ref().map_or(0, |r| r.spawn_count),
            last_spawned_ms: v.record.as_ref().and_then(|r| r.last_spawned_ms),
        }
    }
}

/// A registered node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    pub name: String,
    /// Where control replicas reach its internal API (`host:port`; empty: nowhere).
    #[serde(default)]
    pub address: String,
    pub capacity: NodeCapacity,
    #[serde(default)]
    pub load: NodeLoad,
    pub joined_at_ms: i64,
    /// Set by a node that leaves on purpose, just before it revokes its lease.
    #[serde(default)]
    pub leaving: bool,
    /// The templates it can start sandboxes of.
    #[serde(default)]
    pub templates: Vec<NodeTemplate>,
    /// Whether it has the cluster's object storage (it can fetch templates and checkpoints).
    #[serde(default)]
    pub objects: bool,
    /// Whether it runs the cluster's template builds (the Template API).
    #[serde(default)]
    pub builds: bool,
    /// The etcd lease the node's key is attached to.
    #[serde(skip)]
    pub lease_id: i64,
}

impl NodeInfo {
    /// Whether the node can start sandboxes of template `name`.
    pub fn has_template(&self, name: &str) -> bool {
        self.templates.iter().any(|t| t.name == name)
    }
}

/// A change in membership.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeEvent {
    Joined(NodeInfo),
    /// The node left on purpose ([`NodeLease::leave`]).
    Left(String),
    /// The node's lease expired (or was revoked without leaving): it stopped keeping alive.
    Lost(String),
}

pub(crate) fn node_of(kv: &KeyValue) -> Result<NodeInfo> {
    let mut n: NodeInfo = parse(kv.key(), kv.value())?;
    n.lease_id = kv.lease();
    Ok(n)
}

/// A node's registration. Keep-alives run in the background while it is held; dropping it
/// stops them (the lease then expires after its TTL, as on a crash).
pub struct NodeLease {
    info: NodeInfo,
    key: String,
    client: Client,
    alive: watch::Receiver<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl NodeLease {
    pub fn info(&self) -> &NodeInfo {
        &self.info
    }
    pub fn lease_id(&self) -> i64 {
        self.info.lease_id
    }
    /// Whether the lease is known to be alive (false once etcd said it is gone, or no
    /// keep-alive was answered for a whole TTL).
    pub fn is_alive(&self) -> bool {
        *self.alive.borrow()
    }
    /// Whether the lease is alive, as it changes.
    pub fn alive(&self) -> watch::Receiver<bool> {
        self.alive.clone()
    }
    /// Says whether the node has object storage (written with the next [`Self::report_load`]).
    pub fn set_objects(&mut self, objects: bool) {
        self.info.objects = objects;
    }
    /// Says whether the node runs the cluster's template builds (written with the next
    /// [`Self::report_load`]).
    pub fn set_builds(&mut self, builds: bool) {
        self.info.builds = builds;
    }
    /// Sets the templates the node holds (written with the next [`Self::report_load`]).
    pub fn set_templates(&mut self, templates: Vec<NodeTemplate>) {
        self.info.templates = templates;
    }
    /// Records what the node now has in use (nothing when its lease is gone).
    pub async fn report_load(&mut self, load: NodeLoad) -> Result<()> {
        self.info.load = load;
        self.write_info().await
    }

    /// Writes the registration as it is now, on the lease, while the key still is the
    /// lease's (a write is safe to repeat, so it is tried again while the cluster fails over).
    async fn write_info(&self) -> Result<()> {
        let lease = self.info.lease_id;
        let put = TxnOp::put(
            self.key.as_str(),
            json(&self.info),
            Some(PutOptions::new().with_lease(lease)),
        );
        let same = Compare::lease(self.key.as_str(), CompareOp::Equal, lease);
        let txn = Txn::new().when([same]).and_then([put]);
        retry::run(&self.client, Kind::Read, |mut c| {
            let txn = txn.clone();
            async move { c.txn(txn).await }
        })
        .await?;
        Ok(())
    }
    /// Resolves once the lease is no longer alive (the node must then fence itself).
    pub async fn lost(&mut self) {
        let _ = self.alive.wait_for(|alive| !alive).await;
    }
    /// Leaves the cluster: marks the registration as leaving, then revokes the lease. Both
    /// steps are safe to repeat, so both are tried again while the cluster fails over.
    pub async fn leave(mut self) -> Result<()> {
        self.task.abort();
        self.info.leaving = true;
        self.write_info().await?;
        let lease = self.info.lease_id;
        retry::run(&self.client, Kind::Read, |mut c| async move {
            c.lease_revoke(lease).await
        })
        .await?;
        Ok(())
    }
}

impl Drop for NodeLease {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The members as they were when the watch began, then every change after.
pub struct NodeWatch {
    initial: Vec<NodeInfo>,
    stream: WatchStream,
    pending: VecDeque<NodeEvent>,
}

impl NodeWatch {
    /// The live nodes at the revision the watch starts after.
    pub fn initial(&self) -> &[NodeInfo] {
        &self.initial
    }

    /// The next membership change.
    pub async fn next(&mut self) -> Result<NodeEvent> {
        loop {
            if let Some(e) = self.pending.pop_front() {
                return Ok(e);
            }
            let Some(resp) = self.stream.message().await? else {
                return Err(ClusterError::StreamClosed("node watch"));
            };
            if resp.canceled() {
                return Err(ClusterError::StreamClosed("node watch"));
            }
            for e in resp.events() {
                let Some(kv) = e.kv() else { continue };
                match e.event_type() {
                    EventType::Put if kv.version() == 1 => {
                        self.pending.push_back(NodeEvent::Joined(node_of(kv)?));
                    }
                    EventType::Put => {}
                    EventType::Delete => {
                        let prev = e.prev_kv().map(node_of).transpose()?;
                        let name = match &prev {
                            Some(n) => n.name.clone(),
                            None => key_name(kv.key()),
                        };
                        self.pending.push_back(match prev {
                            Some(n) if n.leaving => NodeEvent::Left(name),
                            _ => NodeEvent::Lost(name),
                        });
                    }
                }
            }
        }
    }
}

fn key_name(key: &[u8]) -> String {
    let k = String::from_utf8_lossy(key);
    let last = k.rsplit('/').next().unwrap_or_default();
    crate::keys::unescape(last).unwrap_or_else(|| last.to_string())
}

impl EtcdStore {
    /// Registers node `name` with a lease of `ttl` (whole seconds, at least 2) kept alive in
    /// the background. Fails with [`ClusterError::NodeTaken`] while another live lease holds
    /// the name.
    pub async fn register_node(
        &self,
        name: &str,
        capacity: NodeCapacity,
        ttl: Duration,
    ) -> Result<NodeLease> {
        self.register_node_at(name, "", capacity, ttl).await
    }

    /// [`EtcdStore::register_node`] of a node whose internal API is at `address`.
    pub async fn register_node_at(
        &self,
        name: &str,
        address: &str,
        capacity: NodeCapacity,
        ttl: Duration,
    ) -> Result<NodeLease> {
        let ttl_s = ttl.as_secs().max(2) as i64;
        let client = self.client();
        let lease = self.grant_lease(ttl_s).await?;
        let info = NodeInfo {
            name: name.to_string(),
            address: address.to_string(),
            capacity,
            load: NodeLoad::default(),
            joined_at_ms: now_ms(),
            leaving: false,
            templates: Vec::new(),
            objects: false,
            builds: false,
            lease_id: lease,
        };
        let key = self.keys().node(name);
        let put = TxnOp::put(
            key.as_str(),
            json(&info),
            Some(PutOptions::new().with_lease(lease)),
        );
        if !self.create(std::slice::from_ref(&key), vec![put]).await? {
            let _ = client.clone().lease_revoke(lease).await;
            return Err(ClusterError::NodeTaken(name.to_string()));
        }
        let (tx, alive) = watch::channel(true);
        let task = tokio::spawn(keep_alive(client.clone(), lease, ttl_s, tx));
        Ok(NodeLease {
            info,
            key,
            client,
            alive,
            task,
        })
    }

    /// The nodes with a live lease, by name.
    pub async fn live_nodes(&self) -> Result<Vec<NodeInfo>> {
        let mut out = self
            .get_prefix(&self.keys().dir("nodes"), 0)
            .await?
            .iter()
            .map(node_of)
            .collect::<Result<Vec<_>>>()?;
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Watches membership: the live nodes now, then each join, leave and loss after.
    pub async fn watch_nodes(&self) -> Result<NodeWatch> {
        let dir = self.keys().dir("nodes");
        let mut r = self
            .get(&dir, etcd_client::GetOptions::new().with_prefix())
            .await?;
        let rev = r.header().map(|h| h.revision()).unwrap_or(0);
        let mut initial = r
            .take_kvs()
            .iter()
            .map(node_of)
            .collect::<Result<Vec<_>>>()?;
        initial.sort_by(|a, b| a.name.cmp(&b.name));
        let opts = WatchOptions::new()
            .with_prefix()
            .with_prev_key()
            .with_start_revision(rev + 1);
        let stream = retry::run(&self.client(), Kind::Read, |mut c| {
            let (dir, opts) = (dir.clone(), opts.clone());
            async move { c.watch(dir, Some(opts)).await }
        })
        .await?;
        Ok(NodeWatch {
            initial,
            stream,
            pending: VecDeque::new(),
        })
    }
}

/// Renews lease `id` every third of its TTL, reopening the keep-alive stream when it breaks
/// or when two renewals in a row went unanswered (its member may be gone). Reports the lease
/// lost when etcd says it is gone, or when no renewal was answered for a whole TTL counted
/// from when that renewal was sent (etcd cannot have extended the lease past that). A slow
/// answer is still taken (on a loaded host etcd may take over a third of the TTL): each
/// answer is credited to the oldest renewal outstanding, whose sending time it stands for,
/// so the node never believes its lease longer than etcd keeps it.
async fn keep_alive(mut client: Client, id: i64, ttl_s: i64, alive: watch::Sender<bool>) {
    use tokio::time::{sleep, timeout};
    let ttl = Duration::from_secs(ttl_s as u64);
    let period = ttl / 3;
    let mut last_ok = Instant::now();
    'reconnect: while last_ok.elapsed() < ttl {
        let Ok(Ok((mut keeper, mut stream))) = timeout(period, client.lease_keep_alive(id)).await
        else {
            sleep(period / 4).await;
            continue;
        };
        // Renewals sent on this stream and not answered yet, oldest first.
        let mut outstanding: std::collections::VecDeque<Instant> = Default::default();
        let mut next = Instant::now();
        while last_ok.elapsed() < ttl {
            if Instant::now() >= next {
                if outstanding.len() >= 2 {
                    continue 'reconnect;
                }
                let sent = Instant::now();
                if !matches!(timeout(period, keeper.keep_alive()).await, Ok(Ok(()))) {
                    sleep(period / 4).await;
                    continue 'reconnect;
                }
                outstanding.push_back(sent);
                next = sent + period;
            }
            let left = ttl.saturating_sub(last_ok.elapsed());
            let wait = next.saturating_duration_since(Instant::now()).min(left);
            match timeout(wait, stream.message()).await {
                Ok(Ok(Some(r))) if r.ttl() > 0 => {
                    if let Some(sent) = outstanding.pop_front() {
                        last_ok = last_ok.max(sent);
                    }
                }
                Ok(Ok(Some(_))) => break 'reconnect,
                Ok(_) => {
                    sleep(period / 4).await;
                    continue 'reconnect;
                }
                // No answer yet: the next renewal is due.
                Err(_) => {}
            }
        }
    }
    let _ = alive.send(false);
}
