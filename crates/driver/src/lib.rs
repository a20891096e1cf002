//! kiln-driver: the seam between kiln and an isolation technology — what turns a template into
//! a running, isolated sandbox whose kiln-agent the server can reach without the sandbox network.
//!
//! [`Driver`] is the core every driver implements: create, start, stop, connect, stats, list,
//! plus the sandbox network and observers. [`Checkpoint`] is layered on it (pause, resume,
//! snapshot, restore) for drivers that can freeze a sandbox; a driver offers it through
//! [`Driver::checkpoint`], and the same calls on a `dyn Driver` answer
//! [`DriverError::NotImplemented`] when it does not. Implementations live in their own crates
//! (kiln-gvisor, kiln-microvm); the binary picks one and hands it to the server.
//!
//! Reaching a sandbox is [`Driver::connect`]: a byte stream to a port inside it (gVisor: the
//! agent's host Unix socket; microVM: a vsock CONNECT), used alike by the agent client and the
//! proxy. The lifecycle is split so that pools and snapshots fit: [`Driver::create`] prepares
//! everything that does not depend on the request (writable layer, bundle) and
//! [`Driver::start`] makes it run.
//!
//! [`baseline`] is what `kiln bench` measures kiln against: a driver's runtime driven directly.

pub mod baseline;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

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
    /// Audit the sandbox's system calls (through the observer of
    /// [`Driver::set_syscall_observer`]).
    pub syscall_audit: bool,
    /// Size of the sandbox's writable disk in MiB (writes beyond it get ENOSPC); 0: unbounded.
    pub disk_mb: u32,
    /// Volumes mounted read-write into the sandbox (see [`Driver::create_volume`]).
    pub volumes: Vec<VolumeMount>,
    /// The egress policy the sandbox's network starts with (`None`: the default, internet on):
    /// in force before anything in the sandbox runs, as a restored snapshot's processes run
    /// at once.
    pub network: Option<kiln_net::EgressPolicy>,
    /// Booted ahead of demand (a warm pool's): it boots and waits on the host CPU the
    /// sandboxes at work leave, until [`Driver::set_background`] says otherwise.
    pub background: bool,
}

/// One volume mounted into a sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeMount {
    /// The volume's id (as given to [`Driver::create_volume`]).
    pub volume_id: String,
    /// Absolute path inside the sandbox.
    pub path: String,
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

/// Maps an I/O error to [`DriverError::Io`], saying what was being done.
pub fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> DriverError {
    let what = what.into();
    move |source| DriverError::Io { what, source }
}

/// Receives the network events of every sandbox: its id and the event.
pub type NetObserver = std::sync::Arc<
    dyn Fn(&str, kiln_net::observe::NetEvent) -> kiln_net::observe::BoxFuture + Send + Sync,
>;

/// Receives the audited system calls of sandboxes: its id and the record's body.
pub type SyscallObserver =
    std::sync::Arc<dyn Fn(&str, serde_json::Value) -> kiln_net::observe::BoxFuture + Send + Sync>;

/// An isolation technology: the core every driver implements.
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
    /// Hints that a running sandbox is idle (`true`: nobody has used it for a while and its
    /// runtime is quiet) or in use again (`false`, said before the work that ends the
    /// idleness goes on). A driver whose runtime costs host CPU while idle may make it cheaper
    /// (gVisor: a large timer slack on its host tasks); the default does nothing. Cheap and
    /// synchronous: it is on the path of the first request after idleness.
    fn set_idle(&self, _id: &str, _idle: bool) {}
    /// Says whether a sandbox runs ahead of demand (`true`: a warm pool's, serving no request
    /// yet; see [`SandboxSpec::background`]) or serves one (`false`, said before its first
    /// request goes on; also before or during its start). A driver may give a background
    /// sandbox only the host CPU nothing else wants, so filling a pool does not slow the
    /// sandboxes at work; the default does nothing. Cheap and synchronous: it is on a
    /// create's path.
    fn set_background(&self, _id: &str, _background: bool) {}
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
    /// The ingress settings a kiln from before they lived in the sandbox record kept with
    /// sandbox `id`'s network (`None`: none kept). Recovery carries them into the record.
    async fn legacy_ingress(&self, _id: &str) -> Option<kiln_net::Ingress> {
        None
    }
    /// Tells `o` of every connection and DNS query of every sandbox's network (the audit
    /// log); set once, before or after sandboxes start.
    fn set_net_observer(&self, _o: NetObserver) {}
    /// Tells `o` of the audited system calls of sandboxes created with `syscall_audit`
    /// (without it, such sandboxes are not traced).
    fn set_syscall_observer(&self, _o: SyscallObserver) {}

    /// Creates volume `id`: storage of `size_mb` MiB (writes beyond it get ENOSPC) that
    /// outlives sandboxes, mountable by several at once ([`SandboxSpec::volumes`]).
    async fn create_volume(&self, _id: &str, _size_mb: u32) -> Result<()> {
        Err(DriverError::NotImplemented("volumes"))
    }
    /// Deletes volume `id` and its data (no sandbox may have it mounted). Idempotent.
    async fn delete_volume(&self, _id: &str) -> Result<()> {
        Err(DriverError::NotImplemented("volumes"))
    }
    /// The host directory holding volume `id`'s files (made available again first, e.g.
    /// after a host reboot), for the server's volume-content API.
    async fn volume_root(&self, _id: &str) -> Result<PathBuf> {
        Err(DriverError::NotImplemented("volumes"))
    }

    /// The driver's [`Checkpoint`] side, when it can freeze sandboxes.
    fn checkpoint(&self) -> Option<&dyn Checkpoint> {
        None
    }
}

/// Freezing and copying sandboxes, for drivers that can: layered on [`Driver`] and offered
/// through [`Driver::checkpoint`]. Call these through a `dyn Driver` (its methods of the same
/// names), which answer [`DriverError::NotImplemented`] for a driver without this side.
#[async_trait::async_trait]
pub trait Checkpoint: Driver {
    /// Freezes the sandbox and saves its disk, and with `memory` its memory and processes
    /// too; it no longer runs on the host. Its saved state survives a server restart.
    async fn pause(&self, id: &str, memory: bool) -> Result<()>;
    /// Runs a paused sandbox again: from its saved memory when it has one and `memory` is
    /// true (its processes continue), else by booting it on its saved disk. Returns whether
    /// the memory was restored (false: a fresh boot whose agent needs initialising).
    async fn resume(&self, id: &str, memory: bool) -> Result<bool>;
    /// Whether the sandbox is paused on the host (its saved state is complete).
    async fn is_paused(&self, id: &str) -> Result<bool>;
    /// Captures the running sandbox `id` (which keeps running, with its processes) as the new
    /// snapshot `snapshot`, with its memory and processes when `memory` (else its disk only:
    /// sandboxes started from it boot on that disk); returns the disk bytes the snapshot
    /// uses. A snapshot outlives its source.
    async fn snapshot(&self, id: &str, snapshot: &SnapshotRef, memory: bool) -> Result<u64>;
    /// [`Checkpoint::snapshot`] of the disk only, for a source that ends with it (the last
    /// layer of a template build): no image the source could continue from is made, and the
    /// source no longer runs afterwards (the caller stops it next, as for any sandbox). A
    /// driver without a cheaper way takes a disk snapshot and leaves the source running.
    async fn snapshot_ending(&self, id: &str, snapshot: &SnapshotRef) -> Result<u64> {
        self.snapshot(id, snapshot, false).await
    }
    /// [`Checkpoint::snapshot`] with memory for a fork: the source continues only after
    /// [`Checkpoint::release_source`] (so the children restore first on a busy host); requests
    /// to the source wait for it meanwhile.
    async fn capture_for_fork(&self, id: &str, snapshot: &SnapshotRef) -> Result<u64> {
        self.snapshot(id, snapshot, true).await
    }
    /// Lets the source of [`Checkpoint::capture_for_fork`] continue.
    fn release_source(&self, _id: &str) {}
    /// Creates and starts a new sandbox `spec.id` continuing from a snapshot (its agent
    /// keeps the identity it had in the snapshot until it is initialised again), or booting
    /// on the snapshot's disk when it was taken without memory.
    async fn restore(&self, snapshot: &SnapshotRef, spec: &SandboxSpec) -> Result<()>;
    /// Deletes a snapshot and frees its disk.
    async fn delete_snapshot(&self, snapshot: &SnapshotRef) -> Result<()>;
    /// The files that make paused sandbox `id` whole on another host of this driver (see
    /// [`PortablePause`]), flushed to disk; the sandbox stays paused here and resumable. Its
    /// egress policy lists go with them ([`Checkpoint::adopt_paused`] puts them in force there,
    /// with the rules and egress proxy its caller carries), or the sandbox does not move.
    async fn portable_pause(&self, _id: &str) -> Result<PortablePause> {
        Err(DriverError::NotImplemented(
            "moving paused sandboxes between hosts",
        ))
    }
    /// An empty directory where the files of [`Checkpoint::portable_pause`] from another host
    /// are laid out (at their relative paths) before [`Checkpoint::adopt_paused`].
    async fn incoming_dir(&self, _id: &str) -> Result<PathBuf> {
        Err(DriverError::NotImplemented(
            "moving paused sandboxes between hosts",
        ))
    }
    /// Makes the files laid out in [`Checkpoint::incoming_dir`] paused sandbox `spec.id` of
    /// this host (its network attached here under the egress policy lists that moved with
    /// it, with the rules and egress proxy of `spec.network`, when given):
    /// [`Checkpoint::resume`] then runs it.
    async fn adopt_paused(&self, _spec: &SandboxSpec) -> Result<()> {
        Err(DriverError::NotImplemented(
            "moving paused sandboxes between hosts",
        ))
    }
    /// The files that make snapshot `snapshot` whole on another host of this driver whose
    /// template is the same (flushed to disk; paths relative to the answer's `dir`); the
    /// snapshot stays here.
    async fn portable_snapshot(&self, _snapshot: &SnapshotRef) -> Result<PortablePause> {
        Err(DriverError::NotImplemented(
            "moving snapshots between hosts",
        ))
    }
    /// An empty directory where the files of [`Checkpoint::portable_snapshot`] from another
    /// host are laid out before [`Checkpoint::adopt_snapshot`].
    async fn incoming_snapshot_dir(&self, _snapshot: &SnapshotRef) -> Result<PathBuf> {
        Err(DriverError::NotImplemented(
            "moving snapshots between hosts",
        ))
    }
    /// Makes the files laid out in [`Checkpoint::incoming_snapshot_dir`] snapshot `snapshot`
    /// of this host, stacked on its template's root filesystem `rootfs` here:
    /// [`Checkpoint::restore`] then starts sandboxes from it. Returns its disk bytes.
    async fn adopt_snapshot(&self, _snapshot: &SnapshotRef, _rootfs: &Path) -> Result<u64> {
        Err(DriverError::NotImplemented(
            "moving snapshots between hosts",
        ))
    }
}

/// The files of a paused sandbox that another host of the same driver needs to resume it:
/// paths relative to `dir`, each a regular file. What they are is the driver's business.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortablePause {
    pub dir: PathBuf,
    pub files: Vec<PathBuf>,
}

/// The [`Checkpoint`] calls on any driver: forwarded when it has that side, else
/// [`DriverError::NotImplemented`] (a driver that cannot pause has nothing paused).
impl dyn Driver {
    fn checkpoint_or(&self, what: &'static str) -> Result<&dyn Checkpoint> {
        self.checkpoint().ok_or(DriverError::NotImplemented(what))
    }
    /// [`Checkpoint::pause`].
    pub async fn pause(&self, id: &str, memory: bool) -> Result<()> {
        self.checkpoint_or("pausing sandboxes")?
            .pause(id, memory)
            .await
    }
    /// [`Checkpoint::resume`].
    pub async fn resume(&self, id: &str, memory: bool) -> Result<bool> {
        self.checkpoint_or("resuming sandboxes")?
            .resume(id, memory)
            .await
    }
    /// [`Checkpoint::is_paused`] (false for a driver that cannot pause).
    pub async fn is_paused(&self, id: &str) -> Result<bool> {
        match self.checkpoint() {
            Some(c) => c.is_paused(id).await,
            None => Ok(false),
        }
    }
    /// [`Checkpoint::snapshot`].
    pub async fn snapshot(&self, id: &str, snapshot: &SnapshotRef, memory: bool) -> Result<u64> {
        self.checkpoint_or("sandbox snapshots")?
            .snapshot(id, snapshot, memory)
            .await
    }
    /// [`Checkpoint::snapshot_ending`].
    pub async fn snapshot_ending(&self, id: &str, snapshot: &SnapshotRef) -> Result<u64> {
        self.checkpoint_or("sandbox snapshots")?
            .snapshot_ending(id, snapshot)
            .await
    }
    /// [`Checkpoint::capture_for_fork`].
    pub async fn capture_for_fork(&self, id: &str, snapshot: &SnapshotRef) -> Result<u64> {
        self.checkpoint_or("sandbox snapshots")?
            .capture_for_fork(id, snapshot)
            .await
    }
    /// [`Checkpoint::release_source`].
    pub fn release_source(&self, id: &str) {
        if let Some(c) = self.checkpoint() {
            c.release_source(id);
        }
    }
    /// [`Checkpoint::restore`].
    pub async fn restore(&self, snapshot: &SnapshotRef, spec: &SandboxSpec) -> Result<()> {
        self.checkpoint_or("restoring sandbox snapshots")?
            .restore(snapshot, spec)
            .await
    }
    /// [`Checkpoint::delete_snapshot`].
    pub async fn delete_snapshot(&self, snapshot: &SnapshotRef) -> Result<()> {
        self.checkpoint_or("sandbox snapshots")?
            .delete_snapshot(snapshot)
            .await
    }
    /// [`Checkpoint::portable_pause`].
    pub async fn portable_pause(&self, id: &str) -> Result<PortablePause> {
        self.checkpoint_or("moving paused sandboxes between hosts")?
            .portable_pause(id)
            .await
    }
    /// [`Checkpoint::incoming_dir`].
    pub async fn incoming_dir(&self, id: &str) -> Result<PathBuf> {
        self.checkpoint_or("moving paused sandboxes between hosts")?
            .incoming_dir(id)
            .await
    }
    /// [`Checkpoint::adopt_paused`].
    pub async fn adopt_paused(&self, spec: &SandboxSpec) -> Result<()> {
        self.checkpoint_or("moving paused sandboxes between hosts")?
            .adopt_paused(spec)
            .await
    }
    /// [`Checkpoint::portable_snapshot`].
    pub async fn portable_snapshot(&self, snapshot: &SnapshotRef) -> Result<PortablePause> {
        self.checkpoint_or("moving snapshots between hosts")?
            .portable_snapshot(snapshot)
            .await
    }
    /// [`Checkpoint::incoming_snapshot_dir`].
    pub async fn incoming_snapshot_dir(&self, snapshot: &SnapshotRef) -> Result<PathBuf> {
        self.checkpoint_or("moving snapshots between hosts")?
            .incoming_snapshot_dir(snapshot)
            .await
    }
    /// [`Checkpoint::adopt_snapshot`].
    pub async fn adopt_snapshot(&self, snapshot: &SnapshotRef, rootfs: &Path) -> Result<u64> {
        self.checkpoint_or("moving snapshots between hosts")?
            .adopt_snapshot(snapshot, rootfs)
            .await
    }
}

impl From<DriverError> for std::io::Error {
    fn from(e: DriverError) -> Self {
        std::io::Error::other(e.to_string())
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A driver with the core only: every checkpoint call says it is not implemented.
    struct CoreOnly;

    #[async_trait::async_trait]
    impl Driver for CoreOnly {
        fn name(&self) -> &'static str {
            "core-only"
        }
        async fn create(&self, _spec: &SandboxSpec) -> Result<()> {
            Ok(())
        }
        async fn start(&self, _id: &str) -> Result<()> {
            Ok(())
        }
        async fn stop(&self, _id: &str) -> Result<()> {
            Ok(())
        }
        async fn connect(&self, id: &str, port: u16) -> Result<BoxIo> {
            Err(DriverError::Unreachable {
                id: id.into(),
                port,
                reason: "no sandboxes".into(),
            })
        }
        async fn is_running(&self, _id: &str) -> Result<bool> {
            Ok(false)
        }
        async fn stats(&self, id: &str) -> Result<SandboxStats> {
            Err(DriverError::NotFound(id.into()))
        }
        async fn list_on_host(&self) -> Result<Vec<HostSandbox>> {
            Ok(vec![])
        }
        async fn console_log(&self, _id: &str, _max_bytes: usize) -> Result<String> {
            Ok(String::new())
        }
    }

    #[tokio::test]
    async fn checkpoint_calls_on_a_core_only_driver_are_not_implemented() {
        let d: Arc<dyn Driver> = Arc::new(CoreOnly);
        let snap = SnapshotRef("s".into());
        assert!(matches!(
            d.pause("a", true).await,
            Err(DriverError::NotImplemented("pausing sandboxes"))
        ));
        assert!(matches!(
            d.resume("a", true).await,
            Err(DriverError::NotImplemented(_))
        ));
        assert!(matches!(
            d.snapshot("a", &snap, false).await,
            Err(DriverError::NotImplemented(_))
        ));
        assert!(matches!(
            d.capture_for_fork("a", &snap).await,
            Err(DriverError::NotImplemented(_))
        ));
        assert!(matches!(
            d.delete_snapshot(&snap).await,
            Err(DriverError::NotImplemented(_))
        ));
        assert!(!d.is_paused("a").await.unwrap());
        d.release_source("a");
        // The dead-sandbox check defaults to asking is_running.
        assert_eq!(d.dead(&["a".into()]).await, vec!["a".to_string()]);
    }
}
