//! The state database, opened once: [`StateDb::open`] migrates `<state>/kiln.db` and hands
//! out every aggregate kiln keeps in it — the state store, the audit chain, the metrics
//! history, and the side tables (secrets, volumes, template builds, the console) —
//! each on a connection of its own made here, with the pragmas [`super::side_db::connect`]
//! sets.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::aggregates::{AuditStore, MetricsStore};
use super::alerts_sql::AlertsDb;
use super::audit_sql::SqliteAuditStore;
use super::metrics_sql::SqliteMetricsStore;
use super::{BuildsDb, ConsoleDb, Result, SecretsDb, SqliteStore, StateStore, VolumesDb};

/// The open, migrated state database.
pub struct StateDb {
    path: PathBuf,
    state: SqliteStore,
}

impl StateDb {
    /// Opens (creating if needed) the database at `path` and migrates it to the current
    /// schema.
    pub fn open(path: &Path) -> Result<Self> {
        Ok(Self {
            state: SqliteStore::open(path)?,
            path: path.to_path_buf(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Sandboxes, snapshots, templates, keys, teams, events and webhooks.
    pub fn state(&self) -> Arc<dyn StateStore> {
        Arc::new(self.state.clone())
    }

    /// The audit chain.
    pub fn audit(&self) -> Result<Arc<dyn AuditStore>> {
        Ok(Arc::new(SqliteAuditStore::open(&self.path)?))
    }

    /// The metrics history.
    pub fn metrics(&self) -> Result<Arc<dyn MetricsStore>> {
        Ok(Arc::new(SqliteMetricsStore::open(&self.path)?))
    }

    pub fn secrets(&self) -> Result<SecretsDb> {
        SecretsDb::open(&self.path)
    }

    pub fn volumes(&self) -> Result<VolumesDb> {
        VolumesDb::open(&self.path)
    }

    pub fn builds(&self) -> Result<BuildsDb> {
        BuildsDb::open(&self.path)
    }

    pub fn console(&self) -> Result<ConsoleDb> {
        ConsoleDb::open(&self.path)
    }

    /// The rule engine's alerts and incidents.
    pub fn alerts(&self) -> Result<AlertsDb> {
        AlertsDb::open(&self.path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audit::record::{Append, Kind, NewRecord};
    use crate::obs::ring::MetricSample;
    use crate::store::sqlite::tests::sample;
    use crate::store::SandboxState;

    fn api_record(ts_ms: i64) -> Append {
        Append::Record(NewRecord {
            sandbox_id: "sbx1".into(),
            ts_ms,
            kind: Kind::Api,
            body: serde_json::json!({ "key": "k1", "i": ts_ms }),
        })
    }

    #[tokio::test]
    async fn every_aggregate_reads_and_writes_the_one_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kiln.db");
        let db = StateDb::open(&path).unwrap();
        let mut s = sample("sbx1", SandboxState::Running);
        s.team = "t1".into();
        db.state().insert_sandbox(&s).await.unwrap();
        let audit = db.audit().unwrap();
        let stored = audit.append(&[api_record(1), api_record(2)]).unwrap();
        assert_eq!(stored.iter().map(|r| r.seq).collect::<Vec<_>>(), [1, 2]);
        assert_eq!(stored[1].prev_hash, stored[0].hash);
        assert!(stored[1].cursor > stored[0].cursor);
        // The audit store sees the sandbox the state store recorded.
        assert_eq!(audit.team_of("sbx1").unwrap().as_deref(), Some("t1"));
        assert_eq!(audit.chains(Some("t1")).unwrap(), ["sbx1"]);
        assert!(audit.chains(Some("t2")).unwrap().is_empty());
        assert_eq!(audit.owner("sbx1").unwrap().as_deref(), Some("k1"));
        let m = MetricSample {
            timestamp_ms: 5,
            cpu_count: 1,
            cpu_used_pct: 1.0,
            mem_used: 1,
            mem_total: 2,
            mem_cache: 0,
            disk_used: 3,
            disk_total: 4,
        };
        db.metrics()
            .unwrap()
            .add_sample("sbx1", m.clone())
            .await
            .unwrap();
        drop((audit, db));
        // Opened again: what each aggregate wrote is there, and the chain goes on from its head.
        let db = StateDb::open(&path).unwrap();
        let audit = db.audit().unwrap();
        let chain = audit.chain("sbx1").unwrap();
        assert_eq!(chain.records, stored);
        assert_eq!(chain.head.map(|h| h.seq), Some(2));
        assert_eq!(chain.anchor, None);
        let next = audit.append(&[api_record(3)]).unwrap();
        assert_eq!((next[0].seq, &next[0].prev_hash), (3, &stored[1].hash));
        assert_eq!(
            audit.record_hash("sbx1", 2).unwrap(),
            Some(stored[1].hash.clone())
        );
        assert_eq!(db.metrics().unwrap().samples("sbx1").await.unwrap(), [m]);
        assert_eq!(
            db.state()
                .get_sandbox("sbx1")
                .await
                .unwrap()
                .map(|s| s.team),
            Some("t1".into())
        );
    }
}
