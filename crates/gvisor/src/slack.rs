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

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

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
/// (docs/density.md); one still hinted idle after [`DeepIdle::after`] (parked, not waiting
/// for an agent's next step) gets [`DeepIdle::slack`]. The first use after a hint sets the
/// slack back before the use goes on, so only timers inside a sandbox nobody is using fire
/// late.
#[derive(Debug)]
pub struct IdleSlack {
    idle_ns: u64,
    awake_ns: u64,
    deep: Option<(Duration, u64)>,
    /// Sandboxes hinted idle: since when, and whether they have the deep slack.
    hinted: Mutex<HashMap<String, (Instant, bool)>>,
}

/// The second tier of idle slack: after how long a hint, and how much.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeepIdle {
    pub after: Duration,
    pub slack: Duration,
}

fn ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX).max(1)
}

impl IdleSlack {
    /// `idle` on idle sandboxes, `deep` on those idle longer; awake ones get `awake` (the
    /// opt-in slack) or the kernel's.
    pub fn new(idle: Duration, awake: Option<Duration>, deep: Option<DeepIdle>) -> Self {
        Self {
            idle_ns: ns(idle),
            awake_ns: awake.map_or(KERNEL_DEFAULT_NS, ns),
            deep: deep.map(|d| (d.after, ns(d.slack))),
            hinted: Mutex::new(HashMap::new()),
        }
    }

    /// The slack a sandbox gets when `idle` (or not), before the deep tier.
    pub fn slack_ns(&self, idle: bool) -> u64 {
        if idle {
            self.idle_ns
        } else {
            self.awake_ns
        }
    }

    fn hinted(&self) -> std::sync::MutexGuard<'_, HashMap<String, (Instant, bool)>> {
        self.hinted.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sandbox `id` (its current container `cid`) is hinted `idle` (or in use): sets the
    /// slack of its host tasks; how many were set.
    pub fn apply(&self, id: &str, cid: &str, idle: bool) -> usize {
        let mut hinted = self.hinted();
        if idle {
            hinted.insert(id.to_string(), (Instant::now(), false));
        } else {
            hinted.remove(id);
        }
        set_slack(cid, self.slack_ns(idle))
    }

    /// Gives the deep slack to those of the running sandboxes `ids` (their current containers
    /// `cids`, in the same order) hinted idle for [`DeepIdle::after`] and forgets hints of
    /// sandboxes no longer running. Returns the sandboxes it deepened.
    pub fn housekeep(&self, ids: &[String], cids: &[String], now: Instant) -> Vec<String> {
        let mut hinted = self.hinted();
        if hinted.is_empty() {
            return Vec::new();
        }
        let live: HashSet<&str> = ids.iter().map(String::as_str).collect();
        hinted.retain(|id, _| live.contains(id.as_str()));
        let Some((after, deep_ns)) = self.deep else {
            return Vec::new();
        };
        let mut deepened = Vec::new();
        for (id, cid) in ids.iter().zip(cids) {
            if let Some((since, deep)) = hinted.get_mut(id) {
                if !*deep && now.saturating_duration_since(*since) >= after {
                    set_slack(cid, deep_ns);
                    *deep = true;
                    deepened.push(id.clone());
                }
            }
        }
        deepened
    }

    /// Whether sandbox `id` has the deep slack.
    pub fn is_deep(&self, id: &str) -> bool {
        self.hinted().get(id).is_some_and(|(_, deep)| *deep)
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
        let s = IdleSlack::new(Duration::from_millis(50), None, None);
        assert_eq!(s.slack_ns(true), 50_000_000);
        assert_eq!(s.slack_ns(false), KERNEL_DEFAULT_NS);
        let s = IdleSlack::new(
            Duration::from_millis(50),
            Some(Duration::from_millis(5)),
            None,
        );
        assert_eq!(s.slack_ns(false), 5_000_000, "the opt-in slack when awake");
    }

    #[test]
    fn a_hint_held_long_enough_gets_the_deep_slack_until_the_next_use() {
        let deep = DeepIdle {
            after: Duration::from_secs(120),
            slack: Duration::from_millis(500),
        };
        let s = IdleSlack::new(Duration::from_millis(50), None, Some(deep));
        // Containers with no cgroup here: the bookkeeping is what is tested.
        let running = |ids: &[&str]| -> (Vec<String>, Vec<String>) {
            ids.iter()
                .map(|i| (i.to_string(), format!("g1-{i}")))
                .unzip()
        };
        let tick = |s: &IdleSlack, ids: &[&str], now| {
            let (ids, cids) = running(ids);
            s.housekeep(&ids, &cids, now)
        };
        s.apply("a", "g1-a", true);
        s.apply("b", "g1-b", true);
        let t0 = Instant::now();
        assert!(tick(&s, &["a", "b"], t0).is_empty());
        let later = t0 + Duration::from_secs(121);
        assert_eq!(tick(&s, &["a", "b"], later), ["a", "b"]);
        assert!(s.is_deep("a") && s.is_deep("b"));
        assert!(tick(&s, &["a", "b"], later).is_empty(), "deepened once");
        // A use takes the hint back; a sandbox that stopped running is forgotten.
        s.apply("a", "g1-a", false);
        assert!(!s.is_deep("a"));
        tick(&s, &["a"], later);
        assert!(!s.is_deep("b"));
        // A new hint starts the count again.
        s.apply("a", "g2-a", true);
        assert!(tick(&s, &["a"], Instant::now()).is_empty());
        assert!(!s.is_deep("a"));
        // Without a deep tier nothing deepens.
        let plain = IdleSlack::new(Duration::from_millis(50), None, None);
        plain.apply("a", "g1-a", true);
        assert!(tick(&plain, &["a"], t0 + Duration::from_secs(3600)).is_empty());
    }

    #[test]
    fn the_deep_slack_reaches_the_host_tasks() {
        // This process's own thread stands in for a sandbox's host task.
        let tid = nix::unistd::gettid().as_raw();
        let before = slack_of(tid).unwrap();
        let home = std::fs::read_to_string(format!("/proc/self/task/{tid}/cgroup"))
            .unwrap()
            .lines()
            .find_map(|l| l.split_once(":pids:").map(|(_, p)| p.to_string()))
            .expect("this test needs the pids cgroup hierarchy (cgroup v1)");
        let dir = format!(
            "/sys/fs/cgroup/pids/kiln/kiln-slack-test-{}",
            std::process::id()
        );
        if std::fs::create_dir_all(&dir).is_err() {
            panic!("this test needs the pids cgroup hierarchy (cgroup v1) and root");
        }
        let cid = dir.rsplit('/').next().unwrap().to_string();
        let run = || {
            let deep = DeepIdle {
                after: Duration::ZERO,
                slack: Duration::from_millis(500),
            };
            let s = IdleSlack::new(Duration::from_millis(50), None, Some(deep));
            std::fs::write(format!("{dir}/tasks"), tid.to_string()).unwrap();
            s.apply("x", &cid, true);
            let idle = slack_of(tid);
            s.housekeep(&["x".into()], std::slice::from_ref(&cid), Instant::now());
            let deep = slack_of(tid);
            s.apply("x", &cid, false);
            (idle, deep, slack_of(tid))
        };
        let got = run();
        let home = format!("/sys/fs/cgroup/pids{}/tasks", home.trim_end_matches('/'));
        std::fs::write(home, tid.to_string()).unwrap();
        let _ = std::fs::remove_dir(&dir);
        std::fs::write(format!("/proc/{tid}/timerslack_ns"), before.to_string()).unwrap();
        assert_eq!(
            got,
            (Some(50_000_000), Some(500_000_000), Some(KERNEL_DEFAULT_NS))
        );
    }
}
