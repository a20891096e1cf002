//! Leadership of a singleton on etcd: a key created only where absent, attached to a lease of
//! the candidate's own, so there is one holder at a time. The holder renews its lease every
//! third of its time to live and its term ends when a renewal goes unanswered; the key goes
//! with the lease, and the next campaign of another candidate takes it. The control replicas'
//! leader ([`crate::control`]) and the bucket's collector ([`crate::gc`]) campaign through it.

use std::future::Future;
use std::time::Duration;

use etcd_client::{Client, PutOptions, TxnOp};

use crate::error::{ClusterError, Result};
use crate::store::EtcdStore;

/// Campaigns once for `key` as `me` on a lease of `ttl`. Won: runs `work(lease)` while the
/// lease lives (it is dropped when a renewal fails), then revokes the lease; true. False when
/// another candidate holds the key.
pub async fn lead<F, Fut>(
    etcd: &EtcdStore,
    key: &str,
    me: &str,
    ttl: Duration,
    work: F,
) -> Result<bool>
where
    F: FnOnce(i64) -> Fut,
    Fut: Future<Output = ()>,
{
    let mut client = etcd.client();
    let lease = client
        .lease_grant(ttl.as_secs().max(2) as i64, None)
        .await?
        .id();
    let put = TxnOp::put(
        key,
        me.as_bytes(),
        Some(PutOptions::new().with_lease(lease)),
    );
    if !etcd.create(&[key.to_string()], vec![put]).await? {
        let _ = client.lease_revoke(lease).await;
        return Ok(false);
    }
    let held = tokio::select! {
        held = hold(&mut client, lease, ttl) => held,
        () = work(lease) => Ok(()),
    };
    let _ = client.lease_revoke(lease).await;
    held.map(|()| true)
}

/// Renews `lease` every third of `ttl`; returns when a renewal goes unanswered.
async fn hold(client: &mut Client, lease: i64, ttl: Duration) -> Result<()> {
    let (mut keeper, mut stream) = client.lease_keep_alive(lease).await?;
    let renew = ttl / 3;
    loop {
        tokio::time::sleep(renew).await;
        keeper.keep_alive().await?;
        match tokio::time::timeout(renew, stream.message()).await {
            Ok(Ok(Some(r))) if r.ttl() > 0 => {}
            Ok(Ok(_)) => return Ok(()),
            Ok(Err(e)) => return Err(e.into()),
            Err(_) => return Err(ClusterError::StreamClosed("lease keep-alive")),
        }
    }
}
