//! A bounded reserve instead of the host's OOM kill (cgroup v1): when a sandbox's host cgroup
//! reaches its memory limit, the kernel would kill the sentry and every process of the
//! sandbox with it, although the agent inside kills the culprit command a moment later (it is
//! CPU-starved by the very fork loop it must kill, see docs/hardening.md).
//!
//! With `memory.oom_control` = 1 (`oom_kill_disable`) the kernel does not kill: the sentry's
//! allocating threads wait at the limit, and the OOM notification (registered on the
//! sandbox's memory-event eventfd, `pressure_events.rs`) wakes the server, which
//! 1. raises the limit by a reserve ([`reserve_for`]: a quarter of the limit, at least
//!    64 MiB), so the sentry
//!    runs on, and tells the agent to kill its biggest command (`SIGURG`, `kiln_agent::relief`);
//! 2. puts the limit back once usage is below it again (the command is gone, its memory freed);
//! 3. if the sandbox reaches the raised limit too (the reserve is exhausted: nothing inside
//!    gave memory back), kills the sandbox itself, which the watcher then reports as `died`.
//!
//! What it does not cover: a server that is not running leaves a sandbox at its limit waiting
//! (not killed) until it comes back (a restarted server adopts the sandbox and sees
//! `under_oom` on its first tick), and cgroup v2 has no `oom_kill_disable` (there `memory.high`
//! throttles below the limit instead, see `pressure_events.rs`).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;

/// What one look at a sandbox's memory cgroup decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// At the limit: the limit was raised from `.0` to `.1` bytes (relieve the sandbox now).
    Raised(u64, u64),
    /// Usage is back below the limit: it was put back to `.0`.
    Restored(u64),
    /// At the raised limit too: the sandbox must be killed.
    Exhausted(u64),
}

/// The smallest reserve: a small limit still gets one a process can start in.
pub const MIN_RESERVE: u64 = 64 << 20;

/// The reserve for a host limit of `limit` bytes: a quarter of it, at least [`MIN_RESERVE`].
pub fn reserve_for(limit: u64) -> u64 {
    (limit / 4).max(MIN_RESERVE)
}

/// Whether a `memory.oom_control` text says the cgroup is at its limit with reclaim failed.
pub fn under_oom(text: &str) -> bool {
    text.lines()
        .any(|l| l.split_whitespace().collect::<Vec<_>>() == ["under_oom", "1"])
}

/// What to do given the current state: `held` is the original limit while the reserve is in
/// use, `usage` and `limit` the cgroup's now. Pure, for the tests.
pub fn decide(held: Option<u64>, under: bool, usage: u64, limit: u64) -> Option<Step> {
    match held {
        None if under => Some(Step::Raised(limit, limit + reserve_for(limit))),
        // Only at the raised limit: right after the raise the waiting tasks may not have
        // retried yet (`under_oom` still 1 while usage is still near the original limit).
        Some(orig) if under && usage >= limit - limit / 20 => Some(Step::Exhausted(orig)),
        Some(_) if under => None,
        // A margin of a twentieth, so the limit is not put back only to be hit again at once.
        Some(orig) if usage < orig - orig / 20 => Some(Step::Restored(orig)),
        _ => None,
    }
}

/// SIGKILLs every host process of container `cid` (the sentry, gofer and stubs): a fatal
/// signal ends a task waiting at its memory limit, where `runsc kill` would need the stalled
/// sentry to act.
pub fn kill_all(cid: &str) {
    let procs = std::fs::read_to_string(dir(cid).join("cgroup.procs")).unwrap_or_default();
    for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
        // SAFETY: kill takes plain integers; these are the sandbox's own host processes.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
}

fn dir(cid: &str) -> PathBuf {
    PathBuf::from(format!("/sys/fs/cgroup/memory/kiln/{cid}"))
}

fn read_u64(path: PathBuf) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// The original limits of sandboxes using their reserve, by container id.
#[derive(Default)]
pub struct OomReserve {
    held: Mutex<HashMap<String, u64>>,
}

impl OomReserve {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, u64>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Turns the kernel's OOM kill off for container `cid` (v1 only; a no-op elsewhere).
    pub fn arm(&self, cid: &str) {
        let f = dir(cid).join("memory.oom_control");
        if f.exists() {
            if let Err(e) = std::fs::write(&f, "1") {
                tracing::warn!(container = cid, error = %e, "cannot disable the host OOM kill");
            }
        }
    }

    /// Forgets containers not in `running`.
    pub fn retain(&self, running: &[String]) {
        self.lock().retain(|cid, _| running.contains(cid));
    }

    /// Looks at container `cid`'s memory cgroup and acts (raises or restores its limit).
    pub fn step(&self, cid: &str) -> Option<Step> {
        let d = dir(cid);
        let text = std::fs::read_to_string(d.join("memory.oom_control")).ok()?;
        let usage = read_u64(d.join("memory.usage_in_bytes"))?;
        let limit = read_u64(d.join("memory.limit_in_bytes"))?;
        let mut held = self.lock();
        let step = decide(held.get(cid).copied(), under_oom(&text), usage, limit)?;
        match step {
            Step::Raised(orig, raised) => {
                let w = std::fs::write(d.join("memory.limit_in_bytes"), raised.to_string());
                if let Err(e) = w {
                    tracing::warn!(container = cid, error = %e, "cannot raise the memory limit");
                    return Some(Step::Exhausted(orig));
                }
                held.insert(cid.to_string(), orig);
            }
            Step::Restored(orig) => {
                // Fails (EBUSY) if usage climbed back above it meanwhile: try again later.
                std::fs::write(d.join("memory.limit_in_bytes"), orig.to_string()).ok()?;
                held.remove(cid);
            }
            Step::Exhausted(_) => {}
        }
        Some(step)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_under_oom() {
        assert!(under_oom("oom_kill_disable 1\nunder_oom 1\noom_kill 0\n"));
        assert!(!under_oom("oom_kill_disable 1\nunder_oom 0\noom_kill 0\n"));
        assert!(!under_oom(""));
    }

    #[test]
    fn raise_then_restore_or_give_up() {
        let mib = 1u64 << 20;
        let l = 1000 * mib;
        assert_eq!(decide(None, false, 900 * mib, l), None);
        assert_eq!(decide(None, true, l, l), Some(Step::Raised(l, 1250 * mib)));
        let r = 1250 * mib;
        // Still in the reserve, not yet back under the limit's margin.
        assert_eq!(decide(Some(l), false, 1100 * mib, r), None);
        assert_eq!(decide(Some(l), false, 960 * mib, r), None);
        assert_eq!(
            decide(Some(l), false, 900 * mib, r),
            Some(Step::Restored(l))
        );
        // Just raised, the waiting tasks not yet retried: not exhausted.
        assert_eq!(decide(Some(l), true, l, r), None);
        // The reserve is used up as well.
        assert_eq!(decide(Some(l), true, r, r), Some(Step::Exhausted(l)));
        // A small limit gets the smallest reserve.
        assert_eq!(reserve_for(100 * mib), MIN_RESERVE);
    }
}
