//! Garbage collection of the checkpoint bucket, done by one node at a time. Every node with an
//! object store campaigns for the store's `gc-leader` key ([`crate::campaign`]); the holder, while its lease lives, runs a
//! [`round`] every [`GcConfig::every`]: the manifest ids of every `checkpoints/*`,
//! `snapshot-files/*` and `template-files/*` record in etcd, then [`ChunkStore::collect`] deletes the manifests none names and the chunks no kept
//! manifest names, older than [`GcConfig::grace`]. A round whose records cannot be read
//! deletes nothing; one that outlives its lease is cancelled.
//!
//! The grace keeps what an upload writes, but not an old chunk an upload finds in the bucket
//! and reuses: a round may delete it before the upload's manifest and record exist. So a
//! round is announced in etcd (`gc-round`: `running` on the collector's lease while it runs,
//! `idle` after), and an upload reads that key before it starts ([`round_mark`]) and, once
//! its record is written, [`settle`]s: when a round ran or began meanwhile, it waits for the
//! round to end and stores its files again (what the round deleted comes back; the rest is a
//! HEAD per chunk). A round that begins after the record sees it.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use etcd_client::{PutOptions, TxnOp};

use crate::error::{ClusterError, Result};
use crate::objects::{ChunkStore, GcReport, ObjectError};
use crate::store::EtcdStore;

/// The default time between two rounds: 10 minutes.
pub const DEFAULT_GC_EVERY: Duration = Duration::from_secs(600);
/// The default age below which nothing is collected: 1 hour (longer than any upload).
pub const DEFAULT_GC_GRACE: Duration = Duration::from_secs(3600);

/// When and what the collector collects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GcConfig {
    /// Time between two rounds (the first runs as soon as a node leads).
    pub every: Duration,
    /// Objects younger than this stay, whatever names them.
    pub grace: Duration,
    /// The leader's lease: another node takes over this long after the leader's last renewal.
    pub ttl: Duration,
}

impl Default for GcConfig {
    fn default() -> Self {
        GcConfig {
            every: DEFAULT_GC_EVERY,
            grace: DEFAULT_GC_GRACE,
            ttl: Duration::from_secs(10),
        }
    }
}

/// How long an upload waits for a round it overlapped to end before it stores its files again
/// all the same.
const SETTLE_WAIT: Duration = Duration::from_secs(600);

/// Why a round (or an upload's settling) failed.
#[derive(Debug, thiserror::Error)]
pub enum GcError {
    #[error("reading the checkpoint records: {0}")]
    Records(#[source] ClusterError),
    #[error("collecting the bucket: {0}")]
    Objects(#[source] ObjectError),
    /// A file whose bytes are no longer those its checkpoint record names.
    #[error("a checkpoint file changed after its upload: manifest {recorded}, now {now}")]
    Changed { recorded: String, now: String },
}

/// What an upload saw of the collector's rounds: `gc-round`'s modification revision (0: no
/// key) and whether a round was running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoundMark {
    pub revision: i64,
    pub running: bool,
}

impl RoundMark {
    /// Whether a round may have run between this mark and `later` (one was running at either,
    /// or the key changed: a round began or ended, or its collector's lease ended).
    pub fn overlaps(&self, later: &RoundMark) -> bool {
        self.running || later.running || self.revision != later.revision
    }
}

const RUNNING: &[u8] = b"running";

/// The collector's rounds as they stand.
pub async fn round_mark(etcd: &EtcdStore) -> Result<RoundMark> {
    let kv = etcd.get_one(&etcd.keys().gc_round()).await?;
    Ok(match kv {
        Some(kv) => RoundMark {
            revision: kv.mod_revision(),
            running: kv.value() == RUNNING,
        },
        None => RoundMark {
            revision: 0,
            running: false,
        },
    })
}

/// Announces a round, on the collector's `lease` (the mark goes with the collector).
pub async fn begin_round(etcd: &EtcdStore, lease: i64) -> Result<()> {
    let key = etcd.keys().gc_round();
    let opts = PutOptions::new().with_lease(lease);
    etcd.commit(vec![TxnOp::put(key.as_str(), RUNNING, Some(opts))])
        .await
}

/// Announces the end of a round.
pub async fn end_round(etcd: &EtcdStore) -> Result<()> {
    let key = etcd.keys().gc_round();
    etcd.commit(vec![TxnOp::put(key.as_str(), "idle", None)])
        .await
}

/// Called by an upload begun at `before` once its record is written: when a round may have
/// run meanwhile, waits until none runs (at most 10 minutes) and stores each `(path,
/// manifest id)` file again. True when it did.
pub async fn settle(
    etcd: &EtcdStore,
    chunks: &ChunkStore,
    before: &RoundMark,
    files: &[(PathBuf, String)],
) -> std::result::Result<bool, GcError> {
    let mut now = round_mark(etcd).await.map_err(GcError::Records)?;
    if !before.overlaps(&now) {
        return Ok(false);
    }
    let start = Instant::now();
    while now.running && start.elapsed() < SETTLE_WAIT {
        tokio::time::sleep(Duration::from_millis(500)).await;
        now = round_mark(etcd).await.map_err(GcError::Records)?;
    }
    for (path, recorded) in files {
        let put = chunks.put_file(path).await.map_err(GcError::Objects)?;
        if &put.id != recorded {
            return Err(GcError::Changed {
                recorded: recorded.clone(),
                now: put.id,
            });
        }
        if put.chunks_uploaded > 0 {
            tracing::warn!(
                manifest = %put.id,
                chunks = put.chunks_uploaded,
                "chunks collected during an upload that reused them were stored again"
            );
        }
    }
    Ok(true)
}

/// One collection: the live manifests from etcd, then the bucket's collection.
pub async fn round(
    etcd: &EtcdStore,
    chunks: &ChunkStore,
    grace: Duration,
) -> std::result::Result<GcReport, GcError> {
    let live = etcd.live_manifests().await.map_err(GcError::Records)?;
    chunks.collect(&live, grace).await.map_err(GcError::Objects)
}

/// Campaigns for the collector's lead as node `me` forever, collecting while it leads.
pub async fn run(etcd: EtcdStore, chunks: ChunkStore, me: String, cfg: GcConfig) {
    loop {
        if let Err(e) = term(&etcd, &chunks, &me, cfg).await {
            tracing::warn!(error = %e, "bucket garbage collection's leadership");
        }
        tokio::time::sleep(cfg.ttl / 3).await;
    }
}

/// One try at leading: returns when another node leads or when the lease is lost.
async fn term(etcd: &EtcdStore, chunks: &ChunkStore, me: &str, cfg: GcConfig) -> Result<()> {
    let key = etcd.keys().gc_leader();
    let led = crate::campaign::lead(etcd, &key, me, cfg.ttl, |lease| async move {
        tracing::info!(node = me, "leading the bucket's garbage collection");
        loop {
            match begin_round(etcd, lease).await {
                Ok(()) => {
                    collect_once(etcd, chunks, cfg.grace).await;
                    if let Err(e) = end_round(etcd).await {
                        tracing::warn!(error = %e, "announcing the end of a collection round");
                    }
                }
                Err(e) => tracing::warn!(error = %e, "announcing a collection round"),
            }
            tokio::time::sleep(cfg.every).await;
        }
    })
    .await?;
    if led {
        tracing::warn!(node = me, "the garbage collection's lease is lost");
    }
    Ok(())
}

/// A round, logged.
async fn collect_once(etcd: &EtcdStore, chunks: &ChunkStore, grace: Duration) {
    let t = Instant::now();
    match round(etcd, chunks, grace).await {
        Ok(r) => {
            if r.live_missing > 0 {
                tracing::warn!(
                    manifests = r.live_missing,
                    "checkpoint records name manifests the bucket does not hold"
                );
            }
            tracing::info!(
                manifests_deleted = r.manifests_deleted,
                chunks_deleted = r.chunks_deleted,
                bytes_deleted = r.bytes_deleted,
                manifests_kept = r.manifests_kept,
                chunks_kept = r.chunks_kept,
                ms = t.elapsed().as_millis() as u64,
                "bucket garbage collected"
            );
        }
        Err(e) => tracing::warn!(error = %e, "bucket garbage collection round failed"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_upload_overlaps_a_round_that_ran_began_or_ended_during_it() {
        let idle = |revision| RoundMark {
            revision,
            running: false,
        };
        let running = |revision| RoundMark {
            revision,
            running: true,
        };
        assert!(!idle(0).overlaps(&idle(0)));
        assert!(!idle(7).overlaps(&idle(7)));
        // A round began and ended, or its collector's key went with its lease.
        assert!(idle(7).overlaps(&idle(9)));
        assert!(idle(7).overlaps(&idle(0)));
        assert!(idle(0).overlaps(&running(3)));
        // One running when the upload began may still be deleting.
        assert!(running(3).overlaps(&running(3)));
        assert!(running(3).overlaps(&idle(4)));
    }
}
