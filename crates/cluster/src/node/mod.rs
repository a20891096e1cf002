//! `kiln node`: a host that runs sandboxes for the cluster. It is one host's server (the
//! `Manager` on its driver, its own SQLite for what only it needs) registered in etcd on a
//! lease with its internal address and capacity, its load refreshed; its listener serves the
//! node-internal API ([`api`]) instead of the public one; its sandboxes' records and events
//! are published to etcd ([`publish`]). When its lease is lost it fences itself: the API
//! refuses everything, tunnels close, its sandboxes are stopped, the server shuts down as on
//! SIGTERM (its warm pool drained), and [`run`] returns [`NodeExit::Fenced`]. With an object
//! store, its paused sandboxes' checkpoints go to the bucket and paused sandboxes of other
//! nodes can be taken over ([`moves`]), and it campaigns to run the bucket's garbage
//! collection ([`crate::gc`]). Its snapshots are recorded in etcd as its own, their files
//! kept on it and, with an object store, in the bucket too ([`snapshots`]). It keeps its
//! sandboxes' audit chains, with the records control replicas make of them ([`audit`]), their
//! heads in etcd so a sandbox that moves here continues its chain ([`heads`]).

mod api;
mod audit;
mod builds;
mod creates;
pub mod heads;
pub mod moves;
mod publish;
mod snapshots;
pub mod templates;
mod tunnel;
mod volumes;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use kiln_server::{SandboxService, Server};

use crate::error::Result;
use crate::gc::GcConfig;
use crate::nodes::{NodeCapacity, NodeLoad, NodeTemplate};
use crate::objects::{ChunkCache, ChunkStore};
use crate::secret::ClusterSecret;
use crate::store::EtcdStore;
use publish::Publisher;

/// A request for a router of the server's own handlers, made from one the node's internal API
/// received (`parts`, `body`): the same method and headers, at `path` with the original query;
/// the outer router's path parameters stay behind. 400 when the path does not make a URI.
fn inner_request(
    parts: axum::http::request::Parts,
    path: &str,
    body: axum::body::Body,
) -> std::result::Result<axum::extract::Request, kiln_server::ApiError> {
    let query = parts
        .uri
        .query()
        .map(|q| format!("?{q}"))
        .unwrap_or_default();
    let uri: axum::http::Uri = format!("{path}{query}")
        .parse()
        .map_err(|_| kiln_server::ApiError::bad_request("a malformed path"))?;
    let mut inner = axum::extract::Request::new(body);
    *inner.method_mut() = parts.method;
    *inner.uri_mut() = uri;
    *inner.headers_mut() = parts.headers;
    Ok(inner)
}

/// What the internal API's handlers share.
pub struct NodeApi {
    pub service: Arc<dyn SandboxService>,
    /// The host's API state (its vault, interception CA and sealed per-sandbox settings), for
    /// what a create through the public API does besides the lifecycle call.
    pub app: Arc<kiln_server::api::AppState>,
    /// The host's manager (what the lifecycle seam does not carry: volumes kept for the
    /// cluster).
    pub manager: Arc<kiln_server::Manager>,
    pub secret: ClusterSecret,
    /// Whether the node's lease is alive.
    pub alive: watch::Receiver<bool>,
    pub publisher: Publisher,
    /// Checkpoints in object storage (None: no object store configured).
    pub mover: Option<moves::Mover>,
    /// Creates in flight and recent ones, by idempotency token.
    pub creates: creates::Creates,
    /// The cluster's state (snapshots are recorded there as this node's).
    pub etcd: EtcdStore,
    /// This node's name in the cluster.
    pub name: String,
    /// The node's audit log: its sandboxes' chains, with what control replicas record of them.
    pub audit: kiln_server::audit::AuditLog,
    /// The heads of the chains it extends, in etcd.
    pub heads: heads::Heads,
    /// Held by a create from a snapshot borrowed from object storage (one at a time).
    pub borrowing: Arc<tokio::sync::Mutex<()>>,
    /// The host's template store, where templates fetched from object storage are adopted
    /// (None: this node fetches none).
    pub templates: Option<kiln_template::Store>,
    /// Held while a template is stored in or fetched from object storage (one at a time).
    pub template_files: Arc<tokio::sync::Mutex<()>>,
}

/// A node's object store: the bucket, its local cache of fetched chunks, and whether the node
/// takes part in the bucket's garbage collection.
#[derive(Debug, Clone)]
pub struct NodeObjects {
    pub chunks: ChunkStore,
    pub cache: ChunkCache,
    /// None: this node never collects the bucket's garbage.
    pub gc: Option<GcConfig>,
}

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
    /// Where paused sandboxes' checkpoints go (None: they stay on this node's disk).
    pub objects: Option<NodeObjects>,
    /// The host's template store (templates other nodes stored in the bucket are adopted
    /// into it).
    pub templates: Option<kiln_template::Store>,
    /// Whether this node runs the cluster's template builds (the Template API, [`builds`]).
    pub builds: bool,
    /// How long the cluster holds this node's running sandboxes after it is stopped, for it
    /// to come back on its state directory ([`crate::restarts`]; zero: they end at once).
    pub restart_grace: Duration,
    /// The heads of the node's audit chains in etcd: given to its server's audit log as its
    /// guard before the server started, so the records of its recovery are guarded too.
    pub heads: heads::Heads,
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
pub async fn run(mut server: Server, etcd: EtcdStore, cfg: NodeConfig) -> Result<NodeExit> {
    let manager = server.manager.clone();
    // The heads of the audit chains this node extends are kept in etcd, moved with each
    // append, so the next node a sandbox moves to continues its chain (the guard was given
    // to the audit log as it started).
    let heads = cfg.heads.clone();
    // Teams' secrets are the cluster's: in etcd, sealed with the key every process derives.
    let vault = server.use_secrets(
        &cfg.secret.vault_key(),
        Arc::new(crate::secrets::EtcdSecrets::new(etcd.clone())),
    )?;
    // Workload identity tokens are signed with the cluster's key (every replica's JWKS).
    server.use_identity_key(&crate::cluster_keys::identity_key(&etcd, &vault).await?)?;
    let forgetting = tokio::spawn(crate::secrets::forget_on_change(etcd.clone(), vault));
    let mut lease = etcd
        .register_node_at(
            &cfg.name,
            &cfg.advertise,
            capacity(cfg.max_sandboxes),
            cfg.lease_ttl,
        )
        .await?;
    match etcd.clear_restarting(&cfg.name).await {
        Ok(true) => {
            tracing::info!(node = %cfg.name, "back within the restart grace: its sandboxes are held for it")
        }
        Ok(false) => {}
        Err(e) => tracing::warn!(error = %e, "clearing the node's restart mark"),
    }
    lease.set_objects(cfg.objects.is_some());
    lease.set_builds(cfg.builds);
    // In the cluster with its templates before it says it listens: a create sent once the
    // line is out finds it.
    report(&manager, &mut lease).await;
    println!(
        "kiln: node {} listening on http://{} (advertised as {})",
        cfg.name, server.local_addr, cfg.advertise
    );
    let publisher = Publisher::start(
        etcd.clone(),
        manager.store().clone(),
        cfg.name.clone(),
        lease.lease_id(),
        manager.subscribe(),
    );
    tokio::spawn(adopt(
        server.recovery.clone(),
        manager.clone(),
        etcd.clone(),
        publisher.clone(),
        cfg.name.clone(),
    ));
    let collector = cfg.objects.as_ref().and_then(|o| {
        let gc = o.gc?;
        Some(tokio::spawn(crate::gc::run(
            etcd.clone(),
            o.chunks.clone(),
            cfg.name.clone(),
            gc,
        )))
    });
    if let Some(o) = &cfg.objects {
        let cache = o.cache.clone();
        tokio::spawn(async move {
            if let Err(e) = cache.trim().await {
                tracing::warn!(error = %e, "trimming the chunk cache");
            }
        });
    }
    // Subscribed before serving, so no pause made meanwhile goes without its upload.
    let pauses = cfg.objects.as_ref().map(|_| manager.subscribe());
    let node_api = {
        let (service, secret, alive) = (manager.clone(), cfg.secret.clone(), lease.alive());
        let (etcd, name, audit) = (etcd.clone(), cfg.name.clone(), manager.audit().clone());
        let (templates, objects) = (cfg.templates.clone(), cfg.objects.clone());
        let (host, recovery) = (manager.clone(), server.recovery.clone());
        // Made once the server's API state exists: what moves a sandbox or forgets a
        // snapshot needs its vault and the sandboxes' sealed network settings.
        move |app: Arc<kiln_server::api::AppState>| {
            let mover = objects.map(|o| moves::Mover {
                manager: host.clone(),
                etcd: etcd.clone(),
                chunks: o.chunks,
                cache: o.cache,
                node: name.clone(),
                api_pausing: Default::default(),
                taking: Default::default(),
                heads: heads.clone(),
                app: app.clone(),
            });
            if let (Some(m), Some(events)) = (&mover, pauses) {
                tokio::spawn(moves::upload_other_pauses(m.clone(), events));
            }
            let drops = snapshots::drop_deleted(recovery, app.clone(), etcd.clone(), name.clone());
            tokio::spawn(drops);
            NodeApi {
                app,
                manager: host,
                service,
                secret,
                alive,
                publisher,
                mover,
                creates: Default::default(),
                etcd,
                name,
                audit,
                heads,
                borrowing: Default::default(),
                templates,
                template_files: Default::default(),
            }
        }
    };
    let fenced = Arc::new(AtomicBool::new(false));
    let stop = {
        let (mut alive, fenced, m) = (lease.alive(), fenced.clone(), manager.clone());
        let name = cfg.name.clone();
        async move {
            let lost = async move {
                let _ = alive.wait_for(|a| !*a).await;
            };
            tokio::select! {
                _ = kiln_server::stop_signal() => {}
                _ = lost => {
                    tracing::error!(node = %name, "the node's cluster lease is lost: fencing");
                    fenced.store(true, Ordering::SeqCst);
                    fence(&m).await;
                }
            }
        }
    };
    let mut serving = tokio::spawn(server.serve_with(move |app| api::router(node_api(app)), stop));
    let mut tick = tokio::time::interval(cfg.load_every);
    loop {
        tokio::select! {
            r = &mut serving => {
                if let Ok(Err(e)) = r {
                    tracing::error!(error = %e, "serving the node API");
                }
                break;
            }
            _ = tick.tick(), if lease.is_alive() => report(&manager, &mut lease).await,
        }
    }
    if let Some(c) = collector {
        c.abort();
    }
    forgetting.abort();
    if fenced.load(Ordering::SeqCst) {
        return Ok(NodeExit::Fenced);
    }
    if !cfg.restart_grace.is_zero() {
        // Marked before the lease goes, so no sweep finds the node gone and unmarked.
        match etcd.mark_restarting(&cfg.name, cfg.restart_grace).await {
            Ok(()) => {
                tracing::info!(node = %cfg.name, grace_s = cfg.restart_grace.as_secs(), "stopping: the cluster holds this node's running sandboxes for its restart grace")
            }
            Err(e) => {
                tracing::warn!(error = %e, "marking the node restarting: its running sandboxes will end as a lost node's")
            }
        }
    }
    lease.leave().await?;
    Ok(NodeExit::Stopped)
}

/// Writes what the node holds (its templates) and has in use into its registration.
async fn report(manager: &kiln_server::Manager, lease: &mut crate::nodes::NodeLease) {
    match manager.templates().await {
        Ok(list) => lease.set_templates(list.iter().map(NodeTemplate::from).collect()),
        Err(e) => tracing::warn!(error = %e, "listing the node's templates"),
    }
    let load = NodeLoad {
        free_memory_mb: meminfo("MemAvailable:").unwrap_or(0),
        sandboxes: SandboxService::list(manager).len() as u32,
        free_cpu_milli: free_cpu_milli(),
    };
    if let Err(e) = lease.report_load(load).await {
        tracing::warn!(error = %e, "reporting the node's load");
    }
}

/// Stops every sandbox of a node that lost its lease (the cluster counts them `node-lost`).
async fn fence(manager: &kiln_server::Manager) {
    for r in SandboxService::list(manager) {
        if let Err(e) = manager.kill(&r.id, crate::owners::NODE_LOST_REASON).await {
            tracing::warn!(sandbox = %r.id, error = %e, "stopping a fenced sandbox");
        }
    }
}

/// Once recovery is over, what it adopted from a previous run is published again as this
/// node's, except sandboxes the cluster ended meanwhile (their node was counted lost) and
/// paused ones another node took over: those are stopped, so none runs that the cluster
/// believes dead or elsewhere.
async fn adopt(
    recovery: kiln_server::Recovery,
    manager: Arc<kiln_server::Manager>,
    etcd: EtcdStore,
    publisher: Publisher,
    node: String,
) {
    use kiln_server::store::SandboxStore;
    if recovery.done().await.is_err() {
        return;
    }
    for r in SandboxService::list(manager.as_ref()) {
        match etcd.get_sandbox(&r.id).await {
            Ok(Some(known)) if !known.state.is_live() => {
                tracing::warn!(sandbox = %r.id, "ended by the cluster while this node was away: stopping it");
                if let Err(e) = manager.kill(&r.id, crate::owners::NODE_LOST_REASON).await {
                    tracing::warn!(sandbox = %r.id, error = %e, "stopping an adopted sandbox");
                }
            }
            _ => match etcd.owner_of(&r.id).await {
                Ok(Some(owner)) if owner != node => {
                    tracing::info!(sandbox = %r.id, %owner, "taken over by another node while this node was away: dropping it");
                    if let Err(e) = manager
                        .kill(&r.id, "moved: another node took it over")
                        .await
                    {
                        tracing::warn!(sandbox = %r.id, error = %e, "dropping a moved sandbox");
                    }
                }
                _ => {
                    publisher.sandbox(&r.id).await;
                }
            },
        }
    }
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

/// The CPU count less the 1-minute load average, in thousandths of a CPU.
fn free_cpu_milli() -> u32 {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let load = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|t| t.split_whitespace().next()?.parse::<f64>().ok())
        .unwrap_or(0.0);
    ((cpus - load).max(0.0) * 1000.0) as u32
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
