//! `kiln node`: a host that runs sandboxes for the cluster. It is one host's server (the
//! `Manager` on its driver, its own SQLite for what only it needs) registered in etcd on a
//! lease with its internal address and capacity, its load refreshed; its listener serves the
//! node-internal API ([`api`]) instead of the public one; its sandboxes' records and events
//! are published to etcd ([`publish`]). When its lease is lost it fences itself: the API
//! refuses everything, tunnels close, its sandboxes are stopped, and [`run`] returns
//! [`NodeExit::Fenced`].

mod api;
mod publish;
mod tunnel;

use std::time::Duration;

use kiln_server::{SandboxService, Server};

use crate::error::Result;
use crate::nodes::{NodeCapacity, NodeLoad};
use crate::secret::ClusterSecret;
use crate::store::EtcdStore;
use publish::Publisher;

/// How a node is known to the cluster.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    pub name: String,
    /// Where control replicas reach the node's listener (`host:port`).
    pub advertise: String,
    pub secret: ClusterSecret,
    /// The node's lease; the cluster counts it lost this long after its last renewal.
    pub lease_ttl: Duration,
    /// How often the node's load is refreshed in etcd.
    pub load_every: Duration,
    /// The most sandboxes it takes (0: no cap of its own).
    pub max_sandboxes: u32,
}

/// Why [`run`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeExit {
    /// Asked to stop (SIGTERM/SIGINT): it left the cluster.
    Stopped,
    /// Its lease was lost: it fenced itself and stopped its sandboxes.
    Fenced,
}

/// Runs `server` as cluster node `cfg.name` until it is stopped or fenced.
pub async fn run(server: Server, etcd: EtcdStore, cfg: NodeConfig) -> Result<NodeExit> {
    let manager = server.manager.clone();
    let mut lease = etcd
        .register_node_at(
            &cfg.name,
            &cfg.advertise,
            capacity(cfg.max_sandboxes),
            cfg.lease_ttl,
        )
        .await?;
    let publisher = Publisher::start(
        etcd.clone(),
        manager.store().clone(),
        cfg.name.clone(),
        lease.lease_id(),
        manager.subscribe(),
    );
    let mut alive = lease.alive();
    let (recovery, p) = (server.recovery.clone(), publisher.clone());
    let m = manager.clone();
    tokio::spawn(async move {
        // What recovery adopted from a previous run is the node's again.
        if recovery.done().await.is_ok() {
            for r in SandboxService::list(m.as_ref()) {
                p.sandbox(&r.id).await;
            }
        }
    });
    let node_api = api::NodeApi {
        service: manager.clone(),
        secret: cfg.secret.clone(),
        alive: alive.clone(),
        publisher,
    };
    let mut serving = tokio::spawn(server.serve_with(move |_| api::router(node_api)));
    let mut tick = tokio::time::interval(cfg.load_every);
    loop {
        tokio::select! {
            r = &mut serving => {
                if let Ok(Err(e)) = r {
                    tracing::error!(error = %e, "serving the node API");
                }
                lease.leave().await?;
                return Ok(NodeExit::Stopped);
            }
            _ = alive.wait_for(|a| !*a) => break,
            _ = tick.tick() => {
                let load = NodeLoad {
                    free_memory_mb: meminfo("MemAvailable:").unwrap_or(0),
                    sandboxes: SandboxService::list(manager.as_ref()).len() as u32,
                };
                if let Err(e) = lease.report_load(load).await {
                    tracing::warn!(error = %e, "reporting the node's load");
                }
            }
        }
    }
    tracing::error!(node = %cfg.name, "the node's cluster lease is lost: fencing");
    for r in SandboxService::list(manager.as_ref()) {
        if let Err(e) = manager.kill(&r.id, crate::owners::NODE_LOST_REASON).await {
            tracing::warn!(sandbox = %r.id, error = %e, "stopping a fenced sandbox");
        }
    }
    serving.abort();
    Ok(NodeExit::Fenced)
}

/// What this host offers.
fn capacity(max_sandboxes: u32) -> NodeCapacity {
    NodeCapacity {
        cpus: std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
        memory_mb: meminfo("MemTotal:").unwrap_or(0),
        disk_mb: 0,
        max_sandboxes,
    }
}

/// A `/proc/meminfo` field in MiB.
fn meminfo(field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with(field))?;
    let kb: u64 = line[field.len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb / 1024)
}
