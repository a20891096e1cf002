//! Teams' secrets in etcd ([`EtcdSecrets`], the server's [`SecretStore`]), so that every
//! control replica serves `/secrets` alike and every node's egress proxy finds the values its
//! sandboxes' rules inject. A secret is `secrets/{team}/{id}` (JSON: its name, version,
//! metadata, times and its value sealed by the vault, never in clear) and its name is taken by
//! `secret-names/{team}/{name}` (the id), both written in one txn; an update is a
//! revision-checked rewrite of the record, a delete removes both keys in one txn. Every
//! process of a cluster seals and opens with the key derived from the cluster secret
//! ([`crate::ClusterSecret::vault_key`]). A node's vault keeps opened values in memory:
//! [`forget_on_change`] watches the secrets and empties it at each change, so an update
//! applies to the next request on every node.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use crate::docs::b64;
use async_trait::async_trait;
use base64::Engine;
use etcd_client::{KeyValue, TxnOp, WatchOptions};
use kiln_server::store::{Result, Sealer, SecretCursor, SecretRecord, SecretStore};
use kiln_server::vault::Vault;
use serde::{Deserialize, Serialize};

use crate::error::ClusterError;
use crate::store::{EtcdStore, Step};

/// The secrets of every team of one cluster.
#[derive(Clone)]
pub struct EtcdSecrets {
    store: EtcdStore,
}

impl EtcdSecrets {
    pub fn new(store: EtcdStore) -> Self {
        Self { store }
    }
}

/// What is stored of a secret (the key names its team and id).
#[derive(Serialize, Deserialize)]
struct Doc {
    id: String,
    team: String,
    name: String,
    version: i64,
    metadata: BTreeMap<String, String>,
    /// The sealed value, base64.
    sealed: String,
    created_at_ms: i64,
    updated_at_ms: i64,
}

impl From<&SecretRecord> for Doc {
    fn from(s: &SecretRecord) -> Self {
        Self {
            id: s.id.clone(),
            team: s.team.clone(),
            name: s.name.clone(),
            version: s.version,
            metadata: s.metadata.clone(),
            sealed: b64().encode(&s.sealed),
            created_at_ms: s.created_at_ms,
            updated_at_ms: s.updated_at_ms,
        }
    }
}

fn corrupt(key: &str, e: impl std::fmt::Display) -> ClusterError {
    ClusterError::Corrupt {
        key: key.to_string(),
        source: serde::de::Error::custom(e),
    }
}

fn record(kv: &KeyValue) -> std::result::Result<SecretRecord, ClusterError> {
    let key = String::from_utf8_lossy(kv.key()).into_owned();
    let d: Doc = serde_json::from_slice(kv.value()).map_err(|source| ClusterError::Corrupt {
        key: key.clone(),
        source,
    })?;
    let sealed = b64().decode(&d.sealed).map_err(|e| corrupt(&key, e))?;
    Ok(SecretRecord {
        id: d.id,
        team: d.team,
        name: d.name,
        version: d.version,
        metadata: d.metadata,
        sealed,
        created_at_ms: d.created_at_ms,
        updated_at_ms: d.updated_at_ms,
    })
}

fn to_json(key: &str, s: &SecretRecord) -> std::result::Result<Vec<u8>, ClusterError> {
    serde_json::to_vec(&Doc::from(s)).map_err(|source| ClusterError::Corrupt {
        key: key.to_string(),
        source,
    })
}

impl EtcdSecrets {
    /// The id of `team`'s secret whose id or (case-insensitive) name is `key`.
    async fn id_of(
        &self,
        team: &str,
        key: &str,
    ) -> std::result::Result<Option<String>, ClusterError> {
        let keys = self.store.keys();
        if self.store.get_one(&keys.secret(team, key)).await?.is_some() {
            return Ok(Some(key.to_string()));
        }
        let name = keys.secret_name(team, &key.to_lowercase());
        Ok(self
            .store
            .get_one(&name)
            .await?
            .map(|kv| String::from_utf8_lossy(kv.value()).into_owned()))
    }

    async fn find(
        &self,
        team: &str,
        key: &str,
    ) -> std::result::Result<Option<SecretRecord>, ClusterError> {
        let Some(id) = self.id_of(team, key).await? else {
            return Ok(None);
        };
        match self
            .store
            .get_one(&self.store.keys().secret(team, &id))
            .await?
        {
            Some(kv) => Ok(Some(record(&kv)?)),
            None => Ok(None),
        }
    }
}

#[async_trait]
impl SecretStore for EtcdSecrets {
    async fn insert(&self, s: &SecretRecord) -> Result<bool> {
        let keys = self.store.keys();
        let (rec, name) = (
            keys.secret(&s.team, &s.id),
            keys.secret_name(&s.team, &s.name),
        );
        let ops = vec![
            TxnOp::put(rec.as_str(), to_json(&rec, s)?, None),
            TxnOp::put(name.as_str(), s.id.as_str(), None),
        ];
        Ok(self.store.create(&[rec, name], ops).await?)
    }

    async fn get(&self, team: &str, key: &str) -> Result<Option<SecretRecord>> {
        Ok(self.find(team, key).await?)
    }

    async fn list(
        &self,
        team: &str,
        after: Option<SecretCursor>,
        limit: u32,
    ) -> Result<Vec<SecretRecord>> {
        let kvs = self
            .store
            .get_prefix(&self.store.keys().secrets_of(team), 0)
            .await?;
        let mut all = kvs
            .iter()
            .map(record)
            .collect::<std::result::Result<Vec<_>, _>>()?;
        all.sort_by(|a, b| (a.created_at_ms, &a.id).cmp(&(b.created_at_ms, &b.id)));
        Ok(all
            .into_iter()
            .filter(|s| {
                after
                    .as_ref()
                    .is_none_or(|(at, id)| (s.created_at_ms, &s.id) > (*at, id))
            })
            .take(limit as usize)
            .collect())
    }

    async fn new_version(
        &self,
        team: &str,
        key: &str,
        seal: Sealer,
        metadata: Option<BTreeMap<String, String>>,
        now_ms: i64,
    ) -> Result<Option<SecretRecord>> {
        let Some(id) = self.id_of(team, key).await? else {
            return Ok(None);
        };
        let rec = self.store.keys().secret(team, &id);
        let out = self
            .store
            .read_modify_write(std::slice::from_ref(&rec), |seen| {
                let Some(kv) = &seen[0] else {
                    return Ok(Step::Done(None));
                };
                let mut s = record(kv)?;
                s.version += 1;
                s.sealed = seal(&s.id);
                if let Some(m) = &metadata {
                    s.metadata = m.clone();
                }
                s.updated_at_ms = now_ms.max(s.created_at_ms);
                let put = TxnOp::put(rec.as_str(), to_json(&rec, &s)?, None);
                Ok(Step::Write(vec![put], Some(s)))
            })
            .await?;
        Ok(out)
    }

    async fn delete(&self, team: &str, key: &str) -> Result<bool> {
        let Some(s) = self.find(team, key).await? else {
            return Ok(false);
        };
        let keys = self.store.keys();
        let (rec, name) = (keys.secret(team, &s.id), keys.secret_name(team, &s.name));
        let out = self
            .store
            .read_modify_write(&[rec.clone(), name.clone()], |seen| {
                if seen[0].is_none() {
                    return Ok(Step::Done(false));
                }
                let mut ops = vec![TxnOp::delete(rec.as_str(), None)];
                // The name is this secret's only while it names its id.
                if seen[1]
                    .as_ref()
                    .is_some_and(|kv| kv.value() == s.id.as_bytes())
                {
                    ops.push(TxnOp::delete(name.as_str(), None));
                }
                Ok(Step::Write(ops, true))
            })
            .await?;
        Ok(out)
    }
}

/// Empties `vault`'s opened values whenever a secret of the cluster changes, for as long as
/// the task runs (a watch that breaks is opened again; the values opened meanwhile are
/// forgotten too).
pub async fn forget_on_change(store: EtcdStore, vault: Arc<Vault>) {
    let dir = store.keys().dir("secrets");
    loop {
        let mut client = store.client();
        match client
            .watch(dir.as_str(), Some(WatchOptions::new().with_prefix()))
            .await
        {
            Ok(mut stream) => {
                vault.forget();
                loop {
                    match stream.message().await {
                        Ok(Some(r)) if r.canceled() => break,
                        Ok(Some(r)) if !r.events().is_empty() => vault.forget(),
                        Ok(Some(_)) => {}
                        Ok(None) | Err(_) => break,
                    }
                }
            }
            Err(e) => tracing::debug!(error = %e, "watching the cluster's secrets"),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
