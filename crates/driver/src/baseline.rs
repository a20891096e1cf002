//! A driver's raw baseline: its isolation runtime driven directly, without kiln's layers (no
//! writable overlay, no cgroup limits, no agent, no network), which `kiln bench` measures beside
//! kiln's own figures in the same run. [`RawBaseline`] boots containers of a root filesystem
//! on its own; [`SandboxBaseline`] works on the sandboxes of one driver instance (the runtime's
//! checkpoint and restore of a sandbox kiln started).

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::Result;

/// A root filesystem as a raw container boots it: read-only, its command run as `user` (from
/// the rootfs's `/etc/passwd`, root when absent) in `workdir`.
#[derive(Debug, Clone)]
pub struct RawImage {
    pub rootfs: PathBuf,
    pub user: String,
    pub workdir: String,
}

/// Memory and threads of a runtime's host processes, summed over them.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct HostUsage {
    pub processes: usize,
    /// Resident set size (shared pages counted in each process), KiB.
    pub rss_kib: u64,
    /// Proportional set size (shared pages split between the processes that map them), KiB.
    pub pss_kib: u64,
    pub threads: u64,
}

/// The raw counterparts of an interactive sandbox's figures, measured on one idle container
/// (milliseconds; MiB for `idle_mib`).
#[derive(Debug, Default, Clone)]
pub struct InteractiveReport {
    /// Exec round trips of the given command in the running container.
    pub exec: Vec<f64>,
    /// Checkpoint, then restore and a first command (the restore and command timed).
    pub resume: Vec<f64>,
    /// Checkpoint leaving the container running, restore under a new id, a first command.
    pub fork: Vec<f64>,
    /// The idle container's host processes (PSS).
    pub idle_mib: Option<f64>,
    /// What could not be measured, and why.
    pub errors: Vec<String>,
}

/// The runtime of a driver, driven directly. Every call blocks (benches run them on a blocking
/// thread) and keeps its files under the `work` directory it is given.
pub trait RawBaseline: Send + Sync {
    /// The runtime's name in a bench's heading ("gVisor").
    fn runtime(&self) -> &str;
    /// The runtime's mode on this host (gVisor's platform).
    fn platform(&self) -> &str;
    /// The runtime's command-line tool, as raw rows name its commands ("runsc").
    fn tool(&self) -> &str;
    /// The runtime's version, or why it is unknown.
    fn version(&self) -> String;

    /// Boots a container of `image` running `argv` and times it from the spawn to its first
    /// stdout line, which must be `expect` (the container's teardown is not timed). `i` tells
    /// the runs' files apart.
    fn first_line(
        &self,
        work: &Path,
        image: &RawImage,
        argv: &[String],
        expect: &str,
        i: usize,
    ) -> Result<Duration>;

    /// Runs `shell -c script` as root in a container of `rootfs` (read-only, a tmpfs at
    /// `/tmp`) until it exits; its stdout.
    fn script(
        &self,
        work: &Path,
        rootfs: &Path,
        shell: &str,
        script: &str,
        i: usize,
    ) -> Result<Vec<u8>>;

    /// Starts one idle container of `image` and measures on it: `runs` round trips of
    /// `exec_argv`, its idle memory, then `rounds` forks and `rounds` checkpoint/restore
    /// cycles (each followed by a first command).
    fn interactive(
        &self,
        work: &Path,
        image: &RawImage,
        exec_argv: &[String],
        runs: usize,
        rounds: usize,
    ) -> InteractiveReport;

    /// The runtime's host processes whose command line names `root` (a state or work
    /// directory).
    fn usage(&self, root: &Path) -> HostUsage;
}

/// The runtime's own commands on the sandboxes of one driver instance.
#[async_trait::async_trait]
pub trait SandboxBaseline: Send + Sync {
    /// The runtime's checkpoint of running sandbox `id` into `image`, then its restore from
    /// it, each timed alone (the agent lets go of its host socket before, which a checkpoint
    /// cannot save, and listens again after; neither is timed).
    async fn checkpoint_restore(&self, id: &str, image: &Path) -> Result<(Duration, Duration)>;

    /// The runtime's restore alone of snapshot `snapshot`'s checkpoint into sandbox `id` (a
    /// sandbox created from that snapshot), timed: its current container is stopped first and
    /// the agent attached after (neither timed). The restored agent holds the snapshot's
    /// access token, not the sandbox's.
    async fn restore_snapshot(&self, id: &str, snapshot: &str) -> Result<Duration>;
}
