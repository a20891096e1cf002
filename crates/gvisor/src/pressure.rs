//! The server's backstop against a sandbox's runtime reaching its host cgroup limits.
//!
//! Measured (runsc 0.0~20240729, systrap): every address space a sandbox creates gets a host
//! stub process, and released stubs go to a pool that is never shrunk while the sandbox runs.
//! A fork bomb held at its in-sandbox process cap keeps replacing its processes, and the pool
//! grows by ≈100 host tasks a second (≈128 KiB of host memory each once idle, ≈360 KiB while
//! the churn goes on) until the host cgroup's pids or memory limit kills the sentry. The
//! agent's fork-bomb detector kills such a command inside; this backstop tells the agent
//! (`SIGURG`, see `kiln_agent::relief`) to kill its biggest command
//! as soon as the host side passes a quarter of its task limit or half its memory limit,
//! and again each time either climbs a further 5 % (a starved agent may miss the first). Only
//! new highs count: the stub pool stays after the kill, and commands run after it must not be
//! taken for the culprit.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use super::oom_reserve::{OomReserve, Step};
use super::pressure_events::MemoryEvents;
use super::runsc::Runsc;

/// When a sandbox's host side first counts as under pressure: this fraction of `pids.max`.
const PIDS_START: (u64, u64) = (1, 4);
/// Signal again after a further climb of this fraction of the limit.
const PIDS_STEP: (u64, u64) = (1, 20);
/// Memory use (fraction of the host limit) from which a sandbox counts as under pressure. Half:
/// the host limit is 3 × the sandbox's size + 256 MiB, so this is far beyond what the sandbox
/// may use, and a fork loop whose processes hold memory (≈170 MiB/s of host memory) gets
/// ≈3.5 s more before the limit than from 70 % (the agent's relief only kills a command of 8
/// or more processes: a single memory hog is the OOM pass's).
const MEMORY_HIGH: (u64, u64) = (1, 2);

/// Why a sandbox the server killed when its host memory reserve ran out died.
pub const OOM_CAUSE: &str = "oom: out of host memory, and its reserve above the limit too";

/// The highest host task count and memory use each sandbox was signalled at, and the
/// sandboxes' memory-event watches (the check runs on each event, not only on the tick).
#[derive(Default)]
pub struct HostPressure {
    highs: Mutex<HashMap<(String, &'static str), u64>>,
    events: MemoryEvents,
    reserve: OomReserve,
    /// Containers killed because their memory reserve ran out.
    exhausted: Mutex<HashSet<String>>,
}

fn read_u64(paths: &[String]) -> Option<u64> {
    paths
        .iter()
        .filter_map(|p| std::fs::read_to_string(p).ok())
        .find_map(|v| v.trim().parse::<u64>().ok())
}

fn cgroup_file(id: &str, ctrl: &str, v1: &str, v2: &str) -> [String; 3] {
    [
        format!("/sys/fs/cgroup/{ctrl}/kiln/{id}/{v1}"),
        format!("/sys/fs/cgroup/kiln/{id}/{v2}"),
        format!("/sys/fs/cgroup/unified/kiln/{id}/{v2}"),
    ]
}

impl HostPressure {
    /// Forgets sandboxes not in `running` (container ids).
    pub fn retain(&self, running: &[String]) {
        let keep: HashSet<&str> = running.iter().map(String::as_str).collect();
        self.lock().retain(|(id, _), _| keep.contains(id.as_str()));
        self.events.retain(running);
        self.reserve.retain(running);
        self.exhausted
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|cid| keep.contains(cid.as_str()));
    }

    /// One tick for sandbox `id` (container `cid`): makes sure its host memory events are
    /// watched (each runs [`Self::respond`] at once) and responds.
    pub async fn tick(self: &Arc<Self>, runsc: &Runsc, id: &str, cid: &str) {
        let (me, rs, sid, c) = (
            Arc::clone(self),
            runsc.clone(),
            id.to_string(),
            cid.to_string(),
        );
        let new = self.events.ensure(cid, move || {
            let (me, rs, sid, c) = (me.clone(), rs.clone(), sid.clone(), c.clone());
            tokio::spawn(async move { me.respond(&rs, &sid, &c).await });
        });
        if new {
            self.reserve.arm(cid);
        }
        self.respond(runsc, id, cid).await;
    }

    /// Whether container `cid` was killed because its memory reserve ran out.
    pub fn ran_out(&self, cid: &str) -> bool {
        self.exhausted
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(cid)
    }

    /// The reserve first (a sandbox at its host memory limit), then the thresholds.
    async fn respond(&self, runsc: &Runsc, id: &str, cid: &str) {
        match self.reserve.step(cid) {
            Some(Step::Raised(from, to)) => {
                let why = format!(
                    "host memory limit of {} MiB reached, reserve up to {} MiB",
                    from >> 20,
                    to >> 20
                );
                relieve(runsc, id, cid, &why).await;
                return;
            }
            Some(Step::Exhausted(limit)) => {
                tracing::error!(
                    sandbox = %id,
                    "host memory reserve above {} MiB used up: killing the sandbox",
                    limit >> 20
                );
                self.exhausted
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(cid.to_string());
                super::oom_reserve::kill_all(cid);
                return;
            }
            Some(Step::Restored(limit)) => {
                tracing::info!(sandbox = %id, "host memory limit back at {} MiB", limit >> 20);
            }
            None => {}
        }
        if let Some(near) = self.check(cid) {
            relieve(runsc, id, cid, &near).await;
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(String, &'static str), u64>> {
        self.highs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether sandbox `id` should be relieved now, and why (for the log).
    pub fn check(&self, id: &str) -> Option<String> {
        let pids = read_u64(&cgroup_file(id, "pids", "pids.current", "pids.current"));
        let pids_max = read_u64(&cgroup_file(id, "pids", "pids.max", "pids.max"));
        if let (Some(n), Some(max)) = (pids, pids_max) {
            if self.climbed(id, "pids", n, max, PIDS_START) {
                return Some(format!("{n} of {max} host tasks"));
            }
        }
        let mem = read_u64(&cgroup_file(
            id,
            "memory",
            "memory.usage_in_bytes",
            "memory.current",
        ));
        // Page cache of the sandbox's files is reclaimable: not pressure (a sandbox reading a
        // lot must not get its biggest command killed).
        let mem = mem.map(|m| m.saturating_sub(super::oci::cgroup_file_cache(id).unwrap_or(0)));
        let mem_max = super::oci::cgroup_memory_limit(id);
        match (mem, mem_max) {
            (Some(m), Some(max)) if self.climbed(id, "memory", m, max, MEMORY_HIGH) => {
                Some(format!("{} of {} MiB host memory", m >> 20, max >> 20))
            }
            _ => None,
        }
    }

    /// Whether `n` of `max` is past `start` and a new high (by a step) of `what`.
    fn climbed(&self, id: &str, what: &'static str, n: u64, max: u64, start: (u64, u64)) -> bool {
        if max == 0 || !over(n, max, start) {
            return false;
        }
        let mut highs = self.lock();
        let step = max / PIDS_STEP.1 * PIDS_STEP.0;
        let k = (id.to_string(), what);
        match highs.get(&k) {
            Some(&high) if n < high + step => false,
            _ => {
                highs.insert(k, n);
                true
            }
        }
    }
}

/// Tells sandbox `id`'s agent to kill its biggest command, by process group
/// (`kiln_agent::relief`).
async fn relieve(runsc: &Runsc, id: &str, cid: &str, near: &str) {
    tracing::warn!(sandbox = %id, "host limits near ({near}): relieving");
    if let Err(e) = runsc.output(&["kill", cid, "URG"]).await {
        tracing::warn!(sandbox = %id, error = %e, "sending the host-pressure signal");
    }
}

/// `v >= max * num / den`.
fn over(v: u64, max: u64, (num, den): (u64, u64)) -> bool {
    u128::from(v) * u128::from(den) >= u128::from(max) * u128::from(num)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signals_from_a_quarter_then_on_each_step_up() {
        let p = HostPressure::default();
        let pids = |p: &HostPressure, id: &str, n| p.climbed(id, "pids", n, 2112, PIDS_START);
        assert!(!pids(&p, "a", 500), "under a quarter");
        assert!(pids(&p, "a", 528), "a quarter");
        assert!(!pids(&p, "a", 600), "less than a step higher");
        assert!(pids(&p, "a", 634), "a step higher");
        assert!(!pids(&p, "a", 634), "no climb");
        // A pool that stays up after the kill does not signal again until it climbs.
        assert!(!pids(&p, "a", 700));
        assert!(pids(&p, "b", 1000), "per sandbox");
        p.retain(&["b".to_string()]);
        assert!(pids(&p, "a", 634), "forgotten once gone");
        assert!(!p.climbed("z", "pids", 1, 0, PIDS_START));
    }

    #[test]
    fn memory_signals_from_half_on_new_highs_only() {
        let p = HostPressure::default();
        let mem = |p: &HostPressure, n| p.climbed("a", "memory", n, 1000, MEMORY_HIGH);
        assert!(!mem(&p, 499));
        assert!(mem(&p, 500));
        // Memory that stays high (the stub pool after a kill) does not signal again.
        assert!(!mem(&p, 520));
        assert!(!mem(&p, 500));
        assert!(mem(&p, 550));
        // Pids and memory are tracked apart.
        assert!(p.climbed("a", "pids", 600, 2112, PIDS_START));
    }
}
