//! What the host keeps for the density bench's sandboxes, read from the kernel's files without
//! spawning a process: disk under a sandbox's state directory, free disk, the processes and
//! memory left in a sandbox's host cgroups, mounts, and this process's RSS. Leftover processes
//! are found and killed through the sandboxes' own `cgroup.procs` (never by matching command
//! lines), so a cleanup touches nothing but this bench's sandboxes.

use std::collections::HashSet;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kiln_driver::baseline::{HostUsage, RawBaseline};

/// The controllers (cgroup v1) and unified roots a sandbox's host cgroup `kiln/<id>` may be
/// in.
const CGROUP_ROOTS: &[&str] = &[
    "/sys/fs/cgroup/pids",
    "/sys/fs/cgroup/cpuacct",
    "/sys/fs/cgroup/cpu",
    "/sys/fs/cgroup/memory",
    "/sys/fs/cgroup/freezer",
    "/sys/fs/cgroup/systemd",
    "/sys/fs/cgroup/unified",
    "/sys/fs/cgroup",
];

/// Bytes on disk (allocated blocks) under `root`, without crossing into other filesystems
/// (a sandbox's rootfs overlay and run directory are mounts) and counting hard links once.
pub(super) fn dir_bytes(root: &Path) -> u64 {
    let Ok(top) = std::fs::symlink_metadata(root) else {
        return 0;
    };
    let dev = top.dev();
    let mut seen = HashSet::new();
    let mut total = 0u64;
    let mut stack = vec![root.to_path_buf()];
    while let Some(p) = stack.pop() {
        let Ok(md) = std::fs::symlink_metadata(&p) else {
            continue;
        };
        if md.dev() != dev || !seen.insert(md.ino()) {
            continue;
        }
        total += md.blocks() * 512;
        if md.is_dir() {
            if let Ok(rd) = std::fs::read_dir(&p) {
                stack.extend(rd.flatten().map(|e| e.path()));
            }
        }
    }
    total
}

/// Bytes free for an unprivileged writer on the filesystem of `p`.
pub(super) fn free_bytes(p: &Path) -> anyhow::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(p.as_os_str().as_bytes())?;
    // SAFETY: statvfs fills the zeroed struct it is given from a NUL-terminated path.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a valid C string and `s` a valid statvfs to write into.
    if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
        anyhow::bail!(
            "statvfs {}: {}",
            p.display(),
            std::io::Error::last_os_error()
        );
    }
    Ok(s.f_bavail as u64 * s.f_frsize as u64)
}

/// How many sandboxes of `per` bytes each fit in `free` bytes while leaving `reserve` free.
pub(super) fn capacity(free: u64, per: u64, reserve: u64) -> u64 {
    free.saturating_sub(reserve) / per.max(1)
}

/// The refusal of a run of `count` sandboxes of `per` bytes each on `free` bytes that would
/// leave less than `reserve`; None when it fits.
pub(super) fn disk_refusal(count: usize, per: u64, free: u64, reserve: u64) -> Option<String> {
    let need = per.saturating_mul(count as u64);
    if free >= need.saturating_add(reserve) {
        return None;
    }
    Some(format!(
        "{count} sandboxes in standby need ≈{:.1} GB on disk ({:.1} MB each), which would leave \
         {:.1} GB of the {:.1} GB free, under the {:.0} GB kept free: at most {} fit \
         (use --count, or --work-dir on a larger filesystem)",
        need as f64 / 1e9,
        per as f64 / 1e6,
        free.saturating_sub(need) as f64 / 1e9,
        free as f64 / 1e9,
        reserve as f64 / 1e9,
        capacity(free, per, reserve)
    ))
}

/// The pids in sandbox `id`'s host cgroups (every controller; each pid once).
pub(super) fn cgroup_procs(id: &str) -> Vec<u32> {
    let mut pids: Vec<u32> = CGROUP_ROOTS
        .iter()
        .filter_map(|r| std::fs::read_to_string(format!("{r}/kiln/{id}/cgroup.procs")).ok())
        .flat_map(|s| {
            s.lines()
                .filter_map(|l| l.trim().parse().ok())
                .collect::<Vec<u32>>()
        })
        .collect();
    pids.sort_unstable();
    pids.dedup();
    pids
}

/// Host memory charged to sandbox `id`'s memory cgroup (page cache included), if it has one.
pub(super) fn cgroup_memory(id: &str) -> Option<u64> {
    let v1 = format!("/sys/fs/cgroup/memory/kiln/{id}/memory.usage_in_bytes");
    let v2 = format!("/sys/fs/cgroup/kiln/{id}/memory.current");
    [v1, v2]
        .iter()
        .find_map(|p| std::fs::read_to_string(p).ok())
        .and_then(|s| s.trim().parse().ok())
}

/// Kills (SIGKILL) every process in the host cgroups of `ids`; how many were found.
pub(super) fn kill_cgroup_procs<'a>(ids: impl IntoIterator<Item = &'a String>) -> usize {
    let mut n = 0;
    for id in ids {
        for pid in cgroup_procs(id) {
            // SAFETY: kill has no memory preconditions; the pid was read from this
            // sandbox's own cgroup.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            n += 1;
        }
    }
    n
}

/// Mounts at or under `dir` (from this process's mountinfo).
pub(super) fn mounts_under(dir: &Path) -> usize {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return 0;
    };
    let prefix = dir.to_string_lossy().into_owned();
    info.lines()
        .filter_map(|l| l.split_whitespace().nth(4))
        .filter(|m| *m == prefix || m.starts_with(&format!("{prefix}/")))
        .count()
}

/// This process's resident set (KiB).
pub(super) fn own_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

/// The runtime's host processes of this bench: those whose command line names `root`.
pub(super) struct Host {
    pub root: PathBuf,
    pub raw: Arc<dyn RawBaseline>,
    pub started: Instant,
    /// This process's RSS before the first sandbox (KiB).
    pub rss0_kib: u64,
}

impl Host {
    pub fn usage(&self) -> HostUsage {
        self.raw.usage(&self.root)
    }
}

/// Share of CPU time the host spent idle over `window` (from /proc/stat).
pub(super) async fn cpu_idle_pct(window: Duration) -> f64 {
    let a = kiln_agent::cpu_times();
    tokio::time::sleep(window).await;
    match (a, kiln_agent::cpu_times()) {
        (Some((t0, i0)), Some((t1, i1))) if t1 > t0 => (i1 - i0) as f64 / (t1 - t0) as f64 * 100.0,
        _ => f64::NAN,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_that_would_eat_the_reserve_is_refused_with_what_fits() {
        const GB: u64 = 1_000_000_000;
        assert_eq!(disk_refusal(100, 50_000_000, 40 * GB, 10 * GB), None);
        let why = disk_refusal(1000, 50_000_000, 40 * GB, 10 * GB).expect("refused");
        assert!(why.contains("at most 600 fit"), "{why}");
        assert_eq!(capacity(5 * GB, 1, 10 * GB), 0);
        // A probe that measured nothing cannot divide by zero.
        assert_eq!(capacity(20 * GB, 0, 10 * GB), 10 * GB);
    }

    #[test]
    fn disk_use_counts_blocks_once_per_inode() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("a"), vec![1u8; 64 * 1024]).unwrap();
        std::fs::hard_link(d.path().join("a"), d.path().join("b")).unwrap();
        std::fs::create_dir(d.path().join("sub")).unwrap();
        std::fs::write(d.path().join("sub/c"), vec![2u8; 64 * 1024]).unwrap();
        let n = dir_bytes(d.path());
        assert!((128 * 1024..256 * 1024).contains(&n), "{n}");
        assert_eq!(dir_bytes(&d.path().join("missing")), 0);
        assert!(free_bytes(d.path()).unwrap() > 0);
    }

    #[test]
    fn own_memory_and_no_cgroup_for_an_unknown_sandbox() {
        assert!(own_rss_kib() > 0);
        assert!(cgroup_procs("no-such-sandbox-kiln-test").is_empty());
        assert_eq!(cgroup_memory("no-such-sandbox-kiln-test"), None);
        assert_eq!(mounts_under(Path::new("/no/such/dir/kiln")), 0);
    }
}
