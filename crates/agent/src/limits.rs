//! Per-command resource limits inside the sandbox, so one runaway command does not take the
//! sandbox (and its agent) down — see docs/hardening.md for what was measured under gVisor.
//!
//! - **pids**: gVisor enforces `pids.max` of its own (sandbox-internal) pids cgroups, mounted at
//!   `/sys/fs/cgroup` by the OCI spec. Every command gets a cgroup `kiln-cmd-N` whose
//!   `pids.max` leaves room for the agent and other commands (the sandbox's limit less 32, and
//!   at most half the memory size in MiB); a fork bomb gets `EAGAIN` there while the agent
//!   keeps working. Killing a command (SIGKILL) kills its whole cgroup. gVisor does not hold
//!   that cap strictly (processes forking at once overrun it many times over), so every
//!   command also gets an `RLIMIT_NPROC` a quarter above it ([`nproc_for`]), which gVisor does
//!   hold: it counts a uid's tasks and refuses a fork past the limit atomically.
//! - **memory**: gVisor does not enforce memory cgroups inside, and the host cgroup's OOM kill
//!   takes the whole sandbox. The host limit has headroom above the sandbox's memory size and
//!   the agent's [`oom_pass`] (on [`crate::watchdog`]'s thread) acts as a VM's OOM killer: when used memory (MemTotal −
//!   MemAvailable of the sentry's /proc/meminfo) passes the sandbox's size, the process with
//!   the largest RSS (never PID 1) gets SIGKILL.
//!
//! The server tells the agent the sandbox's limits through `KILN_SANDBOX_PIDS` and
//! `KILN_SANDBOX_MEMORY_MB` in PID 1's environment.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::cmd_cgroups::{PIDS_ROOT, PREFIX};

/// Processes kept free for the agent and other commands below the sandbox's pids limit.
const PIDS_RESERVE: u64 = 32;

/// Environment variable (PID 1 only) with the sandbox's pids limit.
pub const ENV_PIDS: &str = "KILN_SANDBOX_PIDS";
/// Environment variable (PID 1 only) with the sandbox's memory size in MiB.
pub const ENV_MEMORY_MB: &str = "KILN_SANDBOX_MEMORY_MB";

#[derive(Debug, Clone, Copy, Default)]
struct Config {
    /// `pids.max` of each command's cgroup (None: no per-command cgroups).
    cmd_pids: Option<u64>,
    /// Used memory at which the OOM watcher kills (bytes).
    memory: Option<u64>,
    /// `RLIMIT_NPROC` of every command (None: left as inherited).
    nproc: Option<u64>,
}

static CONFIG: OnceLock<Config> = OnceLock::new();
static NEXT: AtomicU64 = AtomicU64::new(1);

/// Reads the limits from the environment (and removes them from it). Call from PID 1 before
/// any thread starts.
pub fn init() {
    let num = |k: &str| {
        let v = std::env::var(k).ok()?.trim().parse::<u64>().ok();
        std::env::remove_var(k);
        v
    };
    let pids = num(ENV_PIDS);
    let memory = num(ENV_MEMORY_MB).filter(|m| *m > 0).map(|m| m << 20);
    // Each process also costs the sandbox ≈2 MiB of host memory its own accounting does not
    // see (gVisor's platform stubs): a command gets at most memory/2 MiB processes, which the
    // server's host memory limit leaves room for.
    let by_memory = memory.map(|m| (m >> 20) / 2).unwrap_or(u64::MAX);
    let cmd_pids = pids
        .filter(|_| Path::new(PIDS_ROOT).join("cgroup.procs").exists())
        .map(|p| p.saturating_sub(PIDS_RESERVE).min(by_memory).max(16));
    if pids.is_some() && cmd_pids.is_none() {
        tracing::warn!("no pids cgroup at {PIDS_ROOT}: commands are not limited individually");
    }
    let nproc = cmd_pids.map(nproc_for);
    let _ = CONFIG.set(Config {
        cmd_pids,
        memory,
        nproc,
    });
}

fn config() -> Config {
    CONFIG.get().copied().unwrap_or_default()
}

/// `pids.max` of each command's cgroup, when the agent limits commands.
pub fn command_pids_max() -> Option<u64> {
    config().cmd_pids
}

/// Used memory (bytes) at which the OOM killer acts, when the sandbox has a memory size.
pub fn memory_limit() -> Option<u64> {
    config().memory
}

/// One command's pids cgroup.
pub struct CmdCgroup {
    dir: PathBuf,
    procs: OwnedFd,
}

impl CmdCgroup {
    /// A fresh cgroup for a command, when the agent limits commands.
    pub fn create() -> Option<Self> {
        let max = config().cmd_pids?;
        let dir =
            Path::new(PIDS_ROOT).join(format!("{PREFIX}{}", NEXT.fetch_add(1, Ordering::Relaxed)));
        let made = std::fs::create_dir(&dir)
            .and_then(|_| std::fs::write(dir.join("pids.max"), max.to_string()))
            .and_then(|_| {
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(dir.join("cgroup.procs"))
            });
        match made {
            Ok(f) => Some(Self {
                dir,
                procs: f.into(),
            }),
            Err(e) => {
                tracing::warn!("cannot create the command cgroup {}: {e}", dir.display());
                let _ = std::fs::remove_dir(&dir);
                None
            }
        }
    }

    /// Descriptor of `cgroup.procs`, for [`join_raw`] in the child before exec.
    pub fn procs_fd(&self) -> RawFd {
        self.procs.as_raw_fd()
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// `RLIMIT_NPROC` of a command whose cgroup allows `cmd_pids`: gVisor holds this one strictly
/// (counted per uid, checked at every fork and clone, see [`limit_nproc_raw`]) where its pids
/// cgroup is overrun by concurrent forks. A quarter above the cgroup's cap, so that a command
/// held at its cap (which gVisor's cgroup overshoots a little) leaves the user room for other
/// commands, and the sentry's host cost stays bounded by it (docs/hardening.md).
pub fn nproc_for(cmd_pids: u64) -> u64 {
    cmd_pids + cmd_pids / 4
}

/// Lowers the calling process's `RLIMIT_NPROC` (soft and hard) to the commands' limit, when
/// the agent limits commands. Async-signal-safe (no allocation): for `pre_exec`.
pub fn limit_nproc_raw() -> std::io::Result<()> {
    let Some(n) = CONFIG.get().and_then(|c| c.nproc) else {
        return Ok(());
    };
    let lim = libc::rlimit {
        rlim_cur: n,
        rlim_max: n,
    };
    // SAFETY: setrlimit reads a valid rlimit from the stack.
    if unsafe { libc::setrlimit(libc::RLIMIT_NPROC, &lim) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Moves the calling process into the cgroup whose `cgroup.procs` is open as `fd`, and gives
/// it the commands' `RLIMIT_NPROC` ([`limit_nproc_raw`]).
/// Async-signal-safe (no allocation): for `pre_exec`.
pub fn join_raw(fd: RawFd) -> std::io::Result<()> {
    limit_nproc_raw()?;
    let mut buf = [0u8; 20];
    // SAFETY: getpid has no preconditions.
    let mut n = unsafe { libc::getpid() } as u64;
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    // SAFETY: writing an initialised byte range of a stack buffer to a descriptor.
    let r = unsafe { libc::write(fd, buf[i..].as_ptr().cast(), buf.len() - i) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Used memory (MemTotal − MemAvailable) from a meminfo text, in bytes.
pub fn used_memory(meminfo: &str) -> Option<u64> {
    let field = |name: &str| {
        meminfo.lines().find_map(|l| {
            let rest = l.strip_prefix(name)?.strip_prefix(':')?;
            rest.split_whitespace().next()?.parse::<u64>().ok()
        })
    };
    Some(field("MemTotal")?.saturating_sub(field("MemAvailable")?) * 1024)
}

/// The process with the largest resident set, never PID 1: (pid, rss bytes, name).
fn biggest_process() -> Option<(i32, u64, String)> {
    let page = 4096u64;
    let mut best: Option<(i32, u64, String)> = None;
    for e in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        if pid == 1 {
            continue;
        }
        let Ok(statm) = std::fs::read_to_string(e.path().join("statm")) else {
            continue;
        };
        let rss = statm
            .split_whitespace()
            .nth(1)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
            * page;
        if best.as_ref().is_none_or(|b| rss > b.1) {
            let name = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
            best = Some((pid, rss, name.trim().to_string()));
        }
    }
    best
}

/// How long after a kill the OOM pass waits for the victim's memory to be given back before
/// it picks another victim. gVisor frees an exited process's memory asynchronously: on a busy
/// host the sentry's used memory stayed above the limit after the victim was reaped, and the
/// next pass took the sandbox's next biggest process (a `sleep` beside the hog) for the culprit.
pub const OOM_SETTLE: Duration = Duration::from_secs(3);

/// The OOM pass's last kill: when, and the used memory it saw then (bytes).
#[derive(Debug, Clone, Copy)]
pub struct LastKill {
    pub at: Instant,
    pub used: u64,
}

/// Whether a pass seeing `used` bytes above the limit at `now` may kill, given the last kill:
/// not while that kill's memory may still be on its way back (within [`OOM_SETTLE`] and no
/// more used than then). Memory climbing past what it was at the kill is another allocation,
/// and is killed at once, as is a limit still passed once the settle time is over.
pub fn may_kill(last: Option<LastKill>, used: u64, now: Instant) -> bool {
    match last {
        Some(k) => now.duration_since(k.at) >= OOM_SETTLE || used > k.used,
        None => true,
    }
}

/// One pass of the in-sandbox OOM killer (run by [`crate::watchdog`]): when used memory is
/// above `limit`, kills the process with the largest RSS, then waits (up to 400 ms) for it to
/// go, so one hog costs one kill; `last` is the pass's last kill ([`may_kill`]). Returns the
/// used memory it saw (bytes).
pub fn oom_pass(limit: u64, last: &mut Option<LastKill>) -> Option<u64> {
    let used = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| used_memory(&m))?;
    if used <= limit {
        *last = None;
        return Some(used);
    }
    let now = Instant::now();
    if !may_kill(*last, used, now) {
        return Some(used);
    }
    *last = Some(LastKill { at: now, used });
    // A fork loop whose processes each hold memory (a Python `os.fork()` loop): one process
    // killed is one slot refilled, and a /proc scan of all of them is slow for a starved agent,
    // so a command with a quarter of its cap or more goes whole.
    let many = config().cmd_pids.map(|max| (max / 4).max(8));
    if let Some((dir, n)) = many.and_then(crate::cmd_cgroups::largest_from) {
        crate::kills::kill_command(
            crate::kills::Reason::Memory,
            &dir,
            "Out of memory",
            format!(
                "{n} processes; sandbox memory {} MiB, used {} MiB",
                limit >> 20,
                used >> 20
            ),
        );
        return Some(used);
    }
    let Some((pid, rss, name)) = biggest_process() else {
        return Some(used);
    };
    // SAFETY: kill has no memory-safety preconditions; pid is not 1.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    // The kernel's wording, so people recognise it.
    crate::kills::record(
        crate::kills::Reason::Memory,
        format!(
            "Out of memory: Killed process {pid} ({name}) total-rss:{}kB (sandbox memory {} \
             MiB, used {} MiB)",
            rss / 1024,
            limit >> 20,
            used >> 20
        ),
    );
    for _ in 0..40 {
        std::thread::sleep(Duration::from_millis(10));
        // SAFETY: probing with signal 0.
        if unsafe { libc::kill(pid, 0) } != 0 {
            break;
        }
    }
    Some(used)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kill_settles_before_the_next_victim() {
        let t = Instant::now();
        let mib = 1u64 << 20;
        let last = Some(LastKill {
            at: t,
            used: 330 * mib,
        });
        assert!(may_kill(None, 330 * mib, t));
        // The victim's memory not back yet: nobody else is taken for it.
        assert!(!may_kill(last, 330 * mib, t + Duration::from_millis(500)));
        assert!(!may_kill(last, 325 * mib, t + Duration::from_secs(2)));
        // Climbing past the kill's reading is another allocation; a settle time is enough.
        assert!(may_kill(last, 331 * mib, t + Duration::from_millis(100)));
        assert!(may_kill(last, 325 * mib, t + OOM_SETTLE));
    }

    #[test]
    fn meminfo_used() {
        let m = "MemTotal:       1000 kB\nMemFree:        300 kB\nMemAvailable:   400 kB\n";
        assert_eq!(used_memory(m), Some(600 * 1024));
        assert_eq!(used_memory("MemTotal: 5 kB\n"), None);
    }

    #[test]
    fn nproc_is_a_quarter_above_the_cap() {
        assert_eq!(nproc_for(160), 200);
        assert_eq!(nproc_for(16), 20);
    }

    #[test]
    fn join_raw_writes_the_pid() {
        let d = tempfile::tempdir().unwrap();
        let f = std::fs::File::create(d.path().join("procs")).unwrap();
        join_raw(f.as_raw_fd()).unwrap();
        let text = std::fs::read_to_string(d.path().join("procs")).unwrap();
        assert_eq!(text, std::process::id().to_string());
    }
}
