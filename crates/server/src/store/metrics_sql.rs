//! The `metric_samples` table (migration 7) behind [`MetricsStore`]: a connection of its own
//! to the state database, each call run on the blocking pool.

use std::path::Path;

use rusqlite::{params, Connection, TransactionBehavior};

use crate::obs::ring::MetricSample;

use super::aggregates::MetricsStore;
use super::side_db::SideDb;
use super::Result;

/// The SQLite [`MetricsStore`].
pub struct SqliteMetricsStore(SideDb);

impl SqliteMetricsStore {
    /// Opens the metrics history of the (already migrated) state database at `path`.
    pub fn open(path: &Path) -> Result<Self> {
        SideDb::open(path).map(Self)
    }

    /// An in-memory database with the current schema (tests).
    pub fn open_in_memory() -> Result<Self> {
        SideDb::open_in_memory().map(Self)
    }
}

fn insert(c: &Connection, id: &str, s: &MetricSample) -> rusqlite::Result<()> {
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

#[async_trait::async_trait]
impl MetricsStore for SqliteMetricsStore {
    async fn add_sample(&self, id: &str, s: MetricSample) -> Result<()> {
        let id = id.to_string();
        self.0.run(move |c| Ok(insert(c, &id, &s)?)).await
    }

    async fn replace_samples(&self, id: &str, samples: Vec<MetricSample>) -> Result<()> {
        let id = id.to_string();
        self.0
            .run(move |c| {
                let tx = c.transaction_with_behavior(TransactionBehavior::Immediate)?;
                tx.execute("DELETE FROM metric_samples WHERE sandbox_id = ?1", [&id])?;
                for s in &samples {
                    insert(&tx, &id, s)?;
                }
                Ok(tx.commit()?)
            })
            .await
    }

    async fn samples(&self, id: &str) -> Result<Vec<MetricSample>> {
        let id = id.to_string();
        self.0
            .run(move |c| {
                let mut st = c.prepare_cached(
                    "SELECT ts, cpu_count, cpu_used_pct, mem_used, mem_total, mem_cache, \
                     disk_used, disk_total FROM metric_samples WHERE sandbox_id = ?1 ORDER BY ts",
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
                Ok(rows.collect::<rusqlite::Result<Vec<_>>>()?)
            })
            .await
    }

    async fn delete_samples(&self, ids: Vec<String>) -> Result<()> {
        self.0
            .run(move |c| {
                let tx = c.transaction_with_behavior(TransactionBehavior::Immediate)?;
                for id in &ids {
                    tx.execute("DELETE FROM metric_samples WHERE sandbox_id = ?1", [id])?;
                }
                Ok(tx.commit()?)
            })
            .await
    }

    async fn keep_only(&self, live: Vec<String>) -> Result<()> {
        self.0
            .run(move |c| {
                let tx = c.transaction_with_behavior(TransactionBehavior::Immediate)?;
                let ids: Vec<String> = {
                    let mut st = tx.prepare("SELECT DISTINCT sandbox_id FROM metric_samples")?;
                    let rows = st.query_map([], |r| r.get::<_, String>(0))?;
                    rows.collect::<rusqlite::Result<Vec<_>>>()?
                };
                for id in ids.iter().filter(|id| !live.contains(id)) {
                    tx.execute("DELETE FROM metric_samples WHERE sandbox_id = ?1", [id])?;
                }
                Ok(tx.commit()?)
            })
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(ts: i64) -> MetricSample {
        MetricSample {
            timestamp_ms: ts,
            cpu_count: 2,
            cpu_used_pct: 12.5,
            mem_used: 3 << 30,
            mem_total: 4 << 30,
            mem_cache: 1 << 20,
            disk_used: 5 << 30,
            disk_total: 10 << 30,
        }
    }

    #[tokio::test]
    async fn samples_round_trip_and_histories_go() {
        let m = SqliteMetricsStore::open_in_memory().unwrap();
        for ts in [3, 1, 2] {
            m.add_sample("a", sample(ts)).await.unwrap();
        }
        m.add_sample("b", sample(1)).await.unwrap();
        m.add_sample("c", sample(1)).await.unwrap();
        let a = m.samples("a").await.unwrap();
        assert_eq!(a, vec![sample(1), sample(2), sample(3)], "oldest first");
        m.replace_samples("a", vec![sample(1), sample(3)])
            .await
            .unwrap();
        assert_eq!(m.samples("a").await.unwrap(), vec![sample(1), sample(3)]);
        m.delete_samples(vec!["b".into()]).await.unwrap();
        assert!(m.samples("b").await.unwrap().is_empty());
        m.keep_only(vec!["a".into()]).await.unwrap();
        assert!(m.samples("c").await.unwrap().is_empty());
        assert_eq!(m.samples("a").await.unwrap().len(), 2);
    }
}
