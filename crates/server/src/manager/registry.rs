//! The manager's in-memory view of running sandboxes: a cache of the store's running rows
//! (filled by create and by recovery), consulted on every proxied request, plus per-sandbox
//! CPU samples for `cpuUsedPct`.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use crate::store::SandboxRecord;

struct Entry {
    record: SandboxRecord,
    last_cpu: Option<(Instant, u64)>,
}

#[derive(Default)]
pub(super) struct Registry {
    map: Mutex<HashMap<String, Entry>>,
}

impl Registry {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
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

    pub fn get(&self, id: &str) -> Option<SandboxRecord> {
        self.lock().get(id).map(|e| e.record.clone())
    }

    pub fn len(&self) -> usize {
        self.lock().len()
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
