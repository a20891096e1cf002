//! The metrics history on disk: the samples each sandbox's [`super::ring::MetricRing`] keeps,
//! in the state database's `metric_samples` table (migration 7), so a restarted server still
//! has the history of its live and paused sandboxes. Written as the ring keeps a sample (and
//! rewritten when the ring thins itself out, so the table holds at most a ring's bound per
//! sandbox); read when a sandbox's ring is first needed in this process; deleted with the
//! sandbox.

use std::path::Path;
use std::sync::{Arc, Mutex};

use rusqlite::{params, Connection};

use super::ring::MetricSample;

/// A connection to the state database for the metrics history.
#[derive(Clone)]
pub struct MetricsDb(Arc<Mutex<Connection>>);

type Result<T> = std::result::Result<T, rusqlite::Error>;

fn insert(c: &Connection, id: &str, s: &MetricSample) -> Result<()> {
    c.prepare_cached(
        "INSERT OR REPLACE INTO metric_samples (sandbox_id, ts, cpu_count, cpu_used_pct, \
         mem_used, mem_total, mem_cache, disk_used, disk_total) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
    )?
    .execute(params![
        id,
        s.timestamp_ms,
        s.cpu_count,
        s.cpu_used_pct,
        s.mem_used as i64,
        s.mem_total as i64,
        s.mem_cache as i64,
        s.disk_used as i64,
        s.disk_total as i64,
    ])?;
    Ok(())
}

impl MetricsDb {
    /// Opens the state database at `path` (already migrated by the state store).
    pub fn open(path: &Path) -> Result<Self> {
        let c = Connection::open(path)?;
        c.busy_timeout(std::time::Duration::from_secs(10))?;
        c.pragma_update(None, "journal_mode", "WAL")?;
        Ok(Self(Arc::new(Mutex::new(c))))
    }

    /// Runs `f` on the connection on the blocking pool; errors are logged, not returned (the
    /// history in memory stays authoritative while the server runs).
    async fn run<T: Send + 'static>(
        &self,
        what: &'static str,
        f: impl FnOnce(&mut Connection) -> Result<T> + Send + 'static,
    ) -> Option<T> {
        let c = self.0.clone();
        let r = tokio::task::spawn_blocking(move || {
            let mut c = c.lock().unwrap_or_else(|p| p.into_inner());
            f(&mut c)
        })
        .await;
        match r {
            Ok(Ok(v)) => Some(v),
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "metrics history: {what}");
                None
            }
            Err(e) => {
                tracing::warn!(error = %e, "metrics history: {what}");
                None
            }
        }
    }

    /// Adds a sample of `id`.
    pub async fn add(&self, id: &str, s: MetricSample) {
        let id = id.to_string();
        self.run("adding a sample", move |c| insert(c, &id, &s))
            .await;
    }

    /// Replaces the samples of `id` with `samples` (after its ring thinned itself out).
    pub async fn replace(&self, id: &str, samples: Vec<MetricSample>) {
        let id = id.to_string();
        self.run("rewriting a history", move |c| {
            let tx = c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            tx.execute("DELETE FROM metric_samples WHERE sandbox_id = ?1", [&id])?;
            for s in &samples {
                insert(&tx, &id, s)?;
            }
            tx.commit()
        })
        .await;
    }

    /// The samples of `id`, oldest first.
    pub async fn load(&self, id: &str) -> Vec<MetricSample> {
        let id = id.to_string();
        self.run("reading a history", move |c| {
            let mut st = c.prepare_cached(
                "SELECT ts, cpu_count, cpu_used_pct, mem_used, mem_total, mem_cache, disk_used, \
                 disk_total FROM metric_samples WHERE sandbox_id = ?1 ORDER BY ts",
            )?;
            let rows = st.query_map([&id], |r| {
                Ok(MetricSample {
                    timestamp_ms: r.get(0)?,
                    cpu_count: r.get(1)?,
                    cpu_used_pct: r.get(2)?,
                    mem_used: r.get::<_, i64>(3)? as u64,
                    mem_total: r.get::<_, i64>(4)? as u64,
                    mem_cache: r.get::<_, i64>(5)? as u64,
                    disk_used: r.get::<_, i64>(6)? as u64,
                    disk_total: r.get::<_, i64>(7)? as u64,
                })
            })?;
            rows.collect::<Result<Vec<_>>>()
        })
        .await
        .unwrap_or_default()
    }

    /// Deletes the histories of `ids`.
    pub async fn delete(&self, ids: Vec<String>) {
        if ids.is_empty() {
            return;
        }
        self.run("deleting histories", move |c| {
            let tx = c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            for id in &ids {
                tx.execute("DELETE FROM metric_samples WHERE sandbox_id = ?1", [id])?;
            }
            tx.commit()
        })
        .await;
    }

    /// Deletes every history but those of `live` (sandboxes that ended while no server ran).
    pub async fn keep_only(&self, live: Vec<String>) {
        self.run("deleting ended sandboxes' histories", move |c| {
            let tx = c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            let ids: Vec<String> = {
                let mut st = tx.prepare("SELECT DISTINCT sandbox_id FROM metric_samples")?;
                let rows = st.query_map([], |r| r.get::<_, String>(0))?;
                rows.collect::<Result<Vec<_>>>()?
            };
            for id in ids.iter().filter(|id| !live.contains(id)) {
                tx.execute("DELETE FROM metric_samples WHERE sandbox_id = ?1", [id])?;
            }
            tx.commit()
        })
        .await;
    }
}
