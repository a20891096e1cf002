//! The cluster's singleton work, done by one control replica at a time: the leader holds the
//! store's `leader` key ([`crate::campaign`]) and, while its lease lives, ends the running
//! sandboxes of nodes whose lease expired as `died: node-lost`, and moves the paused
//! sandboxes of draining nodes to other nodes, one at a time
//! ([`ClusterService::move_off_draining`]), and deletes fork captures left behind by replicas
//! that died mid-fork ([`ClusterService::drop_left_captures`]). Ending is revision-checked, so a stale
//! leader overlapping a new one ends nothing twice; of two replicas moving one sandbox, the
//! ownership write lets one win.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::task::JoinHandle;

use super::cache::Cache;
use super::moves::DrainMove;
use super::service::ClusterService;
use crate::error::Result;
use crate::store::EtcdStore;

/// How often the leader looks for lost nodes.
const SWEEP_EVERY: Duration = Duration::from_millis(500);
/// How often the leader looks for fork captures left behind.
const CAPTURES_EVERY: Duration = Duration::from_secs(60);

/// How long a paused sandbox of a draining node stays where it is after its move failed, or
/// when its checkpoint is on its node's disk only (it may be stored by a later pause).
const MOVE_AGAIN_AFTER_FAILURE: Duration = Duration::from_secs(30);
const MOVE_AGAIN_WITHOUT_CHECKPOINT: Duration = Duration::from_secs(60);

/// Campaigns for leadership as `me` forever, sweeping while it leads.
pub async fn run(
    etcd: EtcdStore,
    cache: Arc<Cache>,
    svc: Arc<ClusterService>,
    me: String,
    ttl: Duration,
    move_drained: bool,
) {
    let mut drains = Drains {
        on: move_drained,
        ..Drains::default()
    };
    loop {
        match term(&etcd, &cache, &svc, &mut drains, &me, ttl).await {
            Ok(()) => {}
            Err(e) => tracing::warn!(error = %e, "cluster leadership"),
        }
        tokio::time::sleep(ttl / 3).await;
    }
}

/// One try at leading: returns when another replica leads or when the lease is lost.
async fn term(
    etcd: &EtcdStore,
    cache: &Cache,
    svc: &Arc<ClusterService>,
    drains: &mut Drains,
    me: &str,
    ttl: Duration,
) -> Result<()> {
    let key = etcd.keys().leader();
    let led = crate::campaign::lead(etcd, &key, me, ttl, |_| async move {
        tracing::info!(replica = me, "leading the cluster's singletons");
        let mut captures: Option<(Instant, JoinHandle<()>)> = None;
        loop {
            sweep(etcd, cache).await;
            drains.tick(svc);
            let due = captures
                .as_ref()
                .is_none_or(|(at, h)| h.is_finished() && at.elapsed() >= CAPTURES_EVERY);
            if due {
                let svc = svc.clone();
                let h = tokio::spawn(async move {
                    let n = svc.drop_left_captures().await;
                    if n > 0 {
                        tracing::info!(captures = n, "deleted fork captures left behind");
                    }
                });
                captures = Some((Instant::now(), h));
            }
            tokio::time::sleep(SWEEP_EVERY).await;
        }
    })
    .await?;
    if led {
        tracing::warn!(replica = me, "leadership lease lost");
    }
    Ok(())
}

/// Ends the running sandboxes of every node that owns some but is no longer live.
async fn sweep(etcd: &EtcdStore, cache: &Cache) {
    for node in cache.lost_owners() {
        match etcd.end_lost_node(&node).await {
            Ok(ended) if !ended.is_empty() => {
                tracing::warn!(node = %node, sandboxes = ended.len(), "node lost: its running sandboxes died");
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(node = %node, error = %e, "ending a lost node's sandboxes"),
        }
    }
}

/// The moves of paused sandboxes off draining nodes: one in flight at a time, beside the
/// sweep (a move that outlives its leader's term finishes: its node-side take-over hands
/// the sandbox back when it fails, and is not to be cut half-way).
#[derive(Default)]
struct Drains {
    /// Off: paused sandboxes of draining nodes move at their next resume only.
    on: bool,
    running: Option<JoinHandle<()>>,
    /// Sandboxes left where they are until the time given.
    later: Arc<Mutex<HashMap<String, Instant>>>,
}

impl Drains {
    fn tick(&mut self, svc: &Arc<ClusterService>) {
        if !self.on || self.running.as_ref().is_some_and(|h| !h.is_finished()) {
            return;
        }
        let (svc, later) = (svc.clone(), self.later.clone());
        self.running = Some(tokio::spawn(async move {
            let now = Instant::now();
            let skip: HashSet<String> = {
                let mut l = later.lock().unwrap_or_else(|p| p.into_inner());
                l.retain(|_, until| *until > now);
                l.keys().cloned().collect()
            };
            let Some((id, outcome)) = svc.move_off_draining(&skip).await else {
                return;
            };
            let again = match outcome {
                DrainMove::Moved(to) => {
                    tracing::info!(sandbox = %id, node = %to, "moved a paused sandbox off a draining node");
                    return;
                }
                DrainMove::NoCheckpoint => MOVE_AGAIN_WITHOUT_CHECKPOINT,
                DrainMove::Failed(e) => {
                    tracing::warn!(sandbox = %id, error = %e, "moving a paused sandbox off a draining node");
                    MOVE_AGAIN_AFTER_FAILURE
                }
            };
            later
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(id, Instant::now() + again);
        }));
    }
}
