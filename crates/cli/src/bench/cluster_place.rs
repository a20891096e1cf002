//! `kiln bench cluster`'s placement part: simulated nodes and sandboxes written into a real
//! etcd through kiln_cluster's own registration and publication, a control replica's view
//! loaded from it by its watch, then the replica's placement decision timed as a create makes
//! it ([`ClusterService::decide`]: the team quota read from etcd and checked against every
//! live sandbox, then best of k over the live nodes holding the template), beside a bare etcd
//! read.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::StreamExt;
use kiln_cluster::control::{Cache, ClusterService, NodeClient};
use kiln_cluster::{
    ClusterSecret, EtcdStore, NodeCapacity, NodeLease, NodeLoad, NodeTemplate, Published,
};
use kiln_server::store::{SandboxRecord, SandboxState};
use kiln_server::LifecycleConfig;

use super::stats::{percentiles, Percentiles};

/// The template every simulated node holds and every decision is for.
const BENCH_TEMPLATE: &str = "base";

/// What the placement part measured.
#[derive(Debug, Clone)]
pub(crate) struct PlaceReport {
    pub nodes: usize,
    pub sandboxes: usize,
    pub teams: usize,
    /// Writing the sandboxes' records (publications, concurrently), seconds.
    pub load_secs: f64,
    /// Loading a replica's view of them (its first read), ms.
    pub view_ms: f64,
    /// One etcd read of one key: the floor of the decision's own etcd read.
    pub etcd_get: Percentiles,
    /// The decision with a team quota (every live sandbox counted).
    pub with_quota: Percentiles,
    /// The decision with no quota (no team's sandboxes counted).
    pub without_quota: Percentiles,
}

pub(crate) struct PlaceOptions {
    pub nodes: usize,
    pub sandboxes: usize,
    pub teams: usize,
    pub decisions: usize,
}

fn team(i: usize, teams: usize) -> String {
    format!("team-{:03}", i % teams.max(1))
}

fn sandbox(i: usize, team: String) -> SandboxRecord {
    let now = kiln_server::store::now_ms();
    SandboxRecord {
        id: format!("ibench{i:06}"),
        alias: Some("base".into()),
        client_id: "bench".into(),
        state: if i % 10 == 9 {
            SandboxState::Paused
        } else {
            SandboxState::Running
        },
        metadata: [("bench".to_string(), "cluster".to_string())].into(),
        cpu_count: 2,
        disk_size_mb: 2048,
        started_at_ms: now,
        end_at_ms: now + 3_600_000,
        driver: "simulated".into(),
        team,
        ..Default::default()
    }
}

/// Registers `n` nodes with their load (uneven, as a running cluster's is).
async fn register(etcd: &EtcdStore, n: usize, per_node: usize) -> anyhow::Result<Vec<NodeLease>> {
    let mut leases = Vec::with_capacity(n);
    for i in 0..n {
        let cap = NodeCapacity {
            cpus: 64,
            memory_mb: 256 * 1024,
            disk_mb: 0,
            max_sandboxes: 0,
        };
        // Never contacted: placement only reads the registration.
        let addr = format!("127.0.0.1:{}", 10_000 + i);
        let mut lease = etcd
            .register_node_at(&format!("sim{i:02}"), &addr, cap, Duration::from_secs(30))
            .await
            .with_context(|| format!("registering simulated node {i}"))?;
        let used = (per_node as u64) * 512;
        lease.set_templates(vec![NodeTemplate {
            name: BENCH_TEMPLATE.into(),
            key: "simulated".into(),
            ..Default::default()
        }]);
        lease
            .report_load(NodeLoad {
                free_memory_mb: (256 * 1024u64).saturating_sub(used + (i as u64 % 7) * 2048),
                sandboxes: per_node as u32,
                free_cpu_milli: 64_000 - (i as u32 % 5) * 3_000,
            })
            .await?;
        leases.push(lease);
    }
    Ok(leases)
}

/// Publishes the sandboxes, each by its node under the node's lease, `parallel` at once.
async fn publish(
    etcd: &EtcdStore,
    leases: &[NodeLease],
    o: &PlaceOptions,
) -> anyhow::Result<Duration> {
    let t = Instant::now();
    let owners: Vec<(String, i64)> = leases
        .iter()
        .map(|l| (l.info().name.clone(), l.lease_id()))
        .collect();
    let mut writes = futures::stream::iter(0..o.sandboxes)
        .map(|i| {
            let (node, lease) = owners[i % owners.len()].clone();
            let rec = sandbox(i, team(i, o.teams));
            let etcd = etcd.clone();
            async move { etcd.publish_sandbox(&node, lease, &rec, None).await }
        })
        .buffer_unordered(64);
    while let Some(r) = writes.next().await {
        match r.context("publishing a simulated sandbox")? {
            Published::At(_) => {}
            other => anyhow::bail!("a simulated sandbox was not published: {other:?}"),
        }
    }
    Ok(t.elapsed())
}

fn service(
    etcd: &EtcdStore,
    cache: Arc<Cache>,
    quota: Option<u32>,
) -> anyhow::Result<ClusterService> {
    let mut cfg = LifecycleConfig::default();
    cfg.admission.team_defaults.max_sandboxes = quota;
    let secret = ClusterSecret::new("kiln-bench-cluster-secret").context("the secret")?;
    Ok(ClusterService::new(
        cfg,
        etcd.clone(),
        cache,
        NodeClient::new(secret),
    ))
}

/// Times `n` decisions of `svc` (teams in turn), after 20 not counted.
async fn decisions(svc: &ClusterService, o: &PlaceOptions) -> anyhow::Result<Vec<Duration>> {
    for i in 0..20 {
        svc.decide(&team(i, o.teams), BENCH_TEMPLATE).await?;
    }
    let mut v = Vec::with_capacity(o.decisions);
    for i in 0..o.decisions {
        let t = Instant::now();
        let (node, _) = svc.decide(&team(i, o.teams), BENCH_TEMPLATE).await?;
        v.push(t.elapsed());
        node.context("no simulated node could take a sandbox")?;
    }
    Ok(v)
}

/// Runs the placement part on the etcd at `etcd_url` under a prefix of its own.
pub(crate) async fn run(etcd_url: &str, o: &PlaceOptions) -> anyhow::Result<PlaceReport> {
    let etcd = EtcdStore::connect(&[etcd_url.to_string()], "/kiln-bench-place").await?;
    eprintln!(
        "placement: registering {} simulated nodes, publishing {} sandboxes …",
        o.nodes, o.sandboxes
    );
    let leases = register(&etcd, o.nodes, o.sandboxes / o.nodes.max(1)).await?;
    let load = publish(&etcd, &leases, o).await?;
    let t = Instant::now();
    let cache = Cache::start(etcd.clone()).await?;
    let view = t.elapsed();
    let live = cache.sandboxes().len();
    anyhow::ensure!(
        live == o.sandboxes && cache.nodes().len() == o.nodes,
        "the replica's view has {live} sandboxes and {} nodes",
        cache.nodes().len()
    );
    eprintln!(
        "placement: {} decisions with and without a team quota …",
        o.decisions
    );
    let quota = decisions(&service(&etcd, cache.clone(), Some(1_000_000))?, o).await?;
    let free = decisions(&service(&etcd, cache.clone(), None)?, o).await?;
    let mut client = etcd.client();
    let key = etcd.keys().node("sim00");
    let mut gets = Vec::with_capacity(o.decisions);
    for _ in 0..o.decisions {
        let t = Instant::now();
        client.get(key.as_str(), None).await?;
        gets.push(t.elapsed());
    }
    drop(leases);
    Ok(PlaceReport {
        nodes: o.nodes,
        sandboxes: o.sandboxes,
        teams: o.teams,
        load_secs: load.as_secs_f64(),
        view_ms: view.as_secs_f64() * 1000.0,
        etcd_get: percentiles(&gets),
        with_quota: percentiles(&quota),
        without_quota: percentiles(&free),
    })
}
