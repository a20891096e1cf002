//! [`SandboxService`]: what the API, the proxy, the console, template builds and alert
//! actions ask of sandboxes. It is the one seam between the front of the server and the
//! lifecycle: [`Manager`] implements it for one host, and a cluster's control replica
//! implements the same calls by placing on and forwarding to nodes.
//!
//! The server's own wiring (recovery, the reaper, pools, the sampler, the watcher) keeps
//! calling [`Manager`] directly; nothing in front of it names the concrete type.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use tokio::sync::broadcast;

use super::{
    CreateParams, LifecycleConfig, LifecycleEvent, Logs, Manager, MetricSample, NoRoute, PortRoute,
    Route, TemplateView,
};
use crate::error::Result;
use crate::store::{MountRecord, SandboxRecord, SnapshotRecord, VolumeRecord};
use crate::tenancy::TeamQuota;

/// The lifecycle of sandboxes as the server's front sees it. Reads are synchronous (they
/// answer from what the service holds in memory); everything that may touch a runtime, a
/// disk or the store is async.
#[async_trait::async_trait]
pub trait SandboxService: Send + Sync + 'static {
    // --- settings and limits ---

    /// The lifecycle settings (default timeout, sizes, limits).
    fn config(&self) -> &LifecycleConfig;
    /// A requested timeout (seconds) checked against the server's limits.
    fn check_timeout(&self, secs: i64) -> Result<u64>;
    /// A requested timeout checked against `team`'s quota.
    async fn check_team_timeout(&self, team: &str, secs: i64) -> Result<()>;
    /// `team`'s quotas in effect.
    async fn team_quota(&self, team: &str) -> Result<TeamQuota>;
    /// Whether `team` has room for `n` more sandboxes (429 naming the quota when not).
    async fn check_team_room(&self, team: &str, n: usize) -> Result<()>;

    // --- the sandboxes there are ---

    /// The running or paused sandbox `id`, whatever its team (routing, internal checks).
    fn get(&self, id: &str) -> Result<SandboxRecord>;
    /// The running or paused sandbox `id` if it belongs to `team` (404 otherwise).
    fn get_for(&self, id: &str, team: &str) -> Result<SandboxRecord>;
    /// `team`'s running and paused sandboxes, oldest first.
    fn list_for(&self, team: &str) -> Vec<SandboxRecord>;
    /// Every team's running and paused sandboxes, oldest first (the operator's metrics).
    fn list(&self) -> Vec<SandboxRecord>;
    /// Since when (ms) `id` is in standby, if it is.
    fn standby_since(&self, id: &str) -> Option<i64>;
    /// Sandboxes in standby.
    fn standby_count(&self) -> usize;
    /// Sandboxes hinted idle to their runtime.
    fn idle_hinted_count(&self) -> usize;
    /// Sandboxes of the previous run not adopted yet.
    fn recovering(&self) -> usize;
    /// Returns once this service can answer for sandbox `id`: at once when it knows it;
    /// after a restart, once recovery has settled it; on a cluster replica, once its view
    /// includes every change committed before the call (a sandbox made or moved through
    /// another replica a moment ago). Bounded: an unknown `id` is then a 404.
    async fn await_known(&self, id: &str);
    /// Returns once what this service reads from its own view (a sandbox's record, the list)
    /// includes every change committed before the call: at once on one host; on a cluster
    /// replica, once its view has caught up (a sandbox another replica ended a moment ago is
    /// not shown running). Bounded.
    async fn await_current(&self) {}
    /// Lifecycle events as they happen.
    fn subscribe(&self) -> broadcast::Receiver<LifecycleEvent>;

    // --- lifecycle ---

    async fn create(&self, p: CreateParams) -> Result<SandboxRecord>;
    /// Kills `id`, waiting for its teardown; false when it is not running.
    async fn kill(&self, id: &str, reason: &str) -> Result<bool>;
    /// Kills `id` and answers once it is unreachable; the teardown runs in the background.
    async fn kill_detached(self: Arc<Self>, id: &str, reason: &str) -> Result<bool>;
    /// `id` now ends `secs` from now; returns the new end (ms).
    async fn set_timeout(&self, id: &str, secs: i64) -> Result<i64>;
    /// `id` lives at least `secs` more (connect, refresh).
    async fn extend(&self, id: &str, secs: i64, why: &str) -> Result<SandboxRecord>;
    /// `id` ends now as if its timeout had passed (auto-pause honoured).
    async fn expire_now(&self, id: &str) -> Result<()>;
    async fn pause_checked(
        &self,
        id: &str,
        memory: bool,
        require_healthy_guest: bool,
    ) -> Result<()>;
    /// Resumes paused `id` with `secs` to live; false when it was already running.
    async fn resume(&self, id: &str, memory: bool, secs: i64) -> Result<bool>;
    /// Resumes paused `id`, or makes running `id` live at least `secs` more; the sandbox and
    /// whether it was resumed.
    async fn connect(&self, id: &str, secs: i64, memory: bool) -> Result<(SandboxRecord, bool)>;
    /// `count` children of `id`, one result each, in order.
    async fn fork(
        &self,
        id: &str,
        count: u32,
        timeout_secs: Option<i64>,
    ) -> Result<Vec<Result<SandboxRecord>>>;

    // --- snapshots ---

    async fn snapshot_with(
        &self,
        id: &str,
        team: &str,
        name: Option<String>,
        memory: bool,
    ) -> Result<SnapshotRecord>;
    /// A disk snapshot of `id` that ends it (killed with `reason`): the last layer of a
    /// template build. Where nothing cheaper exists, a disk snapshot and then a kill.
    async fn snapshot_ending(&self, id: &str, team: &str, reason: &str) -> Result<SnapshotRecord> {
        let snap = self.snapshot_with(id, team, None, false).await;
        self.kill(id, reason).await?;
        snap
    }
    /// The snapshot a create's `templateID` names, if it names one of `team`'s.
    async fn snapshot_for(&self, template_id: &str, team: &str) -> Result<Option<SnapshotRecord>>;
    /// The network settings recorded for creates from snapshot `snapshot_id` of `team` where
    /// it was taken, sealed by the vault, when they are kept beyond this server (a cluster's
    /// replica reads its nodes' from the cluster; one host keeps them in its own database).
    async fn snapshot_network(&self, _snapshot_id: &str, _team: &str) -> Result<Option<Vec<u8>>> {
        Ok(None)
    }
    async fn delete_snapshot(&self, key: &str, team: &str) -> Result<()>;
    async fn snapshots(
        &self,
        team: &str,
        sandbox_id: Option<&str>,
        name: Option<&str>,
    ) -> Result<Vec<SnapshotRecord>>;

    // --- network ---

    async fn network(&self, id: &str) -> Result<Option<kiln_net::EgressPolicy>>;
    async fn set_network(&self, id: &str, policy: kiln_net::EgressPolicy) -> Result<()>;
    /// Whether `network.rules` and `egressProxy` are applied where the sandbox runs rather
    /// than here (a cluster's replica: its nodes hold the interception CA and the sandboxes'
    /// sealed settings). Then the API checks them, hands them on as given
    /// ([`CreateParams::network_settings`], [`SandboxService::set_network_settings`]) and
    /// attaches nothing to the policy itself.
    fn forwards_network_settings(&self) -> bool {
        false
    }
    /// Sandbox `id`'s egress policy and, when they are applied where it runs
    /// ([`SandboxService::forwards_network_settings`]), its `rules` and `egressProxy` as the
    /// API shows them (`{"rules": …, "egressProxy": …}`; one host's are in the policy).
    async fn network_shown(
        &self,
        id: &str,
    ) -> Result<(Option<kiln_net::EgressPolicy>, Option<serde_json::Value>)> {
        Ok((self.network(id).await?, None))
    }
    /// Replaces sandbox `id`'s egress policy with `policy`, its `rules` and `egressProxy`
    /// given as the client gave them in `settings` (see
    /// [`SandboxService::forwards_network_settings`]; a lifecycle that does not forward them
    /// finds them in `policy`).
    async fn set_network_settings(
        &self,
        id: &str,
        policy: kiln_net::EgressPolicy,
        _settings: Option<serde_json::Value>,
    ) -> Result<()> {
        self.set_network(id, policy).await
    }
    /// CA certificates (PEM) every sandbox trusts besides its template's roots.
    fn extra_cas(&self) -> &[String];
    /// How many sandboxes that serve no request yet (a warm pool's, a standing build
    /// sandbox) may start now: what `--max-sandboxes` and the host's headroom leave.
    fn spare_room(&self) -> usize;

    // --- volumes ---

    async fn create_volume(&self, team: &str, name: &str) -> Result<VolumeRecord>;
    async fn volume(&self, team: &str, key: &str) -> Result<VolumeRecord>;
    async fn volume_by_token(&self, id: &str, token: &str) -> Result<Option<VolumeRecord>>;
    async fn list_volumes(&self, team: Option<&str>) -> Result<Vec<VolumeRecord>>;
    async fn delete_volume(&self, team: &str, key: &str) -> Result<()>;
    /// Where volume `id`'s files live on this host (never shown to a client).
    async fn volume_root(&self, id: &str) -> Result<PathBuf>;
    /// The volume mounts a create asks for, checked against `team`'s volumes.
    async fn resolve_mounts(
        &self,
        team: &str,
        asked: &[(String, String)],
    ) -> Result<Vec<MountRecord>>;
    async fn mounts_of(&self, id: &str) -> Result<Vec<MountRecord>>;

    // --- what can be seen of them ---

    async fn templates(&self) -> Result<Vec<TemplateView>>;
    async fn template(&self, name: &str) -> Result<TemplateView>;
    async fn logs(&self, id: &str, team: &str) -> Result<Logs>;
    async fn latest_metrics(&self, ids: &[String]) -> BTreeMap<String, MetricSample>;
    async fn metrics_window(
        &self,
        id: &str,
        start_ms: Option<i64>,
        end_ms: Option<i64>,
    ) -> Result<Vec<MetricSample>>;
    /// The newest sample of every running sandbox.
    fn latest_samples(&self) -> Vec<(String, MetricSample)>;
    /// Free bytes where sandboxes' state lives, as last sampled.
    fn state_disk_free(&self) -> Option<u64>;

    // --- reaching them ---

    /// Where traffic for running `id` goes (None when it is not running).
    fn route(&self, id: &str) -> Option<Route>;

    /// Everything a proxied request to `port` of `id` needs, in one call (waking or resuming
    /// the sandbox first when it must).
    async fn open_route(&self, id: &str, port: u16) -> std::result::Result<PortRoute, NoRoute>;
    /// A client for `id`'s agent carrying its access token.
    fn agent(&self, id: &str, token: Option<String>) -> kiln_envd::EnvdClient;
}

#[async_trait::async_trait]
impl SandboxService for Manager {
    fn config(&self) -> &LifecycleConfig {
        Manager::config(self)
    }
    fn check_timeout(&self, secs: i64) -> Result<u64> {
        Manager::check_timeout(self, secs)
    }
    async fn check_team_timeout(&self, team: &str, secs: i64) -> Result<()> {
        Manager::check_team_timeout(self, team, secs).await
    }
    async fn team_quota(&self, team: &str) -> Result<TeamQuota> {
        Manager::team_quota(self, team).await
    }
    async fn check_team_room(&self, team: &str, n: usize) -> Result<()> {
        Manager::check_team_room(self, team, n).await
    }

    fn get(&self, id: &str) -> Result<SandboxRecord> {
        Manager::get(self, id)
    }
    fn get_for(&self, id: &str, team: &str) -> Result<SandboxRecord> {
        Manager::get_for(self, id, team)
    }
    fn list_for(&self, team: &str) -> Vec<SandboxRecord> {
        Manager::list_for(self, team)
    }
    fn list(&self) -> Vec<SandboxRecord> {
        Manager::list(self)
    }
    fn standby_since(&self, id: &str) -> Option<i64> {
        Manager::standby_since(self, id)
    }
    fn standby_count(&self) -> usize {
        Manager::standby_count(self)
    }
    fn idle_hinted_count(&self) -> usize {
        Manager::idle_hinted_count(self)
    }
    fn recovering(&self) -> usize {
        Manager::recovering(self)
    }
    async fn await_known(&self, id: &str) {
        Manager::wait_adopted(self, id).await
    }
    fn subscribe(&self) -> broadcast::Receiver<LifecycleEvent> {
        Manager::subscribe(self)
    }

    async fn create(&self, p: CreateParams) -> Result<SandboxRecord> {
        Manager::create(self, p).await
    }
    async fn kill(&self, id: &str, reason: &str) -> Result<bool> {
        Manager::kill(self, id, reason).await
    }
    async fn kill_detached(self: Arc<Self>, id: &str, reason: &str) -> Result<bool> {
        Manager::kill_detached(&self, id, reason).await
    }
    async fn set_timeout(&self, id: &str, secs: i64) -> Result<i64> {
        Manager::set_timeout(self, id, secs).await
    }
    async fn extend(&self, id: &str, secs: i64, why: &str) -> Result<SandboxRecord> {
        Manager::extend(self, id, secs, why).await
    }
    async fn expire_now(&self, id: &str) -> Result<()> {
        Manager::expire_now(self, id).await
    }
    async fn pause_checked(
        &self,
        id: &str,
        memory: bool,
        require_healthy_guest: bool,
    ) -> Result<()> {
        Manager::pause_checked(self, id, memory, require_healthy_guest).await
    }
    async fn resume(&self, id: &str, memory: bool, secs: i64) -> Result<bool> {
        Manager::resume(self, id, memory, secs).await
    }
    async fn connect(&self, id: &str, secs: i64, memory: bool) -> Result<(SandboxRecord, bool)> {
        Manager::connect(self, id, secs, memory).await
    }
    async fn fork(
        &self,
        id: &str,
        count: u32,
        timeout_secs: Option<i64>,
    ) -> Result<Vec<Result<SandboxRecord>>> {
        Manager::fork(self, id, count, timeout_secs).await
    }

    async fn snapshot_with(
        &self,
        id: &str,
        team: &str,
        name: Option<String>,
        memory: bool,
    ) -> Result<SnapshotRecord> {
        Manager::snapshot_with(self, id, team, name, memory).await
    }
    async fn snapshot_ending(&self, id: &str, team: &str, reason: &str) -> Result<SnapshotRecord> {
        Manager::snapshot_ending(self, id, team, reason).await
    }
    async fn snapshot_for(&self, template_id: &str, team: &str) -> Result<Option<SnapshotRecord>> {
        Manager::snapshot_for(self, template_id, team).await
    }
    async fn delete_snapshot(&self, key: &str, team: &str) -> Result<()> {
        Manager::delete_snapshot(self, key, team).await
    }
    async fn snapshots(
        &self,
        team: &str,
        sandbox_id: Option<&str>,
        name: Option<&str>,
    ) -> Result<Vec<SnapshotRecord>> {
        Manager::snapshots(self, team, sandbox_id, name).await
    }

    async fn network(&self, id: &str) -> Result<Option<kiln_net::EgressPolicy>> {
        Manager::network(self, id).await
    }
    async fn set_network(&self, id: &str, policy: kiln_net::EgressPolicy) -> Result<()> {
        Manager::set_network(self, id, policy).await
    }
    fn extra_cas(&self) -> &[String] {
        Manager::extra_cas(self)
    }
    fn spare_room(&self) -> usize {
        Manager::spare_room(self)
    }

    async fn create_volume(&self, team: &str, name: &str) -> Result<VolumeRecord> {
        Manager::create_volume(self, team, name).await
    }
    async fn volume(&self, team: &str, key: &str) -> Result<VolumeRecord> {
        Manager::volume(self, team, key).await
    }
    async fn volume_by_token(&self, id: &str, token: &str) -> Result<Option<VolumeRecord>> {
        Manager::volume_by_token(self, id, token).await
    }
    async fn list_volumes(&self, team: Option<&str>) -> Result<Vec<VolumeRecord>> {
        Manager::list_volumes(self, team).await
    }
    async fn delete_volume(&self, team: &str, key: &str) -> Result<()> {
        Manager::delete_volume(self, team, key).await
    }
    async fn volume_root(&self, id: &str) -> Result<PathBuf> {
        Manager::volume_root(self, id).await
    }
    async fn resolve_mounts(
        &self,
        team: &str,
        asked: &[(String, String)],
    ) -> Result<Vec<MountRecord>> {
        Manager::resolve_mounts(self, team, asked).await
    }
    async fn mounts_of(&self, id: &str) -> Result<Vec<MountRecord>> {
        Manager::mounts_of(self, id).await
    }

    async fn templates(&self) -> Result<Vec<TemplateView>> {
        Manager::templates(self).await
    }
    async fn template(&self, name: &str) -> Result<TemplateView> {
        Manager::template(self, name).await
    }
    async fn logs(&self, id: &str, team: &str) -> Result<Logs> {
        Manager::logs(self, id, team).await
    }
    async fn latest_metrics(&self, ids: &[String]) -> BTreeMap<String, MetricSample> {
        Manager::latest_metrics(self, ids).await
    }
    async fn metrics_window(
        &self,
        id: &str,
        start_ms: Option<i64>,
        end_ms: Option<i64>,
    ) -> Result<Vec<MetricSample>> {
        Manager::metrics_window(self, id, start_ms, end_ms).await
    }
    fn latest_samples(&self) -> Vec<(String, MetricSample)> {
        Manager::latest_samples(self)
    }
    fn state_disk_free(&self) -> Option<u64> {
        Manager::state_disk_free(self)
    }

    fn route(&self, id: &str) -> Option<Route> {
        Manager::route(self, id)
    }
    async fn open_route(&self, id: &str, port: u16) -> std::result::Result<PortRoute, NoRoute> {
        Manager::open_route(self, id, port).await
    }
    fn agent(&self, id: &str, token: Option<String>) -> kiln_envd::EnvdClient {
        Manager::agent(self, id, token)
    }
}
