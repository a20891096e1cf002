//! The manager's in-memory view of running sandboxes: a cache of the store's running rows
//! (filled by create and by recovery), consulted on every proxied request, plus per-sandbox
//! CPU samples for `cpuUsedPct`. While recovery runs in the background after a restart, the
//! ids it has yet to look at are *pending*: requests for them wait until they are settled.
//! A sandbox whose kill has answered while its teardown runs in the background is *tearing
//! down*: gone for every request, still counted against the server's sandbox limit.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::store::SandboxRecord;

struct Entry {
    record: SandboxRecord,
    last_cpu: Option<(Instant, u64)>,
}

#[derive(Default)]
pub(super) struct Registry {
    map: Mutex<HashMap<String, Entry>>,
    /// Ids recovery has not settled yet (adopted or cleaned up).
    pending: Mutex<HashSet<String>>,
    settled: tokio::sync::Notify,
    /// Ids removed by a kill whose teardown is still running (see `manager/teardown.rs`).
    tearing: Mutex<HashSet<String>>,
    torn_down: tokio::sync::Notify,
}

impl Registry {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn pending(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Marks `ids` as not yet settled by recovery.
    pub fn mark_pending(&self, ids: impl IntoIterator<Item = String>) {
        self.pending().extend(ids);
    }

    /// Recovery is done with `id` (adopted, or cleaned up): waiters wake.
    pub fn settle(&self, id: &str) {
        self.pending().remove(id);
        self.settled.notify_waiters();
    }

    /// Number of ids recovery has not settled yet.
    pub fn pending_len(&self) -> usize {
        self.pending().len()
    }

    /// Waits (at most `limit`) until recovery has settled `id`; false on timeout.
    pub async fn wait_settled(&self, id: &str, limit: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let notified = self.settled.notified();
            tokio::pin!(notified);
            // Registered before the check, so a settle in between is not missed.
            notified.as_mut().enable();
            if !self.pending().contains(id) {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return false;
            }
        }
    }

    pub fn insert(&self, record: SandboxRecord) {
        self.lock().insert(
            record.id.clone(),
            Entry {
                record,
                last_cpu: None,
            },
        );
    }

    pub fn remove(&self, id: &str) -> Option<SandboxRecord> {
        self.lock().remove(id).map(|e| e.record)
    }

    fn tearing(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.tearing.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Removes running `id` and marks it as tearing down, in one step (so it is never
    /// counted twice nor missed by [`Self::len`]); None when it is not running.
    pub fn begin_teardown(&self, id: &str) -> Option<SandboxRecord> {
        let mut map = self.lock();
        let e = map.remove(id)?;
        self.tearing().insert(id.to_string());
        Some(e.record)
    }

    /// The teardown of `id` is done: it no longer counts.
    pub fn end_teardown(&self, id: &str) {
        self.tearing().remove(id);
        self.torn_down.notify_waiters();
    }

    /// Sandboxes whose teardown is still running.
    pub fn tearing_len(&self) -> usize {
        self.tearing().len()
    }

    /// Waits (at most `limit`) until no teardown runs; false on timeout.
    pub async fn wait_torn_down(&self, limit: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let notified = self.torn_down.notified();
            tokio::pin!(notified);
            // Registered before the check, so an end in between is not missed.
            notified.as_mut().enable();
            if self.tearing().is_empty() {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return false;
            }
        }
    }

    pub fn get(&self, id: &str) -> Option<SandboxRecord> {
        self.lock().get(id).map(|e| e.record.clone())
    }

    /// Running sandboxes plus those still tearing down: what holds host resources.
    pub fn len(&self) -> usize {
        let map = self.lock();
        map.len() + self.tearing().len()
    }

    /// Running sandboxes, oldest first.
    pub fn list(&self) -> Vec<SandboxRecord> {
        let mut v: Vec<SandboxRecord> = self.lock().values().map(|e| e.record.clone()).collect();
        v.sort_by(|a, b| (a.started_at_ms, &a.id).cmp(&(b.started_at_ms, &b.id)));
        v
    }

    /// Applies `f` to the record of `id`; None when it is not running.
    pub fn update<T>(&self, id: &str, f: impl FnOnce(&mut SandboxRecord) -> T) -> Option<T> {
        self.lock().get_mut(id).map(|e| f(&mut e.record))
    }

    /// CPU percentage of `id` since its previous sample (0 on the first).
    pub fn cpu_pct(&self, id: &str, cpu_ns: u64, cpus: u32) -> f64 {
        let mut map = self.lock();
        let Some(e) = map.get_mut(id) else {
            return 0.0;
        };
        let now = Instant::now();
        let pct = match e.last_cpu {
            Some((t, prev)) if cpu_ns >= prev => {
                let wall = now.duration_since(t).as_nanos() as f64;
                if wall > 0.0 {
                    ((cpu_ns - prev) as f64 / wall / f64::from(cpus.max(1)) * 100.0).min(100.0)
                } else {
                    0.0
                }
            }
            _ => 0.0,
        };
        e.last_cpu = Some((now, cpu_ns));
        pct
    }
}
