//! [`ClusterService`]: the server's `SandboxService` on a cluster. Creates are placed on a
//! live node ([`super::placement`]) once they hold one of the team's seats
//! ([`crate::seats`]: its quota counted over every live sandbox of the cluster and every
//! create under way, by any replica); every later call goes to the node that owns the
//! sandbox (the owner recorded in etcd), and traffic to a sandbox's ports goes through a
//! tunnel to that node. Synchronous reads answer from the replica's [`Cache`]. A paused
//! sandbox whose node is lost or draining resumes on another node ([`super::moves`]). A
//! sandbox's metrics come from its node. Snapshots stay on the node that took them
//! ([`super::snapshots`]). A create goes to a node that holds its template
//! ([`super::templates`]); volumes are kept by a node ([`super::volumes`]). A request naming
//! a sandbox this replica's view lacks, or reading the view, first catches the view up.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kiln_server::manager::{
    CreateParams, InUse, LifecycleEvent, Logs, MetricSample, NoRoute, PortRoute, Route,
    TemplateView,
};
use kiln_server::store::{
    AccessStore, MountRecord, SandboxRecord, SandboxState, SnapshotRecord, VolumeRecord,
};
use kiln_server::tenancy::TeamQuota;
use kiln_server::{Error, LifecycleConfig, SandboxService};
use tokio::sync::broadcast;

use super::cache::Cache;
use super::client::{NodeClient, TunnelConnector};
use super::placement;
use crate::nodes::NodeInfo;
use crate::seats::{Seat, Taken, SEAT_TTL};
use crate::store::EtcdStore;
use crate::wire::{not_in_cluster, CreateDoc, NetworkDoc, Op, OpAnswer};

type Result<T, E = Error> = std::result::Result<T, E>;

/// How long a replica waits for its view to include what a node just published.
pub(super) const VIEW_WAIT: Duration = Duration::from_secs(3);

/// The lifecycle of a cluster's sandboxes, as one control replica serves it.
pub struct ClusterService {
    pub(super) cfg: LifecycleConfig,
    pub(super) etcd: EtcdStore,
    pub(super) cache: Arc<Cache>,
    pub(super) nodes: NodeClient,
    /// Where the proxy records the envd operations it forwards (the owning node's chain).
    audit: kiln_server::audit::AuditLog,
}

impl ClusterService {
    pub fn new(
        cfg: LifecycleConfig,
        etcd: EtcdStore,
        cache: Arc<Cache>,
        nodes: NodeClient,
    ) -> Self {
        Self {
            cfg,
            etcd,
            cache,
            nodes,
            audit: kiln_server::audit::AuditLog::disabled(),
        }
    }

    /// The service with `audit` recording what its proxy forwards.
    pub fn with_audit(mut self, audit: kiln_server::audit::AuditLog) -> Self {
        self.audit = audit;
        self
    }

    /// The live nodes not draining, each counted with the live sandboxes this replica sees
    /// on it.
    pub(super) fn candidates(&self) -> Vec<NodeInfo> {
        let mut nodes = self.cache.nodes();
        nodes.retain(|n| !self.cache.is_draining(&n.name));
        let counts = self.cache.counts_by_node();
        for n in &mut nodes {
            let seen = counts.get(&n.name).copied().unwrap_or(0) as u32;
            n.load.sandboxes = n.load.sandboxes.max(seen);
        }
        nodes
    }

    /// The placement decision of a create of `template` for `team`, as
    /// [`SandboxService::create`] makes it: the team's quota checked against every live
    /// sandbox of the cluster, then the best of [`placement::DEFAULT_K`] sampled candidates
    /// among the nodes that hold the template. Returns the node chosen (None: no node can take
    /// one) and the candidates, among which a retry picks again.
    pub async fn decide(
        &self,
        team: &str,
        template: &str,
    ) -> Result<(Option<NodeInfo>, Vec<NodeInfo>)> {
        self.check_team_room(team, 1).await?;
        let nodes = self.holding(self.candidates(), template).await?;
        Ok((self.pick(&nodes), nodes))
    }

    /// Sends create `doc` to `node` (another of `nodes` when it cannot be reached), or, with
    /// an idempotency key, to where the key's first attempt went.
    pub(super) async fn place(
        &self,
        doc: CreateDoc,
        mut node: Option<NodeInfo>,
        mut nodes: Vec<NodeInfo>,
    ) -> Result<SandboxRecord> {
        if let Some(token) = &doc.idempotency {
            // A create with a key goes where the key's first attempt went (that node runs
            // one create per key), unless that node is gone.
            let live = self.cache.nodes();
            let placed = self
                .etcd
                .placement(token, node.as_ref().map(|n| n.name.as_str()), |name| {
                    live.iter().any(|n| n.name == name)
                })
                .await?;
            node = placed.and_then(|name| live.into_iter().find(|n| n.name == name));
            // Another node would make a second sandbox for the key: no retry elsewhere.
            nodes.clear();
        }
        // A node that cannot be reached is left for the next; any other answer is final.
        for _ in 0..3 {
            let Some(at) = node.take() else {
                break;
            };
            match self.nodes.create(&at.address, &doc).await {
                Ok((rec, revision)) => {
                    self.cache.wait_for(revision, VIEW_WAIT).await;
                    return Ok(rec);
                }
                Err(Error::Unavailable(m)) => {
                    tracing::warn!(node = %at.name, error = %m, "placing on another node");
                    nodes.retain(|n| n.name != at.name);
                    node = self.pick(&nodes);
                }
                Err(e) => return Err(e),
            }
        }
        Err(Error::Capacity {
            limit: "no node of the cluster can take a sandbox now".into(),
            retry_after_secs: 5,
            quota: false,
        })
    }

    /// A seat for a create of `team` when the team has a sandbox quota ([`crate::seats`]).
    async fn take_seat(&self, team: &str) -> Result<Option<Box<Seat>>> {
        let Some(max) = self.team_quota(team).await?.max_sandboxes else {
            return Ok(None);
        };
        let view = |rev| self.view_for_team(team, rev);
        match self
            .etcd
            .take_seat(team, max as usize, SEAT_TTL, view)
            .await
        {
            Ok(Taken::Seat(seat)) => Ok(Some(seat)),
            Ok(Taken::Full { live, seats }) => Err(quota_full(team, max, live, seats, 1)),
            Ok(Taken::ViewBehind(rev)) => Err(view_behind(rev)),
            Err(e) => Err(e.into()),
        }
    }

    /// The team's live sandboxes in this replica's view once it has reached `rev` (None
    /// when it does not within [`VIEW_WAIT`]).
    async fn view_for_team(&self, team: &str, rev: i64) -> Option<usize> {
        self.cache
            .wait_for(rev, VIEW_WAIT)
            .await
            .then(|| self.cache.count_for_team(team))
    }

    pub(super) fn pick(&self, nodes: &[NodeInfo]) -> Option<NodeInfo> {
        let memory = u64::from(self.cfg.default_memory_mb);
        placement::place(nodes, memory, placement::DEFAULT_K, placement::random_index).cloned()
    }

    /// The node that runs `id`.
    pub(super) fn owner(&self, id: &str) -> Result<NodeInfo> {
        if let Some(n) = self.cache.owner(id) {
            return Ok(n);
        }
        match self.away(id) {
            Some(why) => Err(Error::Unavailable(why)),
            None => Err(Error::SandboxNotFound(id.to_string())),
        }
    }

    /// Why live sandbox `id` is out of reach when no live node runs it (None: not live).
    fn away(&self, id: &str) -> Option<String> {
        self.cache.sandbox(id)?;
        let node = self.cache.owner_name(id).unwrap_or_default();
        Some(if self.cache.restarting(&node) {
            format!("node {node}, which runs sandbox \"{id}\", is restarting; retry")
        } else {
            format!("the node that runs sandbox \"{id}\" is not in the cluster now; retry")
        })
    }

    /// `op` on `id` at its node; returns once this replica's view includes its effect.
    pub(super) async fn call(&self, id: &str, op: Op) -> Result<OpAnswer> {
        let node = self.owner(id)?;
        let a = self.nodes.op(&node.address, id, &op).await?;
        self.cache.wait_for(a.revision, VIEW_WAIT).await;
        Ok(a)
    }

    fn tunnel(&self, id: &str, port: u16) -> kiln_envd::EnvdClient {
        let addr = self.cache.owner(id).map(|n| n.address).unwrap_or_default();
        kiln_envd::EnvdClient::new(Arc::new(TunnelConnector {
            addr,
            id: id.to_string(),
            port,
            secret: self.nodes.secret().clone(),
        }))
    }
}

fn visible(r: SandboxRecord) -> Option<SandboxRecord> {
    matches!(r.state, SandboxState::Running | SandboxState::Paused).then_some(r)
}

fn route_of(r: &SandboxRecord) -> Route {
    Route {
        sandbox_id: r.id.clone(),
        envd_token: r.envd_token.clone(),
        ingress: r.ingress.clone(),
    }
}

fn sandbox_of(a: OpAnswer, id: &str) -> Result<SandboxRecord> {
    a.sandbox
        .map(SandboxRecord::from)
        .ok_or_else(|| Error::SandboxNotFound(id.to_string()))
}

/// The 429 of a team at its sandbox quota: `live` sandboxes and `seats` creates under way.
fn quota_full(team: &str, max: u32, live: usize, seats: usize, n: usize) -> Error {
    let under_way = match seats {
        0 => String::new(),
        s => format!(", {s} being created"),
    };
    Error::Capacity {
        limit: format!(
            "team \"{team}\"'s sandbox quota ({max} at once in the cluster; {live} running or \
             paused{under_way}, {n} more asked for)"
        ),
        retry_after_secs: 5,
        quota: true,
    }
}

fn view_behind(rev: i64) -> Error {
    Error::Unavailable(format!(
        "this replica's view of the cluster has not reached revision {rev} within {}s; retry",
        VIEW_WAIT.as_secs()
    ))
}

#[async_trait::async_trait]
impl SandboxService for ClusterService {
    fn config(&self) -> &LifecycleConfig {
        &self.cfg
    }
    fn check_timeout(&self, secs: i64) -> Result<u64> {
        kiln_server::manager::timeout_within(&self.cfg, secs)
    }
    async fn check_team_timeout(&self, team: &str, secs: i64) -> Result<()> {
        if let Some(max) = self.team_quota(team).await?.max_timeout_secs {
            if secs > 0 && secs as u64 > max {
                return Err(Error::bad_request(format!(
                    "timeout {secs}s is above team \"{team}\"'s maximum of {max}s"
                )));
            }
        }
        Ok(())
    }
    async fn team_quota(&self, team: &str) -> Result<TeamQuota> {
        let own = self.etcd.get_team(team).await?;
        Ok(self.cfg.admission.team_defaults.for_team(own.as_ref()))
    }
    async fn check_team_room(&self, team: &str, n: usize) -> Result<()> {
        if let Some(max) = self.team_quota(team).await?.max_sandboxes {
            let (seats, rev) = self.etcd.seats(team).await?;
            let live = self
                .view_for_team(team, rev)
                .await
                .ok_or_else(|| view_behind(rev))?;
            if live + seats + n > max as usize {
                return Err(quota_full(team, max, live, seats, n));
            }
        }
        Ok(())
    }

    fn get(&self, id: &str) -> Result<SandboxRecord> {
        self.cache
            .sandbox(id)
            .and_then(visible)
            .ok_or_else(|| Error::SandboxNotFound(id.to_string()))
    }
    fn get_for(&self, id: &str, team: &str) -> Result<SandboxRecord> {
        self.get(id)
            .ok()
            .filter(|r| r.team == team)
            .ok_or_else(|| Error::SandboxNotFound(id.to_string()))
    }
    fn list_for(&self, team: &str) -> Vec<SandboxRecord> {
        self.list().into_iter().filter(|r| r.team == team).collect()
    }
    fn list(&self) -> Vec<SandboxRecord> {
        self.cache
            .sandboxes()
            .into_iter()
            .filter_map(visible)
            .collect()
    }
    fn standby_since(&self, _id: &str) -> Option<i64> {
        None
    }
    fn standby_count(&self) -> usize {
        0
    }
    fn idle_hinted_count(&self) -> usize {
        0
    }
    fn recovering(&self) -> usize {
        0
    }
    async fn await_known(&self, id: &str) {
        if self.cache.sandbox(id).is_none() {
            // Made or moved through another replica a moment ago, its record may not have
            // reached this replica's watch yet.
            self.cache.catch_up(&self.etcd, VIEW_WAIT).await;
        }
    }
    async fn await_current(&self) {
        self.cache.catch_up(&self.etcd, VIEW_WAIT).await;
    }
    fn subscribe(&self) -> broadcast::Receiver<LifecycleEvent> {
        self.cache.subscribe()
    }

    async fn create(&self, p: CreateParams) -> Result<SandboxRecord> {
        let mut doc = CreateDoc::of(&p)?;
        // A snapshot is restored on the node that keeps it, or borrowed by any; volumes are
        // mounted on the node that keeps them.
        let mut home = match self.snapshot_home(&mut doc, p.team()).await? {
            Some(home) => Some(home),
            None => self.mounts_home(&p.volume_mounts).await?,
        };
        // A template the team built runs on the build node, from its last layer (it shadows
        // a kiln template of the same name, as on one host).
        if home.is_none() && doc.snapshot.is_none() {
            if let Some(node) = self.built_home(p.team(), &doc.template_id).await? {
                doc.built = true;
                home = Some(node);
            }
        }
        // Held until the create ends: by then its sandbox is in this replica's view.
        let _seat = self.take_seat(p.team()).await?;
        let (node, nodes) = match home {
            Some(home) => (Some(home), Vec::new()),
            // A snapshot borrowed from object storage: a node that can run its template.
            None if doc.snapshot.is_some() => {
                let nodes = self.snapshot_borrowers(&doc, p.team()).await?;
                (self.pick(&nodes), nodes)
            }
            None => {
                let mut nodes = self.holding(self.candidates(), &doc.template_id).await?;
                let mut node = self.pick(&nodes);
                if node.is_none() {
                    nodes = self.fetchers(&doc.template_id).await;
                    node = self.pick(&nodes);
                }
                (node, nodes)
            }
        };
        self.place(doc, node, nodes).await
    }
    async fn kill(&self, id: &str, reason: &str) -> Result<bool> {
        let reason = reason.to_string();
        Ok(self.call(id, Op::Kill { reason }).await?.flag)
    }
    async fn kill_detached(self: Arc<Self>, id: &str, reason: &str) -> Result<bool> {
        let reason = reason.to_string();
        Ok(self.call(id, Op::KillDetached { reason }).await?.flag)
    }
    async fn set_timeout(&self, id: &str, secs: i64) -> Result<i64> {
        Ok(self.call(id, Op::SetTimeout { secs }).await?.end_at_ms)
    }
    async fn extend(&self, id: &str, secs: i64, why: &str) -> Result<SandboxRecord> {
        let why = why.to_string();
        sandbox_of(self.call(id, Op::Extend { secs, why }).await?, id)
    }
    async fn expire_now(&self, id: &str) -> Result<()> {
        self.call(id, Op::ExpireNow).await.map(drop)
    }
    async fn pause_checked(
        &self,
        id: &str,
        memory: bool,
        require_healthy_guest: bool,
    ) -> Result<()> {
        let op = Op::Pause {
            memory,
            require_healthy_guest,
        };
        self.call(id, op).await.map(drop)
    }
    async fn resume(&self, id: &str, memory: bool, secs: i64) -> Result<bool> {
        Ok(self.resume_op(id, memory, secs, false).await?.flag)
    }
    async fn connect(&self, id: &str, secs: i64, memory: bool) -> Result<(SandboxRecord, bool)> {
        let a = self.resume_op(id, memory, secs, true).await?;
        let flag = a.flag;
        Ok((sandbox_of(a, id)?, flag))
    }
    async fn fork(
        &self,
        id: &str,
        count: u32,
        timeout_secs: Option<i64>,
    ) -> Result<Vec<Result<SandboxRecord>>> {
        self.fork_spread(id, count, timeout_secs).await
    }

    async fn snapshot_with(
        &self,
        id: &str,
        team: &str,
        name: Option<String>,
        memory: bool,
    ) -> Result<SnapshotRecord> {
        self.take_snapshot(id, team, name, memory).await
    }
    async fn snapshot_for(&self, template_id: &str, team: &str) -> Result<Option<SnapshotRecord>> {
        Ok(self.located(template_id, team).await?.map(|l| l.snapshot))
    }
    async fn snapshot_network(&self, snapshot_id: &str, team: &str) -> Result<Option<Vec<u8>>> {
        use base64::Engine;
        let Some(sealed) = self
            .located(snapshot_id, team)
            .await?
            .and_then(|l| l.network)
        else {
            return Ok(None);
        };
        crate::docs::b64()
            .decode(sealed)
            .map(Some)
            .map_err(|e| Error::internal(format!("a snapshot's network settings: {e}")))
    }
    async fn delete_snapshot(&self, key: &str, team: &str) -> Result<()> {
        self.drop_snapshot(key, team).await
    }
    async fn snapshots(
        &self,
        team: &str,
        sandbox_id: Option<&str>,
        name: Option<&str>,
    ) -> Result<Vec<SnapshotRecord>> {
        self.team_snapshots(team, sandbox_id, name).await
    }

    async fn network(&self, id: &str) -> Result<Option<kiln_net::EgressPolicy>> {
        Ok(self.node_network(id).await?.0)
    }
    async fn network_shown(
        &self,
        id: &str,
    ) -> Result<(Option<kiln_net::EgressPolicy>, Option<serde_json::Value>)> {
        self.node_network(id).await
    }
    async fn set_network(&self, id: &str, policy: kiln_net::EgressPolicy) -> Result<()> {
        self.set_network_settings(id, policy, None).await
    }
    fn forwards_network_settings(&self) -> bool {
        true
    }
    async fn set_network_settings(
        &self,
        id: &str,
        policy: kiln_net::EgressPolicy,
        settings: Option<serde_json::Value>,
    ) -> Result<()> {
        let network = NetworkDoc::of(&policy, settings.as_ref())?;
        self.call(id, Op::SetNetwork { network, settings })
            .await
            .map(drop)
    }
    fn extra_cas(&self) -> &[String] {
        &[]
    }
    fn spare_room(&self) -> usize {
        // A control replica starts no sandbox ahead of a request.
        0
    }

    async fn create_volume(&self, team: &str, name: &str) -> Result<VolumeRecord> {
        self.cluster_create_volume(team, name).await
    }
    async fn volume(&self, team: &str, key: &str) -> Result<VolumeRecord> {
        self.cluster_volume(team, key).await
    }
    async fn volume_by_token(&self, id: &str, token: &str) -> Result<Option<VolumeRecord>> {
        self.cluster_volume_by_token(id, token).await
    }
    async fn list_volumes(&self, team: Option<&str>) -> Result<Vec<VolumeRecord>> {
        self.cluster_list_volumes(team).await
    }
    async fn delete_volume(&self, team: &str, key: &str) -> Result<()> {
        self.cluster_delete_volume(team, key).await
    }
    async fn volume_root(&self, _id: &str) -> Result<PathBuf> {
        // A replica keeps no volume's files: their content API goes to their node.
        Err(not_in_cluster("a volume's files on a control replica"))
    }
    async fn resolve_mounts(
        &self,
        team: &str,
        asked: &[(String, String)],
    ) -> Result<Vec<MountRecord>> {
        self.cluster_resolve_mounts(team, asked).await
    }
    async fn mounts_of(&self, id: &str) -> Result<Vec<MountRecord>> {
        self.node_mounts(id).await
    }

    async fn templates(&self) -> Result<Vec<TemplateView>> {
        self.cluster_templates().await
    }
    async fn template(&self, name: &str) -> Result<TemplateView> {
        self.cluster_template(name).await
    }
    async fn logs(&self, id: &str, team: &str) -> Result<Logs> {
        self.node_logs(id, team).await
    }
    async fn latest_metrics(&self, ids: &[String]) -> BTreeMap<String, MetricSample> {
        self.node_latest_metrics(ids).await
    }
    async fn metrics_window(
        &self,
        id: &str,
        start_ms: Option<i64>,
        end_ms: Option<i64>,
    ) -> Result<Vec<MetricSample>> {
        self.node_metrics_window(id, start_ms, end_ms).await
    }
    fn latest_samples(&self) -> Vec<(String, MetricSample)> {
        Vec::new()
    }
    fn state_disk_free(&self) -> Option<u64> {
        None
    }

    fn route(&self, id: &str) -> Option<Route> {
        self.cache
            .sandbox(id)
            .filter(|r| r.state == SandboxState::Running)
            .map(|r| route_of(&r))
    }
    async fn open_route(&self, id: &str, port: u16) -> std::result::Result<PortRoute, NoRoute> {
        self.await_known(id).await;
        let rec = self.get(id).map_err(|_| NoRoute::NotFound)?;
        if rec.state == SandboxState::Paused && !rec.auto_resume {
            return Err(NoRoute::Paused);
        }
        if rec.state == SandboxState::Paused && self.moves_on_resume(id) {
            // Its node is lost or draining: resumed on another node first.
            let secs = self.cfg.default_timeout_secs as i64;
            if let Err(e) = self.resume_op(id, true, secs, true).await {
                tracing::warn!(sandbox = id, error = %e, "auto-resuming on traffic");
                return Err(NoRoute::Paused);
            }
        }
        if self.cache.owner(id).is_none() {
            return Err(self
                .away(id)
                .map_or(NoRoute::NotFound, NoRoute::Unavailable));
        }
        // A paused sandbox with autoResume is resumed by its node when the tunnel opens.
        Ok(PortRoute {
            route: route_of(&rec),
            client: self.tunnel(id, port),
            in_use: InUse::untracked(),
            audit: self.audit.clone(),
        })
    }
    fn agent(&self, id: &str, token: Option<String>) -> kiln_envd::EnvdClient {
        self.tunnel(id, kiln_proto::envd::ENVD_PORT)
            .with_access_token(token)
    }
}
