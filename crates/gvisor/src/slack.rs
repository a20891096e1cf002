//! Timer slack of the sandboxes' host tasks (opt-in: `kiln serve --sentry-timer-slack-ms`).
//!
//! An idle systrap sentry is not idle: its platform's fast-path controller sleeps 400 µs in a
//! loop (`systrap.controlFastPath`, seen with `runsc debug --stacks`), which the Go runtime
//! turns into ≈1,000 host wake-ups a second, ≈2 % of a host core per sandbox whatever runs
//! inside (docs/density.md). Linux lets a task's timers fire up to its timer slack late
//! (`/proc/<tid>/timerslack_ns`, default 50 µs) and coalesces them: with 20 ms the same
//! sandbox costs ≈0.4 %. The price is that every timer of the sandbox (a `sleep 0.001` inside,
//! the sentry's own timeouts) may fire up to the slack late; events (I/O, signals, futex
//! wake-ups) are not delayed. Threads and stub processes created later inherit the slack of
//! the thread creating them, so setting it once on every task of a started sandbox covers it.
//!
//! Separately, [`IdleSlack`] gives a large slack only to sandboxes the server finds idle and
//! takes it back at their first use (`kiln serve --idle-hint-after`, on by default).
//!
//! The server's watcher tick ([`kiln_driver::Driver::housekeep`]) applies it to each running
//! sandbox not yet tuned; a sandbox that stops running (pause) is forgotten, so its restored sentry
//! is tuned again.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::Duration;

/// Sets the timer slack of running sandboxes' host tasks.
#[derive(Debug)]
pub struct SentrySlack {
    ns: u64,
    tuned: Mutex<HashSet<String>>,
}

impl SentrySlack {
    pub fn new(slack: Duration) -> Self {
        Self {
            ns: u64::try_from(slack.as_nanos()).unwrap_or(u64::MAX).max(1),
            tuned: Mutex::new(HashSet::new()),
        }
    }

    /// Tunes those of `running` (the current container of every running sandbox) not tuned yet.
    pub fn housekeep(&self, running: &[String]) {
        let mut tuned = self.tuned.lock().unwrap_or_else(|p| p.into_inner());
        let live: HashSet<&str> = running.iter().map(String::as_str).collect();
        tuned.retain(|id| live.contains(id.as_str()));
        for id in running {
            if !tuned.contains(id) && set_slack(id, self.ns) > 0 {
                tuned.insert(id.clone());
            }
        }
    }
}

/// The kernel's default timer slack of a task (50 µs).
pub const KERNEL_DEFAULT_NS: u64 = 50_000;

/// Adaptive timer slack: the driver's answer to idle hints
/// ([`kiln_driver::Driver::set_idle`]). A sandbox the server finds idle gets `idle_ns` on its
/// host tasks, which coalesces the systrap controller's wake-ups as the opt-in slack does
/// (docs/density.md); the first use after that sets the slack back before the use goes on,
/// so only timers inside a sandbox nobody is using fire late.
#[derive(Debug, Clone, Copy)]
pub struct IdleSlack {
    idle_ns: u64,
    awake_ns: u64,
}

impl IdleSlack {
    /// `idle` on idle sandboxes; awake ones get `awake` (the opt-in slack) or the kernel's.
    pub fn new(idle: Duration, awake: Option<Duration>) -> Self {
        let ns = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX).max(1);
        Self {
            idle_ns: ns(idle),
            awake_ns: awake.map_or(KERNEL_DEFAULT_NS, ns),
        }
    }

    /// The slack a sandbox gets when `idle` (or not).
    pub fn slack_ns(&self, idle: bool) -> u64 {
        if idle {
            self.idle_ns
        } else {
            self.awake_ns
        }
    }

    /// Sets the slack of container `cid`'s host tasks for `idle`; how many were set.
    pub fn apply(&self, cid: &str, idle: bool) -> usize {
        set_slack(cid, self.slack_ns(idle))
    }
}

/// The host task ids in container `id`'s cgroup (a sandbox's current runsc container) (v1 pids `tasks`, or v2 `cgroup.threads`).
pub fn host_tasks(id: &str) -> Vec<i32> {
    let candidates = [
        format!("/sys/fs/cgroup/pids/kiln/{id}/tasks"),
        format!("/sys/fs/cgroup/kiln/{id}/cgroup.threads"),
        format!("/sys/fs/cgroup/unified/kiln/{id}/cgroup.threads"),
    ];
    candidates
        .iter()
        .find_map(|p| std::fs::read_to_string(p).ok())
        .map(|s| s.lines().filter_map(|l| l.trim().parse().ok()).collect())
        .unwrap_or_default()
}

/// Sets the timer slack of every host task of sandbox `id`; returns how many were set.
pub fn set_slack(id: &str, ns: u64) -> usize {
    host_tasks(id)
        .into_iter()
        .filter(|tid| std::fs::write(format!("/proc/{tid}/timerslack_ns"), ns.to_string()).is_ok())
        .count()
}

/// The timer slack (ns) of host task `tid`.
pub fn slack_of(tid: i32) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{tid}/timerslack_ns"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_and_awake_slacks() {
        let s = IdleSlack::new(Duration::from_millis(50), None);
        assert_eq!(s.slack_ns(true), 50_000_000);
        assert_eq!(s.slack_ns(false), KERNEL_DEFAULT_NS);
        let s = IdleSlack::new(Duration::from_millis(50), Some(Duration::from_millis(5)));
        assert_eq!(s.slack_ns(false), 5_000_000, "the opt-in slack when awake");
    }
}
