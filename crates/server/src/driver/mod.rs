//! Isolation drivers: what turns a template into a running, isolated sandbox whose kiln-agent
//! the server can reach without the sandbox network.
//!
//! The [`Driver`] trait is the one seam between kiln and an isolation technology: nothing
//! outside a driver's own module knows how it works. [`factory::build`] picks the driver from
//! configuration. Reaching a sandbox is [`Driver::connect`]: a byte stream to a port inside it
//! (gVisor: the agent's host Unix socket; microVM: a vsock CONNECT; later: TCP into the
//! sandbox's network namespace), used alike by the agent client and the proxy.
//!
//! The lifecycle is split so that pools and snapshots fit: [`Driver::create`] prepares
//! everything that does not depend on the request (writable layer, bundle) and
//! [`Driver::start`] makes it run. Pause, resume, snapshot, restore and fork are named here and
//! answer [`DriverError::NotImplemented`] until a driver supports them (the gVisor driver does
//! pause/resume/snapshot/restore; the manager builds fork on snapshot + restore).

pub mod factory;
pub mod gvisor;
pub mod microvm;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

pub use factory::{build, DriverConfig, DriverKind};
pub use kiln_envd::{BoxIo, Io};

/// Everything a driver needs to build one sandbox.
#[derive(Debug, Clone)]
pub struct SandboxSpec {
    pub id: String,
    pub template_name: String,
    /// Template root filesystem directory (read-only; never written to).
    pub rootfs: PathBuf,
    /// The template's ext4 image of the same tree, for drivers that boot from a block device.
    pub image: Option<PathBuf>,
    /// Environment of the agent process (the template's env).
    pub env: BTreeMap<String, String>,
    pub cpu_count: u32,
    pub memory_mb: u32,
    pub pids_limit: u32,
    /// Audit the sandbox's system calls (see the gVisor driver's `trace` module).
    pub syscall_audit: bool,
    /// Size of the sandbox's writable disk in MiB (writes beyond it get ENOSPC); 0: unbounded.
    pub disk_mb: u32,
}

/// Resource usage of a running sandbox.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SandboxStats {
    /// Total CPU time used, nanoseconds.
    pub cpu_ns: u64,
    pub mem_used_bytes: u64,
    pub mem_limit_bytes: u64,
    /// Host page cache of the sandbox's files (its rootfs and disk, written or read through
    /// the runtime), charged to its host cgroup; not its guest memory.
    pub mem_cache_bytes: u64,
    pub pids: u64,
}

/// A sandbox the driver finds on the host (for recovery after a restart).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostSandbox {
    pub id: String,
    pub running: bool,
}

/// Opaque reference to a snapshot, meaningful to the driver that made it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotRef(pub String);

#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    /// The driver does not support this operation (yet): 501 to API clients.
    #[error("{0} is not implemented by this isolation driver")]
    NotImplemented(&'static str),
    /// The driver cannot run on this host at all.
    #[error("the {driver} driver is not available on this host: {reason}")]
    Unavailable {
        driver: &'static str,
        reason: String,
    },
    #[error("sandbox {0} is not known to the driver")]
    NotFound(String),
    #[error("invalid sandbox id {0:?}")]
    InvalidId(String),
    /// Nothing answers on that port of the sandbox (or the driver cannot reach it).
    #[error("port {port} of sandbox {id} is not reachable: {reason}")]
    Unreachable {
        id: String,
        port: u16,
        reason: String,
    },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("`{command}` failed: {output}")]
    Command { command: String, output: String },
    #[error("{0}")]
    Other(String),
}

pub type Result<T, E = DriverError> = std::result::Result<T, E>;

pub(crate) fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> DriverError {
    let what = what.into();
    move |source| DriverError::Io { what, source }
}

/// An isolation technology.
/// Receives the network events of every sandbox: its id and the event.
pub type NetObserver = std::sync::Arc<
    dyn Fn(&str, kiln_net::observe::NetEvent) -> kiln_net::observe::BoxFuture + Send + Sync,
>;

/// Receives the audited system calls of sandboxes: its id and the record's body.
pub type SyscallObserver =
    std::sync::Arc<dyn Fn(&str, serde_json::Value) -> kiln_net::observe::BoxFuture + Send + Sync>;

#[async_trait::async_trait]
pub trait Driver: Send + Sync + 'static {
    /// Short name recorded with each sandbox (`gvisor`, `microvm`).
    fn name(&self) -> &'static str;
    /// Prepares the sandbox (writable layer, bundle, runtime container) without running it.
    async fn create(&self, spec: &SandboxSpec) -> Result<()>;
    /// Starts the agent of a created sandbox.
    async fn start(&self, id: &str) -> Result<()>;
    /// Stops the sandbox and releases everything it holds on the host. Idempotent: stopping an
    /// unknown or half-created sandbox cleans up whatever is left and succeeds.
    async fn stop(&self, id: &str) -> Result<()>;
    /// Opens a byte stream to `port` inside the sandbox. The agent's port
    /// ([`kiln_proto::envd::ENVD_PORT`]) is reachable whatever the sandbox network is.
    async fn connect(&self, id: &str, port: u16) -> Result<BoxIo>;
    /// Whether the sandbox is running on the host.
    async fn is_running(&self, id: &str) -> Result<bool>;
    /// Which of `ids` (sandboxes the server believes are running) have no runtime left on the
    /// host. Called every second or so, so drivers make it cheap; a sandbox is only reported
    /// when it is really gone (the default asks [`Self::is_running`] for each).
    async fn dead(&self, ids: &[String]) -> Vec<String> {
        let mut out = Vec::new();
        for id in ids {
            if let Ok(false) = self.is_running(id).await {
                out.push(id.clone());
            }
        }
        out
    }
    async fn stats(&self, id: &str) -> Result<SandboxStats>;
    /// Sandboxes this driver finds on the host (running or leftover).
    async fn list_on_host(&self) -> Result<Vec<HostSandbox>>;
    /// The sandbox's own output (the agent's stdout/stderr), last `max_bytes` bytes.
    async fn console_log(&self, id: &str, max_bytes: usize) -> Result<String>;
    /// Periodic upkeep of running sandboxes' host files (e.g. rotating console logs); called
    /// by the watcher about once a second.
    async fn housekeep(&self, _ids: &[String]) {}
    /// Why a sandbox [`Self::dead`] reported died, when the driver itself ended it (e.g. its
    /// host memory reserve ran out); None for a runtime that exited on its own.
    fn death_cause(&self, _id: &str) -> Option<&'static str> {
        None
    }

    /// The server is stopping: release what the driver keeps ready for future sandboxes (e.g.
    /// pre-created network slots). Running sandboxes are left alone.
    async fn shutdown(&self) {}

    /// Whether this driver's sandboxes have a network (egress, ports other than the agent's).
    fn has_network(&self) -> bool {
        false
    }
    /// Replaces the egress policy of a created or running sandbox (atomically).
    async fn set_network(&self, _id: &str, _policy: &kiln_net::EgressPolicy) -> Result<()> {
        Err(DriverError::NotImplemented("sandbox networking"))
    }
    /// The egress policy in force, or `None` when the sandbox has no network.
    async fn network(&self, _id: &str) -> Option<kiln_net::EgressPolicy> {
        None
    }
    /// Tells `o` of every connection and DNS query of every sandbox's network (the audit
    /// log); set once, before or after sandboxes start.
    fn set_net_observer(&self, _o: NetObserver) {}
    /// Tells `o` of the audited system calls of sandboxes created with `syscall_audit`
    /// (without it, such sandboxes are not traced).
    fn set_syscall_observer(&self, _o: SyscallObserver) {}

    /// Freezes the sandbox and saves its disk, and with `memory` its memory and processes
    /// too; it no longer runs on the host. Its saved state survives a server restart.
    async fn pause(&self, _id: &str, _memory: bool) -> Result<()> {
        Err(DriverError::NotImplemented("pausing sandboxes"))
    }
    /// Runs a paused sandbox again: from its saved memory when it has one and `memory` is
    /// true (its processes continue), else by booting it on its saved disk. Returns whether
    /// the memory was restored (false: a fresh boot whose agent needs initialising).
    async fn resume(&self, _id: &str, _memory: bool) -> Result<bool> {
        Err(DriverError::NotImplemented("resuming sandboxes"))
    }
    /// Whether the sandbox is paused on the host (its saved state is complete).
    async fn is_paused(&self, _id: &str) -> Result<bool> {
        Ok(false)
    }
    /// Captures the running sandbox `id` (which keeps running, with its processes) as the new
    /// snapshot `snapshot`, with its memory and processes when `memory` (else its disk only:
    /// sandboxes started from it boot on that disk); returns the disk bytes the snapshot
    /// uses. A snapshot outlives its source.
    async fn snapshot(&self, _id: &str, _snapshot: &SnapshotRef, _memory: bool) -> Result<u64> {
        Err(DriverError::NotImplemented("sandbox snapshots"))
    }
    /// [`Driver::snapshot`] with memory for a fork: the source continues only after
    /// [`Driver::release_source`] (so the children restore first on a busy host); requests to
    /// the source wait for it meanwhile.
    async fn capture_for_fork(&self, id: &str, snapshot: &SnapshotRef) -> Result<u64> {
        self.snapshot(id, snapshot, true).await
    }
    /// Lets the source of [`Driver::capture_for_fork`] continue.
    fn release_source(&self, _id: &str) {}
    /// Creates and starts a new sandbox `spec.id` continuing from a snapshot (its agent
    /// keeps the identity it had in the snapshot until it is initialised again), or booting
    /// on the snapshot's disk when it was taken without memory.
    async fn restore(&self, _snapshot: &SnapshotRef, _spec: &SandboxSpec) -> Result<()> {
        Err(DriverError::NotImplemented("restoring sandbox snapshots"))
    }
    /// Deletes a snapshot and frees its disk.
    async fn delete_snapshot(&self, _snapshot: &SnapshotRef) -> Result<()> {
        Err(DriverError::NotImplemented("sandbox snapshots"))
    }
    /// Starts `children` as copies of the running sandbox `id` (which keeps running). Unused
    /// so far: the manager forks with [`Driver::snapshot`] and [`Driver::restore`].
    async fn fork(&self, _id: &str, _children: &[SandboxSpec]) -> Result<()> {
        Err(DriverError::NotImplemented("forking sandboxes"))
    }
}

/// A [`kiln_envd::Connector`] to one port of one sandbox, through its driver: what the agent
/// client and the proxy use to reach a sandbox.
pub struct SandboxConnector {
    pub driver: Arc<dyn Driver>,
    pub id: String,
    pub port: u16,
}

#[async_trait::async_trait]
impl kiln_envd::Connector for SandboxConnector {
    async fn connect(&self) -> std::io::Result<BoxIo> {
        self.driver
            .connect(&self.id, self.port)
            .await
            .map_err(|e| match e {
                DriverError::Io { source, .. } => source,
                other => std::io::Error::other(other.to_string()),
            })
    }
    fn describe(&self) -> String {
        format!(
            "{} sandbox {} port {}",
            self.driver.name(),
            self.id,
            self.port
        )
    }
}

/// An envd client for the agent of sandbox `id`.
pub fn agent_client(driver: &Arc<dyn Driver>, id: &str) -> kiln_envd::EnvdClient {
    kiln_envd::EnvdClient::new(Arc::new(SandboxConnector {
        driver: driver.clone(),
        id: id.to_string(),
        port: kiln_proto::envd::ENVD_PORT,
    }))
}
