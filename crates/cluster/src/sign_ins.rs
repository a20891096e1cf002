//! The console's failed sign-ins in etcd ([`EtcdSignIns`], the server's
//! [`SignInCounter`]), so that the limit holds across control replicas: a client gets its
//! tries once per cluster, not once per replica. One key per failure,
//! `console-sign-ins/{bucket}/{ms}-{uuid}`, on a lease as long as the window (and a second):
//! etcd removes them by itself. While etcd cannot be reached, a replica counts failures in its
//! own memory too, and a check takes the longer of the two waits.

use std::net::IpAddr;

use async_trait::async_trait;
use etcd_client::PutOptions;
use kiln_server::console::limit::{bucket_name, wait_for, SignInCounter, SignInLimit, WINDOW};
use kiln_server::store::now_ms;

use crate::error::ClusterError;
use crate::retry::{self, Kind};
use crate::store::EtcdStore;

/// The failed console sign-ins of every control replica of one cluster.
pub struct EtcdSignIns {
    store: EtcdStore,
    /// Failures this replica could not record in etcd.
    local: SignInLimit,
}

impl EtcdSignIns {
    pub fn new(store: EtcdStore) -> Self {
        Self {
            store,
            local: SignInLimit::default(),
        }
    }

    /// The times (ms) of `bucket`'s failures still in etcd.
    async fn times(&self, bucket: &str) -> Result<Vec<i64>, ClusterError> {
        let dir = self.store.keys().console_sign_ins(bucket);
        let kvs = self.store.get_prefix(&dir, 0).await?;
        Ok(kvs
            .iter()
            .filter_map(|kv| {
                let key = std::str::from_utf8(kv.key()).ok()?;
                key.strip_prefix(dir.as_str())?
                    .split('-')
                    .next()?
                    .parse()
                    .ok()
            })
            .collect())
    }

    async fn record(&self, bucket: &str, at_ms: i64) -> Result<(), ClusterError> {
        let lease = self.store.grant_lease(WINDOW.as_secs() as i64 + 1).await?;
        let key = format!(
            "{}{at_ms:016}-{}",
            self.store.keys().console_sign_ins(bucket),
            uuid::Uuid::new_v4().simple()
        );
        // A key of its own: putting it twice is one failure.
        retry::run(&self.store.client(), Kind::Read, |mut c| {
            let key = key.clone();
            async move {
                c.put(key, "", Some(PutOptions::new().with_lease(lease)))
                    .await
            }
        })
        .await?;
        Ok(())
    }
}

#[async_trait]
impl SignInCounter for EtcdSignIns {
    async fn check(&self, ip: IpAddr) -> Option<u64> {
        let shared = match self.times(&bucket_name(ip)).await {
            Ok(times) => wait_for(&times, now_ms()),
            Err(e) => {
                tracing::warn!(error = %e, "reading failed console sign-ins from etcd");
                None
            }
        };
        match (shared, self.local.check(ip)) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        }
    }

    async fn failed(&self, ip: IpAddr) {
        if let Err(e) = self.record(&bucket_name(ip), now_ms()).await {
            tracing::warn!(error = %e, "recording a failed console sign-in in etcd");
            self.local.failed(ip);
        }
    }
}
