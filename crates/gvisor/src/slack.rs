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
