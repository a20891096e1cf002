//! The agent's in-sandbox watchdog: one thread of PID 1 running the OOM killer
//! ([`limits::oom_pass`]) and the fork-bomb killer ([`forkbomb::pass`]) on an adaptive
//! schedule.
//!
//! Under gVisor every wake-up of a sandbox thread costs host CPU in the sentry and the
//! platform (≈0.4 ms measured with systrap), so an idle sandbox must not wake often. The two
//! killers used to poll at 50 ms and 100 ms on threads of their own: 30 wake-ups a second,
//! ≈1.2 % of a host core per idle sandbox (docs/density.md). Now:
//! - the OOM pass runs again after the time memory would need to reach the limit growing at
//!   [`ASSUMED_GROWTH`] (or twice the growth seen since the last pass, if faster), between
//!   [`OOM_MIN`] and [`OOM_MAX`]: every 50 ms near the limit, every 250 ms–1 s far from it;
//! - the fork-bomb pass runs only while a command runs: every [`CHURN_FAST`] while one has a
//!   quarter of its pids limit or more, else every [`CHURN_SLOW`]; with no command it sleeps
//!   until [`command_started`] wakes it.

use std::collections::HashMap;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::{forkbomb, limits};

/// Growth of used memory the OOM schedule assumes (bytes/s): a hog allocating this fast is
/// seen before it passes the limit. A bytearray loop under gVisor (systrap) measured
/// ≈0.7 GiB/s; the host cgroup's headroom above the sandbox's size absorbs faster ones.
pub const ASSUMED_GROWTH: u64 = 2 << 30;
/// Shortest OOM interval (near the limit).
pub const OOM_MIN: Duration = Duration::from_millis(50);
/// Longest OOM interval (far from the limit).
pub const OOM_MAX: Duration = Duration::from_secs(1);
/// Fork-bomb interval while a command has many processes.
pub const CHURN_FAST: Duration = Duration::from_millis(100);
/// Fork-bomb interval while every command has few processes (a bomb is caught at most this
/// much later than with [`CHURN_FAST`]).
pub const CHURN_SLOW: Duration = Duration::from_millis(500);

/// Commands started so far (bumped by [`command_started`]), and the watchdog's wake-up.
static STARTED: Mutex<u64> = Mutex::new(0);
static WAKE: Condvar = Condvar::new();

/// Tells the watchdog a command (with its own cgroup) starts: the fork-bomb pass resumes.
pub fn command_started() {
    *STARTED.lock().unwrap_or_else(|p| p.into_inner()) += 1;
    WAKE.notify_all();
}

/// When the OOM pass should run again: after the time `used` needs to reach `limit` at the
/// assumed growth (or twice `growth`, bytes/s, when faster), within [`OOM_MIN`]..[`OOM_MAX`].
pub fn oom_interval(limit: u64, used: u64, growth: u64) -> Duration {
    let speed = growth.saturating_mul(2).max(ASSUMED_GROWTH);
    let room = limit.saturating_sub(used);
    Duration::from_secs_f64(room as f64 / speed as f64).clamp(OOM_MIN, OOM_MAX)
}

/// When the fork-bomb pass should run again, given the largest command's processes (`None`:
/// no command runs, wait for one).
pub fn churn_interval(largest: usize, max: u64) -> Option<Duration> {
    match largest {
        0 => None,
        n if (n as u64) * 4 >= max => Some(CHURN_FAST),
        _ => Some(CHURN_SLOW),
    }
}

/// The OOM pass's state: the last used memory seen and when.
struct Oom {
    limit: u64,
    last: Option<(Instant, u64)>,
    last_kill: Option<limits::LastKill>,
}

impl Oom {
    /// Runs a pass; returns the delay until the next.
    fn pass(&mut self) -> Duration {
        let now = Instant::now();
        let Some(used) = limits::oom_pass(self.limit, &mut self.last_kill) else {
            return OOM_MAX;
        };
        let growth = match self.last {
            Some((t, prev)) if used > prev => {
                let dt = now.duration_since(t).as_secs_f64().max(1e-3);
                ((used - prev) as f64 / dt) as u64
            }
            _ => 0,
        };
        self.last = Some((now, used));
        oom_interval(self.limit, used, growth)
    }
}

/// Runs the watchdog (a thread of PID 1; returns at once when the sandbox has neither a
/// memory size nor per-command pids limits).
pub fn run() {
    let mut oom = limits::memory_limit().map(|limit| Oom {
        limit,
        last: None,
        last_kill: None,
    });
    let pids_max = limits::command_pids_max();
    if oom.is_none() && pids_max.is_none() {
        return;
    }
    let mut churn = HashMap::new();
    let now = Instant::now();
    let mut next_oom = oom.as_ref().map(|_| now);
    let mut next_churn = pids_max.map(|_| now);
    let mut seen = *STARTED.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        let now = Instant::now();
        if let (Some(o), Some(at)) = (oom.as_mut(), next_oom) {
            if at <= now {
                next_oom = Some(now + o.pass());
            }
        }
        if let (Some(max), Some(at)) = (pids_max, next_churn) {
            if at <= now {
                let largest = forkbomb::pass(max, &mut churn);
                next_churn = churn_interval(largest, max).map(|d| now + d);
            }
        }
        let deadline = [next_oom, next_churn].into_iter().flatten().min();
        let mut started = STARTED.lock().unwrap_or_else(|p| p.into_inner());
        while *started == seen {
            let timeout = match deadline {
                Some(d) => match d.checked_duration_since(Instant::now()) {
                    Some(t) if !t.is_zero() => t,
                    _ => break,
                },
                // Nothing to watch until a command starts.
                None => Duration::from_secs(3600),
            };
            started = WAKE
                .wait_timeout(started, timeout)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        if *started != seen {
            seen = *started;
            // A new command joins its cgroup right after: look at it soon.
            let soon = Instant::now() + CHURN_FAST;
            next_churn = pids_max.map(|_| next_churn.map_or(soon, |at| at.min(soon)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oom_interval_is_short_near_the_limit_and_long_far_from_it() {
        let mib = 1u64 << 20;
        // Idle 512 MiB sandbox using 30 MiB: ≈235 ms.
        let idle = oom_interval(512 * mib, 30 * mib, 0);
        assert!(idle > Duration::from_millis(200) && idle < Duration::from_millis(300));
        // A big sandbox far from its limit: the longest interval.
        assert_eq!(oom_interval(8192 * mib, 100 * mib, 0), OOM_MAX);
        // Near or over the limit: the shortest.
        assert_eq!(oom_interval(512 * mib, 510 * mib, 0), OOM_MIN);
        assert_eq!(oom_interval(512 * mib, 600 * mib, 0), OOM_MIN);
        // Growing fast: shorter than the assumed growth gives.
        let fast = oom_interval(512 * mib, 30 * mib, 4 << 30);
        assert!(fast < idle / 3, "{fast:?} vs {idle:?}");
    }

    #[test]
    fn churn_interval_follows_the_largest_command() {
        assert_eq!(churn_interval(0, 100), None);
        assert_eq!(churn_interval(3, 100), Some(CHURN_SLOW));
        assert_eq!(churn_interval(25, 100), Some(CHURN_FAST));
        assert_eq!(churn_interval(100, 100), Some(CHURN_FAST));
    }
}
