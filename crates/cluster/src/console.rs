//! The web console's sessions in etcd ([`EtcdSessions`], the server's
//! [`kiln_server::console::SessionStore`]), so that a session opened at one control replica is
//! known at every other. One key per session, `console-sessions/{sha256 of the id}`, holds
//! the SHA-256 of the API key it was opened with and its end (JSON), attached to an etcd lease
//! that ends with the session: etcd removes it by itself. The end is checked on every read
//! too, as the lease's TTL is whole seconds, rounded up.

use async_trait::async_trait;
use etcd_client::{DeleteOptions, GetOptions, PutOptions, TxnOp};
use kiln_server::console::{SessionRow, SessionStore};
use kiln_server::store::Result;
use serde::{Deserialize, Serialize};

use crate::error::ClusterError;
use crate::retry::{self, Kind};
use crate::store::EtcdStore;

/// The console sessions of every control replica of one cluster.
#[derive(Clone)]
pub struct EtcdSessions {
    store: EtcdStore,
}

impl EtcdSessions {
    pub fn new(store: EtcdStore) -> Self {
        Self { store }
    }
}

/// What is stored of a session (its key names the id's hash).
#[derive(Serialize, Deserialize)]
struct Doc {
    key_hash: String,
    created_at_ms: i64,
    expires_at_ms: i64,
}

fn parse(key: &str, value: &[u8]) -> std::result::Result<Doc, ClusterError> {
    serde_json::from_slice(value).map_err(|source| ClusterError::Corrupt {
        key: key.to_string(),
        source,
    })
}

/// Seconds of a lease that outlives `now_ms` until `end_ms` (at least one).
fn lease_secs(now_ms: i64, end_ms: i64) -> i64 {
    (end_ms.saturating_sub(now_ms).saturating_add(999) / 1000).max(1)
}

impl EtcdSessions {
    async fn open_count(&self) -> std::result::Result<usize, ClusterError> {
        let dir = self.store.keys().dir("console-sessions");
        let r = self
            .store
            .get(&dir, GetOptions::new().with_prefix().with_count_only())
            .await?;
        Ok(r.count().max(0) as usize)
    }

    async fn insert(
        &self,
        row: SessionRow,
        now_ms: i64,
        max: usize,
    ) -> std::result::Result<bool, ClusterError> {
        // Ended sessions are gone with their leases: what is counted is open.
        if self.open_count().await? >= max {
            return Ok(false);
        }
        let ttl = lease_secs(now_ms, row.expires_at_ms);
        let client = self.store.client();
        let lease = self.store.grant_lease(ttl).await?;
        let key = self.store.keys().console_session(&row.id_hash);
        let doc = Doc {
            key_hash: row.key_hash,
            created_at_ms: row.created_at_ms,
            expires_at_ms: row.expires_at_ms,
        };
        let value = serde_json::to_vec(&doc).map_err(|source| ClusterError::Corrupt {
            key: key.clone(),
            source,
        })?;
        let put = TxnOp::put(
            key.as_str(),
            value,
            Some(PutOptions::new().with_lease(lease)),
        );
        if !self
            .store
            .create(std::slice::from_ref(&key), vec![put])
            .await?
        {
            let _ = client.clone().lease_revoke(lease).await;
            return Err(ClusterError::Exists {
                what: "console session",
                id: row.id_hash,
            });
        }
        Ok(true)
    }

    async fn find(
        &self,
        id_hash: &str,
        now_ms: i64,
    ) -> std::result::Result<Option<SessionRow>, ClusterError> {
        let key = self.store.keys().console_session(id_hash);
        let Some(kv) = self.store.get_one(&key).await? else {
            return Ok(None);
        };
        let doc = parse(&key, kv.value())?;
        Ok((doc.expires_at_ms > now_ms).then(|| SessionRow {
            id_hash: id_hash.to_string(),
            key_hash: doc.key_hash,
            created_at_ms: doc.created_at_ms,
            expires_at_ms: doc.expires_at_ms,
        }))
    }

    /// Deletes `key` and revokes the lease it was on; whether it existed.
    async fn remove(&self, key: &str) -> std::result::Result<bool, ClusterError> {
        let client = self.store.client();
        // A delete is safe to repeat.
        let r = retry::run(&client, Kind::Read, |mut c| async move {
            c.delete(key, Some(DeleteOptions::new().with_prev_key()))
                .await
        })
        .await?;
        for kv in r.prev_kvs() {
            if kv.lease() != 0 {
                // The key is gone already; a lease left behind only expires later.
                if let Err(e) = client.clone().lease_revoke(kv.lease()).await {
                    tracing::debug!(error = %e, "revoking an ended console session's lease");
                }
            }
        }
        Ok(r.deleted() > 0)
    }

    async fn sweep(&self, now_ms: i64) -> std::result::Result<usize, ClusterError> {
        let dir = self.store.keys().dir("console-sessions");
        let mut n = 0;
        for kv in self.store.get_prefix(&dir, 0).await? {
            let key = String::from_utf8_lossy(kv.key()).into_owned();
            let ended = parse(&key, kv.value()).map_or(true, |d| d.expires_at_ms <= now_ms);
            if ended && self.remove(&key).await? {
                n += 1;
            }
        }
        Ok(n)
    }
}

#[async_trait]
impl SessionStore for EtcdSessions {
    async fn create(&self, row: SessionRow, now_ms: i64, max: usize) -> Result<bool> {
        Ok(self.insert(row, now_ms, max).await?)
    }
    async fn get(&self, id_hash: &str, now_ms: i64) -> Result<Option<SessionRow>> {
        Ok(self.find(id_hash, now_ms).await?)
    }
    async fn delete(&self, id_hash: &str) -> Result<bool> {
        let key = self.store.keys().console_session(id_hash);
        Ok(self.remove(&key).await?)
    }
    async fn expire(&self, now_ms: i64) -> Result<usize> {
        Ok(self.sweep(now_ms).await?)
    }
    async fn count(&self) -> Result<usize> {
        Ok(self.open_count().await?)
    }
}

#[cfg(test)]
mod tests {
    use super::lease_secs;

    #[test]
    fn a_lease_outlives_its_session_by_less_than_a_second() {
        assert_eq!(lease_secs(0, 1), 1);
        assert_eq!(lease_secs(0, 1000), 1);
        assert_eq!(lease_secs(0, 1001), 2);
        assert_eq!(
            lease_secs(5000, 1000),
            1,
            "an ended session still gets a lease"
        );
        assert_eq!(lease_secs(0, 8 * 3600 * 1000), 8 * 3600);
    }
}
