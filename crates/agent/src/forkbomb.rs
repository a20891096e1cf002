//! The agent's fork-bomb killer (one pass per tick of [`crate::watchdog`]).
//!
//! gVisor caps a command's processes at its cgroup's `pids.max`, but a fork bomb's churn at the
//! cap (processes forking and exiting as fast as slots free up) piles up host tasks and memory
//! of the sentry that the sandbox's accounting does not see (systrap's stub pool, ≈100 host
//! tasks a second), until the sentry dies at its host limits. The churn also starves the agent,
//! so whatever it does must be cheap and come first:
//!
//! 1. **Freeze at the cap.** A command whose `pids.current` reaches its cap gets `pids.max` = 1
//!    at once (one read and one write; gVisor accepts a limit below the current count): every
//!    further fork fails with `EAGAIN`, bash backs off and sleeps, and the churn — the only thing
//!    that grows the host side — stops.
//! 2. **Judge while frozen.** A fork bomb's processes keep exiting (their forks done, their
//!    pipelines ending) and nothing replaces them; a flood at the cap (400 `sleep`s) loses
//!    none. A command that lost more than a quarter of its cap within [`WINDOW`] (before or
//!    during the freeze) is killed, all of it, by process group first
//!    ([`crate::cmd_cgroups::kill_tree`]); the console says `kiln-agent: Fork bomb: killed command …`.
//! 3. **Thaw, or kill a busy loop.** A command frozen for [`HOLD`] without losing processes is
//!    not churning. If most of its processes are running rather than waiting ([`busy`], a
//!    sample of their `/proc/<pid>/stat` states), it is a loop that keeps forking at its limit
//!    (`perl -e 'fork while 1'`: its processes never exit, every fork fails and is tried again
//!    at once) and is killed (`kiln-agent: Fork loop: killed command …`). Otherwise (a flood of
//!    `sleep`s) its cap is restored: it stays held at the cap as before, and is frozen again if
//!    it is still there at the next pass.

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::cmd_cgroups::{commands, members, pids_current, set_max, PIDS_ROOT};

/// The window over which a command's lost processes are counted.
pub const WINDOW: Duration = Duration::from_secs(2);
/// How long a frozen command that loses nothing stays frozen.
pub const HOLD: Duration = Duration::from_secs(2);

/// What a pass does to one command cgroup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    None,
    Freeze,
    Kill,
    Thaw,
}

/// Whether `current` processes count as at the cap `max` (95 %: gVisor's count hovers and
/// overshoots around its limit).
pub fn at_cap(current: u64, max: u64) -> bool {
    current * 20 >= max * 19
}

/// One command cgroup's recent history.
#[derive(Default)]
pub struct Churn {
    seen: HashSet<i32>,
    /// (when, processes gone since the sample before) within the window.
    gone: VecDeque<(Instant, usize)>,
    frozen_at: Option<Instant>,
}

impl Churn {
    /// How long the command has been frozen (for the console line).
    pub fn frozen_for(&self, now: Instant) -> Option<Duration> {
        self.frozen_at.map(|t| now.duration_since(t))
    }
}

impl Churn {
    /// Decides before the (costlier) member listing: kill a command at more than twice its
    /// cap (gVisor's limit is not strict: many processes forking at once overrun it, a `perl
    /// -e 'fork while 1'` reached 1,286 for a cap of 160), freeze one that reached its cap.
    pub fn on_count(&mut self, now: Instant, current: u64, max: u64) -> Action {
        if current > max * 2 {
            return Action::Kill;
        }
        if self.frozen_at.is_none() && at_cap(current, max) {
            self.frozen_at = Some(now);
            return Action::Freeze;
        }
        Action::None
    }

    /// Records the cgroup's members and decides: kill a frozen command that lost more than a
    /// quarter of `max` processes within the window, thaw one frozen for [`HOLD`] without.
    pub fn on_members(&mut self, now: Instant, pids: &[i32], max: u64) -> Action {
        let now_set: HashSet<i32> = pids.iter().copied().collect();
        let gone = self.seen.difference(&now_set).count();
        self.seen = now_set;
        self.gone.push_back((now, gone));
        while self
            .gone
            .front()
            .is_some_and(|(t, _)| now.duration_since(*t) > WINDOW)
        {
            self.gone.pop_front();
        }
        let Some(since) = self.frozen_at else {
            return Action::None;
        };
        let lost: usize = self.gone.iter().map(|(_, n)| n).sum();
        if lost as u64 * 4 > max {
            Action::Kill
        } else if now.duration_since(since) >= HOLD {
            self.frozen_at = None;
            self.gone.clear();
            Action::Thaw
        } else {
            Action::None
        }
    }
}

/// Members sampled by [`busy`].
const BUSY_SAMPLE: usize = 16;

/// The scheduler state letter of a `/proc/<pid>/stat` text (after the command name, which may
/// hold spaces and parentheses).
pub fn stat_state(stat: &str) -> Option<char> {
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// Whether most of a sample of `pids` are running (state `R`) rather than waiting: a flood of
/// `sleep`s held at its cap waits, a fork loop at its cap keeps trying and runs.
pub fn busy(pids: &[i32]) -> bool {
    let step = (pids.len() / BUSY_SAMPLE).max(1);
    let (mut seen, mut running) = (0, 0);
    for pid in pids.iter().step_by(step).take(BUSY_SAMPLE) {
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        seen += 1;
        if stat_state(&stat) == Some('R') {
            running += 1;
        }
    }
    seen > 0 && running * 2 >= seen
}

/// One pass over the command cgroups, `max` being each one's cap. Returns the largest number of
/// processes a live command has (0: no command runs).
pub fn pass(max: u64, churn: &mut HashMap<PathBuf, Churn>) -> usize {
    let dirs = commands(Path::new(PIDS_ROOT));
    let now = Instant::now();
    // Freeze first, every command at its cap, before listing any members.
    let mut counts = Vec::with_capacity(dirs.len());
    for dir in dirs {
        let Some(n) = pids_current(&dir) else {
            continue;
        };
        if n == 0 {
            continue;
        }
        match churn.entry(dir.clone()).or_default().on_count(now, n, max) {
            Action::Freeze => set_max(&dir, 1),
            Action::Kill => {
                set_max(&dir, 1);
                crate::kills::kill_command(
                    crate::kills::Reason::Pids,
                    &dir,
                    "Fork bomb",
                    format!("{n} processes, over twice its limit of {max}"),
                );
                churn.remove(&dir);
                continue;
            }
            Action::None | Action::Thaw => {}
        }
        counts.push((dir, n));
    }
    let live: HashSet<PathBuf> = counts.iter().map(|(d, _)| d.clone()).collect();
    churn.retain(|d, _| live.contains(d));
    let mut largest = 0;
    for (dir, n) in counts {
        largest = largest.max(n as usize);
        let Some(c) = churn.get_mut(&dir) else {
            continue;
        };
        let pids = members(&dir);
        let frozen = c.frozen_for(now).unwrap_or_default();
        match c.on_members(now, &pids, max) {
            Action::Kill => {
                crate::kills::kill_command(
                    crate::kills::Reason::Pids,
                    &dir,
                    "Fork bomb",
                    format!(
                        "{n} processes at its limit of {max}, replacing themselves; held for \
                         {} ms",
                        frozen.as_millis()
                    ),
                );
                churn.remove(&dir);
            }
            // Held at its cap with its processes running, not waiting: a loop forking at its
            // limit (`perl -e 'fork while 1'`), each fork failing and tried again at once.
            Action::Thaw if busy(&pids) => {
                crate::kills::kill_command(
                    crate::kills::Reason::Pids,
                    &dir,
                    "Fork loop",
                    format!(
                        "{n} processes held at its limit of {max} for {} ms, busy forking",
                        frozen.as_millis()
                    ),
                );
                churn.remove(&dir);
            }
            Action::Thaw => set_max(&dir, max),
            Action::None | Action::Freeze => {}
        }
    }
    largest
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(t0: Instant, ms: u64) -> Instant {
        t0 + Duration::from_millis(ms)
    }

    #[test]
    fn a_flood_at_the_cap_is_frozen_then_thawed_never_killed() {
        let t0 = Instant::now();
        let mut c = Churn::default();
        let mut actions = vec![];
        for i in 0..40u64 {
            let n = (i * 10).min(105);
            let pids: Vec<i32> = (1..=n as i32).collect();
            let a = c.on_count(ms(t0, i * 100), n, 100);
            if a != Action::None {
                actions.push((i, a));
            }
            let a = c.on_members(ms(t0, i * 100), &pids, 100);
            assert_ne!(a, Action::Kill, "at {i}");
            if a != Action::None {
                actions.push((i, a));
            }
        }
        // Frozen on reaching 95, thawed after the hold, frozen again at the next pass.
        assert_eq!(actions[0], (10, Action::Freeze));
        assert_eq!(actions[1], (30, Action::Thaw));
        assert_eq!(actions[2], (31, Action::Freeze));
    }

    #[test]
    fn a_bomb_is_frozen_at_once_and_killed_when_it_loses_processes() {
        let t0 = Instant::now();
        let mut c = Churn::default();
        // First seen already at the cap (a starved agent): frozen on that very pass.
        let pids: Vec<i32> = (1000..1098).collect();
        assert_eq!(c.on_count(t0, 98, 100), Action::Freeze);
        assert_eq!(c.on_members(t0, &pids, 100), Action::None);
        // Frozen, its processes end without replacement: 30 gone is more than a quarter.
        let pids: Vec<i32> = (1030..1098).collect();
        assert_eq!(c.on_count(ms(t0, 300), 68, 100), Action::None);
        assert_eq!(c.on_members(ms(t0, 300), &pids, 100), Action::Kill);
    }

    #[test]
    fn a_command_far_over_its_cap_is_killed_at_once() {
        let mut c = Churn::default();
        assert_eq!(c.on_count(Instant::now(), 200, 100), Action::Freeze);
        assert_eq!(c.on_count(Instant::now(), 201, 100), Action::Kill);
    }

    #[test]
    fn churn_below_the_cap_is_left_alone() {
        let t0 = Instant::now();
        let mut c = Churn::default();
        for i in 0..30u64 {
            let base = i as i32 * 1000;
            let pids: Vec<i32> = (base..base + 40).collect();
            assert_eq!(c.on_count(ms(t0, i * 100), 40, 100), Action::None);
            assert_eq!(c.on_members(ms(t0, i * 100), &pids, 100), Action::None);
        }
    }

    #[test]
    fn stat_state_skips_odd_command_names() {
        assert_eq!(stat_state("42 (perl) R 1 42 42 0"), Some('R'));
        assert_eq!(stat_state("7 (a) b) S 1 7"), Some('S'));
        assert_eq!(stat_state("garbage"), None);
    }

    #[test]
    fn sleeping_processes_are_not_busy() {
        let mut kids: Vec<_> = (0..3)
            .map(|_| {
                std::process::Command::new("sleep")
                    .arg("5")
                    .spawn()
                    .unwrap()
            })
            .collect();
        std::thread::sleep(Duration::from_millis(100));
        let pids: Vec<i32> = kids.iter().map(|k| k.id() as i32).collect();
        assert!(!busy(&pids));
        assert!(!busy(&[]));
        // Spinning ones are (runnable counts as R).
        let mut spin: Vec<_> = (0..3)
            .map(|_| {
                std::process::Command::new("sh")
                    .args(["-c", "while :; do :; done"])
                    .spawn()
                    .unwrap()
            })
            .collect();
        std::thread::sleep(Duration::from_millis(100));
        let pids: Vec<i32> = spin.iter().map(|k| k.id() as i32).collect();
        assert!(busy(&pids));
        for k in kids.iter_mut().chain(spin.iter_mut()) {
            let _ = k.kill();
            let _ = k.wait();
        }
    }

    #[test]
    fn at_cap_allows_for_gvisor_hovering_below_the_limit() {
        assert!(!at_cap(151, 160));
        assert!(at_cap(152, 160));
        assert!(at_cap(175, 160));
    }
}
