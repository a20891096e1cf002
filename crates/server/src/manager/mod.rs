//! Sandbox lifecycle on one host. The server's front (API, proxy, console, template builds)
//! reaches it only through the [`SandboxService`] trait (`service.rs`), which [`Manager`]
//! implements; the server's own wiring (recovery, reaper, pools, sampler, watcher, alerts)
//! calls the Manager directly.
//!
//! The Manager owns its services: the [`registry::Registry`] of running sandboxes, admission
//! (`admission.rs`: caps, team quotas, host capacity, create rate, boot permits), the warm
//! pools (`pool.rs`), the idle table (`idle.rs`), the metrics history (`sampler.rs`) and the
//! outlets (`outlets.rs`: lifecycle events, the audit log, counters, webhooks).
//!
//! - [`create`](Manager::create) in `create.rs` (validation, admission, template lookup, the
//!   warm-pool claim, driver create/start, agent init, the template's start command in
//!   `start_cmd.rs` and its ready command in `ready.rs`); every create — fresh, pooled, from a
//!   snapshot, a fork's child — passes the one pipeline in `provision.rs`;
//! - timeouts, kill and the reaper here and in `reaper.rs`; runtimes that die on their own in
//!   `watcher.rs`;
//! - [`recover`](Manager::recover) after a restart in `recovery.rs`;
//! - metrics, logs and template views in `observe.rs`;
//! - pause/resume (and auto-pause/resume) in `lifecycle.rs`, snapshots in `snapshots.rs`,
//!   fork in `fork.rs`, warm pools in `pool.rs`;
//! - standby of idle sandboxes (checkpointed to disk, woken by traffic) in `standby.rs`, their
//!   idle bookkeeping in `idle.rs`.
//!
//! - what the proxy gets for each request (one call, [`SandboxService::open_route`]) in
//!   `route.rs`.
//!
//! The store is the authority on sandboxes and their end times; [`registry::Registry`] caches
//! the running ones for routing.

mod admission;
mod create;
mod fork;
mod idle;
mod idle_tick;
pub mod kills;
mod lifecycle;
mod moves;
mod network;
mod observe;
mod outlets;
mod pool;
mod pool_demand;
mod provision;
mod ready;
mod reaper;
mod recovery;
mod registry;
mod route;
mod sampler;
mod service;
mod snapshots;
mod standby;
mod start_cmd;
mod teardown;
pub mod volumes;
mod watcher;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use tokio::sync::broadcast;

use crate::driver::{self, Driver};
use crate::error::{Error, Result};
use crate::store::{now_ms, SandboxRecord, SandboxState, StateStore};
use crate::templates::Templates;

pub use admission::AdmissionConfig;
pub use fork::{check_fork_count, MAX_FORK};
pub use idle::InUse;
pub use idle_tick::TickReport;
pub use network::trust_init;
pub use observe::{Logs, MetricSample, TemplateView};
pub use pool::parse_pool;
pub use pool_demand::PoolPolicy;
pub use recovery::{PendingRecovery, RecoveryReport, ADOPT_CONCURRENCY, ADOPT_WAIT};
pub use route::{NoRoute, PortRoute, Route};
pub use service::SandboxService;
pub use snapshots::{check_snapshot_name, is_snapshot_id, snapshot_key, tagged};
pub use standby::{census, parse_standby_after, Census, STANDBY_META};
pub use start_cmd::START_CMD_EVENT;
pub use watcher::{DIED_REASON, WATCH_INTERVAL};

/// Metadata key marking a template build's sandbox (its value: the build id): hidden from
/// lists, outside the team's quota, never in standby.
pub const BUILD_META: &str = "kiln.template.build";

/// Whether a sandbox's metadata marks it as a template build's sandbox.
pub fn is_build_sandbox(metadata: &std::collections::BTreeMap<String, String>) -> bool {
    metadata.contains_key(BUILD_META)
}

/// Largest timeout the API accepts (E2B's timeout is an int32 of seconds).
pub const MAX_TIMEOUT_SECS: u64 = i32::MAX as u64;

/// A requested timeout (seconds) checked against `cfg`'s limits (400 naming them).
pub fn timeout_within(cfg: &LifecycleConfig, secs: i64) -> Result<u64> {
    if secs <= 0 {
        return Err(Error::bad_request(format!(
            "timeout must be a positive number of seconds, got {secs}"
        )));
    }
    let max = cfg
        .max_timeout_secs
        .unwrap_or(MAX_TIMEOUT_SECS)
        .min(MAX_TIMEOUT_SECS);
    if secs as u64 > max {
        return Err(Error::bad_request(format!(
            "timeout {secs}s is above the maximum of {max}s"
        )));
    }
    Ok(secs as u64)
}

/// Lifecycle settings.
#[derive(Debug, Clone)]
pub struct LifecycleConfig {
    /// Timeout when the create request names none (E2B: 300 s).
    pub default_timeout_secs: u64,
    /// Optional hard cap on any timeout.
    pub max_timeout_secs: Option<u64>,
    pub default_cpu_count: u32,
    pub default_memory_mb: u32,
    pub default_disk_mb: u32,
    pub pids_limit: u32,
    /// How long a new sandbox's agent may take to answer `/health`.
    pub agent_ready_timeout: Duration,
    /// How long a template's ready command may take to succeed after its start command began.
    pub start_ready_timeout: Duration,
    /// How often expiry is checked.
    pub reap_interval: Duration,
    /// Caps on concurrent sandboxes and the host-capacity check.
    pub admission: AdmissionConfig,
    /// Pinned warm pools (`--pool TEMPLATE=N`): (template, how many booted sandboxes to keep
    /// ready whatever the demand).
    pub pools: Vec<(String, u32)>,
    /// The adaptive warm pools and the create queue (see `pool.rs`).
    pub pool: PoolPolicy,
    /// How often each running sandbox's metrics are sampled.
    pub metrics_interval: Duration,
    /// At most this many samples are kept per sandbox (older ones are thinned, never the
    /// whole start of its life dropped).
    pub metrics_capacity: usize,
    /// Webhook delivery retries and timeouts.
    pub webhooks: crate::obs::webhooks::WebhookConfig,
    /// Size of each new volume, MiB (writes beyond it get ENOSPC).
    pub volume_mb: u32,
    /// A running sandbox unused this long enters standby (see `standby.rs`); None: never.
    pub standby_after: Option<Duration>,
    /// A running sandbox unused this long, its runtime quiet, is hinted idle to its driver
    /// (see `idle_tick.rs`); None: never.
    pub idle_hint_after: Option<Duration>,
    /// How long one idle tick may spend putting sandboxes in standby before it leaves the rest
    /// to the next tick (which hints newly quiet sandboxes first); at least one enters per
    /// tick. None: the tick's period.
    pub standby_tick_budget: Option<Duration>,
}

/// Most volumes a team may hold unless `kiln serve --team-max-volumes` says otherwise.
pub const DEFAULT_TEAM_MAX_VOLUMES: u32 = 100;

impl Default for LifecycleConfig {
    fn default() -> Self {
        Self {
            default_timeout_secs: 300,
            max_timeout_secs: None,
            default_cpu_count: 2,
            default_memory_mb: 512,
            default_disk_mb: 2048,
            pids_limit: 4096,
            agent_ready_timeout: Duration::from_secs(30),
            start_ready_timeout: Duration::from_secs(60),
            reap_interval: Duration::from_millis(200),
            admission: AdmissionConfig::default(),
            pools: Vec::new(),
            pool: PoolPolicy::default(),
            metrics_interval: Duration::from_secs(5),
            metrics_capacity: crate::obs::ring::DEFAULT_CAPACITY,
            webhooks: Default::default(),
            volume_mb: 10240,
            standby_after: None,
            idle_hint_after: None,
            standby_tick_budget: None,
        }
    }
}

/// Event kinds after which a sandbox is gone for good (it never resumes).
pub const END_EVENTS: &[&str] = &["killed", "timed-out", "died", "failed"];

/// A lifecycle event, as stored and as shown by `kiln serve`.
#[derive(Debug, Clone, Serialize)]
pub struct LifecycleEvent {
    pub ts_ms: i64,
    pub sandbox_id: String,
    pub kind: String,
    pub detail: String,
}

/// What a create request asks for (already parsed from JSON).
#[derive(Debug, Clone, Default)]
pub struct CreateParams {
    pub template_id: String,
    pub timeout_secs: Option<i64>,
    pub metadata: BTreeMap<String, String>,
    pub env_vars: BTreeMap<String, String>,
    pub secure: bool,
    pub auto_pause: bool,
    /// Traffic to the sandbox while it is paused resumes it.
    pub auto_resume: bool,
    /// An auto-pause keeps the filesystem only (`autoPauseMemory: false`).
    pub auto_pause_filesystem_only: bool,
    pub allow_internet_access: Option<bool>,
    /// The egress policy asked for (`None`: the driver's default).
    pub network: Option<kiln_net::EgressPolicy>,
    /// Who may reach the sandbox's ports, and the `Host` they see (default: public).
    pub ingress: crate::store::Ingress,
    /// The team the sandbox will belong to (empty: [`crate::tenancy::DEFAULT_TEAM`]).
    pub team: String,
    /// Volumes to mount (see [`Manager::resolve_mounts`]).
    pub volume_mounts: Vec<crate::store::MountRecord>,
    /// The request's idempotency scope and `Idempotency-Key` (`{team}/create/{key}`; None:
    /// no key). A lifecycle spread over replicas uses it so that a create retried at another
    /// replica ends on the same sandbox; one host's manager needs it not.
    pub idempotency: Option<String>,
    /// The request's `rules` and `egressProxy` as its client gave them (placeholders, never a
    /// secret's value), for a lifecycle that applies them where the sandbox runs
    /// ([`crate::SandboxService::forwards_network_settings`]); one host's manager takes them
    /// from `network`.
    pub network_settings: Option<serde_json::Value>,
}

impl CreateParams {
    /// The team the sandbox will belong to.
    pub fn team(&self) -> &str {
        if self.team.is_empty() {
            crate::tenancy::DEFAULT_TEAM
        } else {
            &self.team
        }
    }
}

pub struct Manager {
    cfg: LifecycleConfig,
    store: Arc<dyn StateStore>,
    driver: Arc<dyn Driver>,
    templates: Arc<dyn Templates>,
    registry: registry::Registry,
    admission: admission::Admission,
    /// Template versions (name, key) already recorded in the store by this server.
    recorded_templates: std::sync::Mutex<std::collections::HashSet<(String, String)>>,
    /// Serialises pauses, resumes, snapshots and forks (held exclusively), so a sandbox is
    /// never paused and resumed at once. Standby and wake hold it shared, each with its
    /// sandbox's own gate (`idle.rs`): one sandbox's checkpoint does not hold up another's wake.
    lifecycle_lock: tokio::sync::RwLock<()>,
    pools: pool::Pools,
    /// Lifecycle events, the audit log, counters and webhooks.
    outlets: Arc<outlets::Outlets>,
    history: sampler::History,
    /// How far each sandbox's agent kills have been reported as events.
    kill_marks: kills::KillMarks,
    /// The volumes table (set once by the server; unset: volumes answer 501).
    volumes: std::sync::OnceLock<crate::store::VolumesDb>,
    /// When each running sandbox was last used, and which are in standby.
    idle: Arc<idle::IdleTable>,
    /// CA certificates (PEM) every sandbox trusts besides its template's roots (set once by
    /// the server; see `api::host_trust`).
    extra_cas: std::sync::OnceLock<Vec<String>>,
}

/// Random lowercase alphanumeric id (E2B sandbox ids look like this).
pub fn new_sandbox_id() -> String {
    use rand::Rng;
    const ALPHA: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut r = rand::thread_rng();
    (0..20)
        .map(|_| ALPHA[r.gen_range(0..ALPHA.len())] as char)
        .collect()
}

impl Manager {
    pub fn new(
        cfg: LifecycleConfig,
        store: Arc<dyn StateStore>,
        driver: Arc<dyn Driver>,
        templates: Arc<dyn Templates>,
    ) -> Arc<Self> {
        let telemetry: Arc<crate::obs::Telemetry> = Arc::default();
        let webhooks = Arc::new(crate::obs::webhooks::Webhooks::new(
            store.clone(),
            telemetry.clone(),
            cfg.webhooks.clone(),
        ));
        let admission = admission::Admission::new(cfg.admission.clone(), store.clone());
        let outlets = Arc::new(outlets::Outlets::new(store.clone(), telemetry, webhooks));
        Arc::new(Self {
            cfg,
            store,
            driver,
            templates,
            registry: registry::Registry::default(),
            admission,
            recorded_templates: Default::default(),
            lifecycle_lock: tokio::sync::RwLock::new(()),
            pools: pool::Pools::default(),
            outlets,
            history: sampler::History::default(),
            kill_marks: kills::KillMarks::default(),
            volumes: std::sync::OnceLock::new(),
            idle: Arc::default(),
            extra_cas: std::sync::OnceLock::new(),
        })
    }

    pub fn config(&self) -> &LifecycleConfig {
        &self.cfg
    }

    /// Name of the isolation driver sandboxes run on.
    /// The server is stopping: the driver releases what it keeps ready (sandboxes keep
    /// running).
    pub async fn shutdown_driver(&self) {
        if !self.teardowns_done(teardown::SHUTDOWN_WAIT).await {
            tracing::warn!(
                "{} sandbox teardown(s) still running at shutdown",
                self.tearing_down()
            );
        }
        self.driver.shutdown().await;
    }

    pub fn driver_name(&self) -> &'static str {
        self.driver.name()
    }

    /// Lifecycle events as they happen.
    pub fn subscribe(&self) -> broadcast::Receiver<LifecycleEvent> {
        self.outlets.subscribe()
    }

    /// A sandbox that failed to boot (or restore): its runtime is stopped, its record marked
    /// failed and a `failed` event says why. Returns the error.
    async fn boot_failed(&self, id: &str, e: Error) -> Error {
        let _ = self.driver.stop(id).await;
        let msg = e.to_string();
        let _ = self
            .store
            .set_state(id, SandboxState::Failed, Some(&msg))
            .await;
        self.event(id, "failed", msg).await;
        e
    }

    async fn event(&self, id: &str, kind: &str, detail: impl Into<String>) {
        self.outlets.event(id, kind, detail.into()).await;
    }

    /// An event about sandbox `id` that its chain records in its own way (an alert): stored
    /// and broadcast to the event's listeners (webhooks, a cluster node's publisher), not
    /// audited again.
    pub async fn note_event(&self, id: &str, kind: &str, detail: String) {
        self.outlets.note(id, kind, detail).await;
    }

    /// Gives the manager its audit log (once; later calls are ignored).
    /// An enabled log also hears of every connection and DNS query of the sandboxes, and of
    /// the system calls of those created with `kiln.audit.syscalls=true`.
    pub fn set_audit(&self, log: crate::audit::AuditLog) {
        if log.enabled() {
            self.driver
                .set_net_observer(crate::audit::net::observer(log.clone()));
            self.driver
                .set_syscall_observer(crate::audit::net::syscall_observer(log.clone()));
        }
        self.outlets.set_audit(log);
    }

    /// The audit log (a disabled one when none was set).
    pub fn audit(&self) -> &crate::audit::AuditLog {
        self.outlets.audit()
    }

    /// Checks a requested timeout (seconds) against the limits.
    pub fn check_timeout(&self, secs: i64) -> Result<u64> {
        timeout_within(&self.cfg, secs)
    }

    /// The running or paused sandbox `id`, or [`Error::SandboxNotFound`].
    pub fn get(&self, id: &str) -> Result<SandboxRecord> {
        self.registry
            .get(id)
            .ok_or_else(|| Error::SandboxNotFound(id.to_string()))
    }

    /// The running or paused sandbox `id` if it belongs to `team`; [`Error::SandboxNotFound`]
    /// otherwise (another team's sandbox does not exist for this one).
    pub fn get_for(&self, id: &str, team: &str) -> Result<SandboxRecord> {
        self.registry
            .get(id)
            .filter(|r| r.team == team)
            .ok_or_else(|| Error::SandboxNotFound(id.to_string()))
    }

    /// Running and paused sandboxes of `team`, oldest first (template builds' sandboxes are
    /// the builds' own: not listed).
    pub fn list_for(&self, team: &str) -> Vec<SandboxRecord> {
        let mut v = self.registry.list();
        v.retain(|r| r.team == team && !is_build_sandbox(&r.metadata));
        v
    }

    /// Running and paused sandboxes, oldest first.
    pub fn list(&self) -> Vec<SandboxRecord> {
        self.registry.list()
    }

    /// A client for the agent of sandbox `id`, carrying its access token.
    pub fn agent(&self, id: &str, token: Option<String>) -> kiln_envd::EnvdClient {
        driver::agent_client(&self.driver, id).with_access_token(token)
    }

    /// The webhook delivery service.
    pub fn webhooks(&self) -> &Arc<crate::obs::webhooks::Webhooks> {
        self.outlets.webhooks()
    }

    /// The state store (the events and webhooks APIs read it directly).
    pub fn store(&self) -> &Arc<dyn StateStore> {
        &self.store
    }

    /// Kills `id`; false when it is not running.
    pub async fn kill(&self, id: &str, reason: &str) -> Result<bool> {
        self.end(id, "killed", reason).await
    }

    /// Stops `id` and records why with an event of `kind` (`killed`, `timed-out`, `died`,
    /// `oom`); false when it is not running.
    pub(crate) async fn end(&self, id: &str, kind: &str, reason: &str) -> Result<bool> {
        self.report_last_kills(id).await;
        if self.registry.remove(id).is_none() {
            return Ok(false);
        }
        self.idle.forget(id);
        let r = self.driver.stop(id).await;
        self.store
            .set_state(id, SandboxState::Killed, Some(reason))
            .await?;
        match r {
            Ok(()) => self.event(id, kind, reason).await,
            Err(e) => {
                self.event(id, kind, format!("{reason} (cleanup error: {e})"))
                    .await
            }
        }
        Ok(true)
    }

    async fn set_end(&self, id: &str, f: impl FnOnce(i64) -> i64) -> Result<i64> {
        let end = self
            .registry
            .update(id, |r| {
                r.end_at_ms = f(r.end_at_ms);
                r.end_at_ms
            })
            .ok_or_else(|| Error::SandboxNotFound(id.to_string()))?;
        self.store.set_end_at(id, end).await?;
        Ok(end)
    }

    /// `POST /sandboxes/{id}/timeout`: the sandbox now ends `secs` from now.
    pub async fn set_timeout(&self, id: &str, secs: i64) -> Result<i64> {
        let secs = self.check_timeout(secs)?;
        let end = self.set_end(id, |_| now_ms() + secs as i64 * 1000).await?;
        self.event(id, "timeout", format!("ends in {secs}s")).await;
        Ok(end)
    }

    /// Connect/refresh: the sandbox lives at least `secs` more.
    pub async fn extend(&self, id: &str, secs: i64, why: &str) -> Result<SandboxRecord> {
        let secs = self.check_timeout(secs)?;
        self.set_end(id, |cur| cur.max(now_ms() + secs as i64 * 1000))
            .await?;
        self.event(id, why, format!("lives at least {secs}s more"))
            .await;
        self.get(id)
    }

    /// Stops every running sandbox (used by tests and an orderly shutdown if configured).
    pub async fn kill_all(&self, reason: &str) {
        for r in self.registry.list() {
            let _ = self.kill(&r.id, reason).await;
        }
    }
}
