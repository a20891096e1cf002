//! The cluster's singleton work, done by one control replica at a time: the leader holds the
//! store's `leader` key on a lease of its own (created only where absent, so one holder at a
//! time) and, while its lease lives, ends the running sandboxes of nodes whose lease expired
//! as `died: node-lost`. Ending is revision-checked, so a stale leader overlapping a new
//! one ends nothing twice.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{PutOptions, TxnOp};

use super::cache::Cache;
use crate::error::Result;
use crate::store::EtcdStore;

/// How often the leader looks for lost nodes.
const SWEEP_EVERY: Duration = Duration::from_millis(500);

/// Campaigns for leadership as `me` forever, sweeping while it leads.
pub async fn run(etcd: EtcdStore, cache: Arc<Cache>, me: String, ttl: Duration) {
    loop {
        match term(&etcd, &cache, &me, ttl).await {
            Ok(()) => {}
            Err(e) => tracing::warn!(error = %e, "cluster leadership"),
        }
        tokio::time::sleep(ttl / 3).await;
    }
}

/// One try at leading: returns when another replica leads or when the lease is lost.
async fn term(etcd: &EtcdStore, cache: &Cache, me: &str, ttl: Duration) -> Result<()> {
    let mut client = etcd.client();
    let ttl_s = ttl.as_secs().max(2) as i64;
    let lease = client.lease_grant(ttl_s, None).await?.id();
    let key = etcd.keys().leader();
    let put = TxnOp::put(
        key.as_str(),
        me.as_bytes(),
        Some(PutOptions::new().with_lease(lease)),
    );
    if !etcd.create(std::slice::from_ref(&key), vec![put]).await? {
        let _ = client.lease_revoke(lease).await;
        return Ok(());
    }
    tracing::info!(replica = me, "leading the cluster's singletons");
    let (mut keeper, mut stream) = client.lease_keep_alive(lease).await?;
    let renew = ttl / 3;
    let mut renewed = tokio::time::Instant::now();
    loop {
        if renewed.elapsed() >= renew {
            keeper.keep_alive().await?;
            match tokio::time::timeout(renew, stream.message()).await {
                Ok(Ok(Some(r))) if r.ttl() > 0 => renewed = tokio::time::Instant::now(),
                _ => {
                    tracing::warn!(replica = me, "leadership lease lost");
                    return Ok(());
                }
            }
        }
        sweep(etcd, cache).await;
        tokio::time::sleep(SWEEP_EVERY).await;
    }
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
