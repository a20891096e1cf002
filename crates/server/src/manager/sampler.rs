//! The metrics sampler: every `metrics_interval` it samples each running sandbox (the
//! driver's stats and the agent's `/metrics`) into the sandbox's [`MetricRing`], which lives
//! as long as the sandbox (kept while it is paused). It also notices sandboxes that stopped on
//! their own and ends them with a `died` (or `oom`) event.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use futures::StreamExt;

use super::{Manager, MetricSample};
use crate::error::Result;
use crate::obs::persist::MetricsDb;
use crate::obs::ring::{MetricRing, Pushed};
use crate::obs::Telemetry;
use crate::store::{now_ms, SandboxRecord, SandboxState};

/// How many sandboxes are sampled at once.
const SAMPLE_CONCURRENCY: usize = 4;

/// Every sandbox's metrics history, and where it is kept on disk (if anywhere).
#[derive(Default)]
pub(super) struct History {
    rings: Mutex<HashMap<String, MetricRing>>,
    db: OnceLock<MetricsDb>,
    /// Sandboxes whose death check (after a failed sample) is under way.
    checking: Mutex<HashSet<String>>,
}

impl History {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, MetricRing>> {
        self.rings.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn checking(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.checking.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Manager {
    /// Keeps the metrics history in `db` from now on (once; later calls are ignored).
    pub fn set_metrics_db(&self, db: MetricsDb) {
        let _ = self.history.db.set(db);
    }

    /// Makes sure the ring of `id` is in memory: read back from disk the first time it is
    /// needed in this process (a sandbox from before a restart).
    async fn load_history(&self, id: &str) {
        let Some(db) = self.history.db.get() else {
            return;
        };
        if self.history.lock().contains_key(id) {
            return;
        }
        let samples = db.load(id).await;
        let cap = self.cfg.metrics_capacity;
        self.history
            .lock()
            .entry(id.to_string())
            .or_insert_with(|| MetricRing::restore(cap, samples));
    }

    /// Deletes the stored histories of sandboxes that are gone (after recovery: those that
    /// ended while no server ran).
    pub async fn sweep_metrics_history(&self) {
        if let Some(db) = self.history.db.get() {
            let live = self.registry.list().into_iter().map(|r| r.id).collect();
            db.keep_only(live).await;
        }
    }

    /// The server's counters (Prometheus `/metrics`).
    pub fn telemetry(&self) -> &Arc<Telemetry> {
        self.outlets.telemetry()
    }

    /// How long a sample waits for the agent's answer: in a sandbox whose CPUs are all busy
    /// the agent may answer seconds late, and a sample that waited for it would be late too
    /// (rules that need a sample every interval would see a gap).
    fn agent_wait(&self) -> Duration {
        self.cfg
            .metrics_interval
            .clamp(Duration::from_millis(500), Duration::from_secs(2))
    }

    /// Takes one sample of the running sandbox `r` (not recorded), and whether its agent
    /// answered or was only slow (not failed). The agent is asked under the lifecycle lock,
    /// so no agent call is in flight while a pause, snapshot or fork detaches the agent's
    /// sockets; a sandbox no longer running is not asked (Conflict).
    ///
    /// CPU and the memory size come from the driver (read without spawning a process), and
    /// the sample is stamped with the time they were read; the memory in use is the guest's
    /// own view, which only the guest kernel knows, through the agent (its `/proc/meminfo`),
    /// or the host's charge for the sandbox when the agent does not answer within
    /// [`Self::agent_wait`] (the disk figures are then the previous sample's).
    async fn take_sample(&self, r: &SandboxRecord) -> Result<(MetricSample, bool)> {
        let standby =
            || crate::error::Error::Conflict(format!("sandbox \"{}\" is in standby", r.id));
        if self.idle.standby_since(&r.id).is_some() {
            return Err(standby());
        }
        let stats = self.driver.stats(&r.id).await?;
        // At once: the CPU time is set against the time it was read at.
        let taken_at = now_ms();
        let pct = self.registry.cpu_pct(&r.id, stats.cpu_ns, r.cpu_count);
        let asked = tokio::time::timeout(self.agent_wait(), async {
            // This sandbox alone: samples of others go on at once.
            let _guard = self.hold_one(&r.id).await;
            if self.idle.standby_since(&r.id).is_some() {
                return Err(standby());
            }
            if self.registry.get(&r.id).map(|r| r.state) != Some(SandboxState::Running) {
                return Err(crate::error::Error::Conflict(format!(
                    "sandbox \"{}\" is not running",
                    r.id
                )));
            }
            Ok(self.agent(&r.id, r.envd_token.clone()).metrics().await)
        })
        .await;
        let (agent, answered) = match asked {
            Ok(Err(e)) => return Err(e),
            Ok(Ok(Ok(m))) => (Some(m), true),
            Ok(Ok(Err(_))) => {
                Telemetry::add(&self.telemetry().agent_errors, 1);
                (None, false)
            }
            // Slow, not gone: no death check.
            Err(_) => (None, true),
        };
        if let Some(m) = &agent {
            self.report_kills(r, &m.kiln_kills).await;
        }
        let (disk_used, disk_total, mem_cache, mem_used) = match agent {
            Some(m) => (
                m.disk_used,
                m.disk_total,
                m.mem_cache,
                match m.mem_used {
                    0 => stats.mem_used_bytes,
                    n => n,
                },
            ),
            None => {
                let last = self
                    .history
                    .lock()
                    .get(&r.id)
                    .and_then(|ring| ring.latest().cloned());
                match last {
                    Some(l) => (l.disk_used, l.disk_total, 0, stats.mem_used_bytes),
                    None => (0, u64::from(r.disk_size_mb) << 20, 0, stats.mem_used_bytes),
                }
            }
        };
        // The sandbox's size as recorded; the driver's limit only for a sandbox without one.
        // (The host limit is the size plus headroom whose formula changed over time, so a
        // sandbox started by an older server would report an old ceiling.)
        let mem_total = if r.memory_mb > 0 {
            u64::from(r.memory_mb) << 20
        } else if stats.mem_limit_bytes > 0 && stats.mem_limit_bytes < u64::MAX / 2 {
            stats.mem_limit_bytes
        } else {
            0
        };
        let sample = MetricSample {
            timestamp_ms: taken_at,
            cpu_count: r.cpu_count,
            cpu_used_pct: pct,
            mem_used,
            mem_total,
            // The guest's own page cache (tmpfs and the file data the guest kernel caches in
            // its memory) and the host's cache of the sandbox's files (written through to the
            // host by the runtime): disjoint, as the first is in the guest's memory.
            mem_cache: mem_cache.saturating_add(stats.mem_cache_bytes),
            disk_used,
            disk_total,
        };
        Ok((sample, answered))
    }

    /// Samples `r` and records the sample in its history; also says whether its agent
    /// answered (or was only slow).
    async fn sample_into_history(&self, r: &SandboxRecord) -> Result<(MetricSample, bool)> {
        let t0 = std::time::Instant::now();
        let (s, answered) = self.take_sample(r).await?;
        let t1 = std::time::Instant::now();
        self.load_history(&r.id).await;
        let cap = self.cfg.metrics_capacity;
        let (pushed, kept) = {
            let mut h = self.history.lock();
            let ring = h
                .entry(r.id.clone())
                .or_insert_with(|| MetricRing::new(cap));
            let pushed = ring.push(s.clone());
            (pushed, (pushed == Pushed::Thinned).then(|| ring.kept()))
        };
        if let Some(db) = self.history.db.get() {
            match (pushed, kept) {
                (Pushed::Thinned, Some(all)) => db.replace(&r.id, all).await,
                (Pushed::Kept, _) => db.add(&r.id, s.clone()).await,
                _ => {}
            }
        }
        // A late sample leaves a gap in the history that rules over it see.
        if t0.elapsed() > self.agent_wait() + Duration::from_secs(1) {
            tracing::warn!(
                sandbox = %r.id,
                sample_ms = (t1 - t0).as_millis() as u64,
                history_ms = t1.elapsed().as_millis() as u64,
                "a metrics sample was late"
            );
        }
        Ok((s, answered))
    }

    /// One round of the sampler: every running sandbox sampled, histories of ended sandboxes
    /// dropped, sandboxes found stopped ended.
    pub async fn sample_all(&self) {
        for id in self.sample_round().await {
            self.check_alive(&id).await;
        }
    }

    /// [`Self::sample_all`] without the death checks: the sandboxes whose sample failed.
    async fn sample_round(&self) -> Vec<String> {
        let live = self.registry.list();
        let gone: Vec<String> = {
            let ids: std::collections::HashSet<&str> = live.iter().map(|r| r.id.as_str()).collect();
            let mut h = self.history.lock();
            let gone = h
                .keys()
                .filter(|id| !ids.contains(id.as_str()))
                .cloned()
                .collect();
            h.retain(|id, _| ids.contains(id.as_str()));
            self.kill_marks.retain(&ids);
            gone
        };
        if let Some(db) = self.history.db.get() {
            db.delete(gone).await;
        }
        let running: Vec<SandboxRecord> = live
            .into_iter()
            .filter(|r| {
                r.state == SandboxState::Running && self.idle.standby_since(&r.id).is_none()
            })
            .collect();
        futures::stream::iter(running)
            .map(|r| async move {
                // A sandbox whose agent did not answer may have stopped: the driver's host
                // numbers alone do not tell (its cgroup outlives its runtime until cleanup).
                match self.sample_into_history(&r).await {
                    Err(crate::error::Error::Conflict(_)) | Ok((_, true)) => None,
                    Err(_) | Ok((_, false)) => Some(r.id),
                }
            })
            .buffer_unordered(SAMPLE_CONCURRENCY)
            .filter_map(|x| async move { x })
            .collect()
            .await
    }

    /// After a failed sample: ends `id` with `died` (or `oom`) when it is no longer running
    /// although nothing paused or killed it.
    async fn check_alive(&self, id: &str) {
        // Pause, snapshot and fork hold this lock while the sandbox is briefly not running;
        // held until the sandbox is ended, so no resume or capture comes between the verdict
        // and the end.
        let _guard = self.lifecycle_lock.write().await;
        let stopped = {
            // (A sandbox in standby is paused on purpose.)
            let running_here = self
                .registry
                .get(id)
                .is_some_and(|r| r.state == SandboxState::Running)
                && self.idle.standby_since(id).is_none();
            let mut stopped = running_here;
            // Asked twice, a second apart, so one slow answer from the runtime is not a death.
            for i in 0..2 {
                if !stopped {
                    break;
                }
                if i > 0 {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                stopped = matches!(self.driver.is_running(id).await, Ok(false));
            }
            stopped
        };
        if !stopped {
            return;
        }
        let last = self
            .history
            .lock()
            .get(id)
            .and_then(|r| r.latest().cloned());
        let (kind, why) = match (self.driver.death_cause(id), last) {
            // The driver ended it (its host memory reserve ran out): as the watcher says.
            (Some(cause), _) => ("died", format!("died: {cause}")),
            (None, Some(s))
                if s.mem_total > 0 && s.mem_used.saturating_mul(10) >= s.mem_total * 9 =>
            {
                (
                    "oom",
                    format!(
                        "the sandbox stopped while using {} of its {} MiB of memory",
                        s.mem_used >> 20,
                        s.mem_total >> 20
                    ),
                )
            }
            _ => ("died", "the sandbox stopped on its own".to_string()),
        };
        if let Err(e) = self.end(id, kind, &why).await {
            tracing::warn!(sandbox = id, error = %e, "cleaning up a sandbox that stopped");
        }
    }

    /// Runs [`Self::sample_all`] every `metrics_interval`, each death check on its own task:
    /// a check waits for the lifecycle lock and asks the runtime, which on a busy host can take
    /// seconds the other sandboxes' next samples should not wait for.
    pub fn spawn_sampler(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let me = Arc::clone(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(me.cfg.metrics_interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                for id in me.sample_round().await {
                    if !me.history.checking().insert(id.clone()) {
                        continue;
                    }
                    let me = Arc::clone(&me);
                    tokio::spawn(async move {
                        me.check_alive(&id).await;
                        me.history.checking().remove(&id);
                    });
                }
            }
        })
    }

    /// `GET /sandboxes/{id}/metrics?start&end`: the samples of `id` taken between `start_ms`
    /// (default: its start) and `end_ms` (default: now). Without an end, a running sandbox
    /// whose newest sample is older than the interval is sampled first.
    pub async fn metrics_window(
        &self,
        id: &str,
        start_ms: Option<i64>,
        end_ms: Option<i64>,
    ) -> Result<Vec<MetricSample>> {
        let r = self.get(id)?;
        self.load_history(id).await;
        if end_ms.is_none() && r.state == SandboxState::Running {
            let stale = self
                .history
                .lock()
                .get(id)
                .and_then(|ring| ring.latest().map(|s| s.timestamp_ms))
                .is_none_or(|t| now_ms() - t >= self.cfg.metrics_interval.as_millis() as i64);
            if stale {
                // A sandbox mid-pause cannot be sampled: show what there is.
                let _ = self.sample_into_history(&r).await;
            }
        }
        let start = start_ms.unwrap_or(r.started_at_ms);
        let end = end_ms.unwrap_or(i64::MAX);
        Ok(self
            .history
            .lock()
            .get(id)
            .map(|ring| ring.window(start, end))
            .unwrap_or_default())
    }

    /// `GET /sandboxes/metrics?sandbox_ids=`: the newest sample of each of `ids` that is
    /// running or paused (unknown ids are left out).
    pub async fn latest_metrics(&self, ids: &[String]) -> BTreeMap<String, MetricSample> {
        let mut out = BTreeMap::new();
        for id in ids {
            let Ok(r) = self.get(id) else { continue };
            self.load_history(id).await;
            let latest = self
                .history
                .lock()
                .get(id)
                .and_then(|g| g.latest().cloned());
            let s = match latest {
                Some(s) => Some(s),
                None if r.state == SandboxState::Running => {
                    self.sample_into_history(&r).await.ok().map(|(s, _)| s)
                }
                None => None,
            };
            if let Some(s) = s {
                out.insert(id.clone(), s);
            }
        }
        out
    }
}

impl Manager {
    /// The newest sample of every running or paused sandbox.
    pub fn latest_samples(&self) -> Vec<(String, MetricSample)> {
        self.history
            .lock()
            .iter()
            .filter_map(|(id, r)| r.latest().map(|s| (id.clone(), s.clone())))
            .collect()
    }

    /// Free bytes on the file system of the state directory (sandbox layers).
    pub fn state_disk_free(&self) -> Option<u64> {
        let dir = self
            .cfg
            .admission
            .state_dir
            .clone()
            .unwrap_or_else(|| std::path::PathBuf::from("/"));
        kiln_host::capacity::read_limits(&dir).disk_free_bytes
    }
}
