//! How many more sandboxes this host can hold: the limits that run out first (memory, host
//! threads against `kernel.pid_max` and `kernel.threads-max`, open files, inotify instances,
//! memory maps, disk), read from /proc, against what one sandbox costs.
//!
//! Reading is cheap (a few small /proc files), so the server checks before every create; the
//! thread count comes from `/proc/loadavg`'s running/total field (every task on the host).

use std::path::Path;

/// The host's limits and current use, as read now.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct HostLimits {
    pub mem_total_bytes: u64,
    pub mem_available_bytes: u64,
    /// `kernel.pid_max`: highest pid (threads take pids too).
    pub pid_max: u64,
    /// `kernel.threads-max`.
    pub threads_max: u64,
    /// Tasks (threads) on the host now.
    pub threads_now: u64,
    /// `fs.file-max` and the number of open files (`fs.file-nr`).
    pub file_max: u64,
    pub files_open: u64,
    /// `fs.inotify.max_user_instances` (per user: every sandbox's gofer uses some).
    pub inotify_instances: u64,
    /// `vm.max_map_count` (per process).
    pub max_map_count: u64,
    /// Free bytes where sandbox layers live.
    pub disk_free_bytes: Option<u64>,
}

/// What one idle sandbox costs on the host.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct SandboxCost {
    pub mem_bytes: u64,
    pub threads: u64,
    pub open_files: u64,
    pub disk_bytes: u64,
}

impl Default for SandboxCost {
    /// Measured on the development machine with gVisor (2022 runsc, ptrace): ≈ 16.5 MiB and
    /// ≈ 60 host threads per idle sandbox; files and disk are generous estimates.
    fn default() -> Self {
        Self {
            mem_bytes: 24 << 20,
            threads: 64,
            open_files: 64,
            disk_bytes: 16 << 20,
        }
    }
}

/// One limit and how many more sandboxes it allows.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Headroom {
    /// Human name of the limit, e.g. `host threads (kernel.pid_max 32768)`.
    pub limit: String,
    /// Sandboxes that still fit under it.
    pub sandboxes: u64,
}

/// Share of a kernel-wide limit kiln lets sandboxes use: the rest is for the host itself.
const KERNEL_SHARE: f64 = 0.9;

fn read(path: &str) -> Option<String> {
    std::fs::read_to_string(path).ok()
}

fn read_u64(path: &str) -> Option<u64> {
    read(path)?.split_whitespace().next()?.parse().ok()
}

/// A `/proc/meminfo` field, in bytes.
fn meminfo(text: &str, key: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .map(|kb| kb * 1024)
}

/// Tasks on the host, from `/proc/loadavg` ("0.00 0.01 0.05 2/345 6789": 345).
pub fn threads_now() -> u64 {
    read("/proc/loadavg")
        .and_then(|l| l.split_whitespace().nth(3)?.split('/').nth(1)?.parse().ok())
        .unwrap_or(0)
}

/// Reads the limits now; `state_dir` is where sandbox layers are written.
pub fn read_limits(state_dir: &Path) -> HostLimits {
    let mi = read("/proc/meminfo").unwrap_or_default();
    let file_nr = read("/proc/sys/fs/file-nr").unwrap_or_default();
    HostLimits {
        mem_total_bytes: meminfo(&mi, "MemTotal").unwrap_or(0),
        mem_available_bytes: meminfo(&mi, "MemAvailable").unwrap_or(0),
        pid_max: read_u64("/proc/sys/kernel/pid_max").unwrap_or(32768),
        threads_max: read_u64("/proc/sys/kernel/threads-max").unwrap_or(u64::MAX),
        threads_now: threads_now(),
        file_max: read_u64("/proc/sys/fs/file-max").unwrap_or(u64::MAX),
        files_open: file_nr
            .split_whitespace()
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0),
        inotify_instances: read_u64("/proc/sys/fs/inotify/max_user_instances").unwrap_or(128),
        max_map_count: read_u64("/proc/sys/vm/max_map_count").unwrap_or(65530),
        disk_free_bytes: free_bytes(state_dir),
    }
}

fn fit(free: u64, each: u64) -> u64 {
    free.checked_div(each).unwrap_or(u64::MAX)
}

/// How many more sandboxes of `cost` each limit allows, tightest first.
pub fn headroom(l: &HostLimits, cost: &SandboxCost) -> Vec<Headroom> {
    let share = |max: u64| (max as f64 * KERNEL_SHARE) as u64;
    let task_cap = l.pid_max.min(l.threads_max);
    let task_name = if l.pid_max <= l.threads_max {
        format!("host threads (kernel.pid_max {})", l.pid_max)
    } else {
        format!("host threads (kernel.threads-max {})", l.threads_max)
    };
    let mut v = vec![
        Headroom {
            limit: format!("memory ({} MiB available)", l.mem_available_bytes >> 20),
            sandboxes: fit(l.mem_available_bytes, cost.mem_bytes),
        },
        Headroom {
            limit: task_name,
            sandboxes: fit(share(task_cap).saturating_sub(l.threads_now), cost.threads),
        },
        Headroom {
            limit: format!("open files (fs.file-max {})", l.file_max),
            sandboxes: fit(
                share(l.file_max).saturating_sub(l.files_open),
                cost.open_files,
            ),
        },
    ];
    if let Some(free) = l.disk_free_bytes {
        v.push(Headroom {
            limit: format!("disk ({} MiB free)", free >> 20),
            sandboxes: fit(free, cost.disk_bytes),
        });
    }
    v.sort_by_key(|h| h.sandboxes);
    v
}

/// `kernel.pid_max` kiln raises to when it is still the kernel's small default (the 64-bit
/// maximum is 4194304; sandboxes under gVisor hold tens of host threads each).
pub const PID_MAX_TARGET: u64 = 4_194_304;

/// Raises `kernel.pid_max` when it is at or below the historical default (32768): returns
/// `Ok(Some(old))` when raised, `Ok(None)` when it was already large, and an error with the
/// command to run when this process may not write it.
pub fn raise_pid_max() -> Result<Option<u64>, String> {
    let cur = read_u64("/proc/sys/kernel/pid_max").unwrap_or(0);
    if cur == 0 || cur > 32768 {
        return Ok(None);
    }
    std::fs::write("/proc/sys/kernel/pid_max", PID_MAX_TARGET.to_string())
        .map(|_| Some(cur))
        .map_err(|e| {
            format!(
                "kernel.pid_max is {cur}, which caps this host at a few hundred sandboxes, and \
                 kiln cannot raise it ({e}); run: sudo sysctl -w kernel.pid_max={PID_MAX_TARGET}"
            )
        })
}

/// Bytes free for an unprivileged writer on the filesystem holding `path` (or its nearest
/// existing ancestor).
pub(crate) fn free_bytes(path: &Path) -> Option<u64> {
    // Walk up to an existing ancestor: the cache dir may not exist yet.
    let mut p = path.to_path_buf();
    while !p.exists() {
        p = p.parent()?.to_path_buf();
    }
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).ok()?;
    let mut st: libc::statvfs = unsafe_zeroed_statvfs();
    // SAFETY: `c` is a valid NUL-terminated path and `st` a properly sized out-parameter.
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    (rc == 0).then(|| st.f_bavail * st.f_frsize)
}

fn unsafe_zeroed_statvfs() -> libc::statvfs {
    // SAFETY: statvfs is a plain C struct of integers, for which all-zero bytes are valid.
    unsafe { std::mem::zeroed() }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> HostLimits {
        HostLimits {
            mem_total_bytes: 24 << 30,
            mem_available_bytes: 20 << 30,
            pid_max: 32768,
            threads_max: 192_730,
            threads_now: 500,
            file_max: 1 << 20,
            files_open: 1000,
            inotify_instances: 128,
            max_map_count: 65530,
            disk_free_bytes: Some(50 << 30),
        }
    }

    #[test]
    fn pid_max_binds_first_on_a_default_kernel() {
        let h = headroom(&limits(), &SandboxCost::default());
        assert!(h[0].limit.contains("kernel.pid_max 32768"), "{h:?}");
        // 90% of 32768 = 29491, minus 500 in use, / 64 per sandbox.
        assert_eq!(h[0].sandboxes, (29491 - 500) / 64);
        let mut big = limits();
        big.pid_max = PID_MAX_TARGET;
        let h = headroom(&big, &SandboxCost::default());
        assert!(
            h.iter()
                .any(|x| x.limit == "host threads (kernel.threads-max 192730)"),
            "{h:?}"
        );
        // Now 20 GiB of memory binds first: 20 GiB / 24 MiB.
        assert!(h[0].limit.starts_with("memory"), "{h:?}");
        assert_eq!(h[0].sandboxes, (20 << 30) / (24 << 20));
    }

    #[test]
    fn memory_binds_when_it_is_short() {
        let mut l = limits();
        l.mem_available_bytes = 100 << 20;
        let h = headroom(&l, &SandboxCost::default());
        assert!(h[0].limit.starts_with("memory"), "{h:?}");
        assert_eq!(h[0].sandboxes, 4);
    }

    #[test]
    fn reading_this_host_gives_plausible_numbers() {
        let l = read_limits(Path::new("/"));
        assert!(l.mem_total_bytes > 0 && l.mem_available_bytes <= l.mem_total_bytes);
        assert!(l.pid_max >= 301);
        assert!(l.threads_now > 0, "{l:?}");
        assert!(threads_now() > 0);
    }

    #[test]
    fn meminfo_parsing() {
        let t = "MemTotal:       24578300 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(meminfo(t, "MemTotal"), Some(24578300 * 1024));
        assert_eq!(meminfo(t, "MemAvailable"), Some(20000000 * 1024));
        assert_eq!(meminfo(t, "Nope"), None);
    }
}
