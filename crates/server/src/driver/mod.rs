//! Isolation drivers: what turns a template into a running, isolated sandbox with a kiln-agent
//! the server can reach without the sandbox network.
//!
//! The lifecycle is split so that pools and snapshots fit later: [`Driver::create`] prepares
//! everything that does not depend on the request's identity-free parts (bundle, writable
//! layer, runtime container) and [`Driver::start`] makes it run; a pool would hold created (or
//! started and snapshotted) sandboxes and hand them out. `pause`/`resume`/`snapshot`/`restore`
//! answer [`DriverError::NotImplemented`] until a driver supports them.

pub mod gvisor;

use std::collections::BTreeMap;
use std::path::PathBuf;

/// Everything a driver needs to build one sandbox.
#[derive(Debug, Clone)]
pub struct SandboxSpec {
    pub id: String,
    pub template_name: String,
    /// Template root filesystem directory (read-only; never written to).
    pub rootfs: PathBuf,
    /// Environment of the agent process (the template's env).
    pub env: BTreeMap<String, String>,
    pub cpu_count: u32,
    pub memory_mb: u32,
    pub pids_limit: u32,
}

/// How the server reaches a sandbox's agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AgentEndpoint {
    /// A Unix socket on the host, bound by the agent inside the sandbox.
    Unix(PathBuf),
}

/// Resource usage of a running sandbox.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SandboxStats {
    /// Total CPU time used, nanoseconds.
    pub cpu_ns: u64,
    pub mem_used_bytes: u64,
    pub mem_limit_bytes: u64,
    pub pids: u64,
}

/// A sandbox the driver finds on the host (for recovery after a restart).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostSandbox {
    pub id: String,
    pub running: bool,
}

/// Opaque reference to a snapshot (future drivers).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotRef(pub String);

#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    #[error("{0}")]
    NotImplemented(&'static str),
    #[error("sandbox {0} is not known to the driver")]
    NotFound(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("`{command}` failed: {output}")]
    Command { command: String, output: String },
    #[error(
        "the agent in sandbox {id} did not become ready within {secs:.1}s. Sandbox output:\n{log}"
    )]
    AgentNotReady { id: String, secs: f64, log: String },
    #[error("{0}")]
    Other(String),
}

pub type Result<T, E = DriverError> = std::result::Result<T, E>;

pub(crate) fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> DriverError {
    let what = what.into();
    move |source| DriverError::Io { what, source }
}

/// An isolation technology.
#[async_trait::async_trait]
pub trait Driver: Send + Sync + 'static {
    /// Short name recorded with each sandbox (`gvisor`, …).
    fn name(&self) -> &'static str;
    /// Prepares the sandbox (writable layer, bundle, runtime container) without running it.
    async fn create(&self, spec: &SandboxSpec) -> Result<()>;
    /// Starts the agent of a created sandbox.
    async fn start(&self, id: &str) -> Result<()>;
    /// Stops the sandbox and releases everything it holds on the host. Idempotent: stopping an
    /// unknown or half-created sandbox cleans up whatever is left and succeeds.
    async fn stop(&self, id: &str) -> Result<()>;
    async fn pause(&self, _id: &str) -> Result<()> {
        Err(DriverError::NotImplemented("pausing sandboxes"))
    }
    async fn resume(&self, _id: &str) -> Result<()> {
        Err(DriverError::NotImplemented("resuming sandboxes"))
    }
    async fn snapshot(&self, _id: &str) -> Result<SnapshotRef> {
        Err(DriverError::NotImplemented("sandbox snapshots"))
    }
    async fn restore(&self, _snapshot: &SnapshotRef, _spec: &SandboxSpec) -> Result<()> {
        Err(DriverError::NotImplemented("restoring sandbox snapshots"))
    }
    /// Where the sandbox's agent listens.
    fn agent_endpoint(&self, id: &str) -> AgentEndpoint;
    /// Whether the sandbox is running on the host.
    async fn is_running(&self, id: &str) -> Result<bool>;
    async fn stats(&self, id: &str) -> Result<SandboxStats>;
    /// Sandboxes this driver finds on the host (running or leftover).
    async fn list_on_host(&self) -> Result<Vec<HostSandbox>>;
    /// The sandbox's own output (the agent's stdout/stderr), last `max_bytes` bytes.
    async fn console_log(&self, id: &str, max_bytes: usize) -> Result<String>;
}
