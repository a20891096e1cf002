//! The cluster's workload identity key: one ECDSA P-256 key (PKCS#8) for every node and
//! replica, so a token any node mints (E2B's `iam.tokens`) verifies against the JWKS any
//! replica serves. It is made once, by the first process that needs it, and kept in etcd at
//! `cluster-keys/identity`, sealed by the cluster's vault (its key derived from the cluster
//! secret): a create where absent, so of processes starting together one key wins and all
//! read it.

use base64::Engine;
use etcd_client::TxnOp;
use kiln_server::identity::Issuer;
use kiln_server::vault::Vault;
use serde::{Deserialize, Serialize};

use crate::error::{ClusterError, Result};
use crate::store::EtcdStore;

/// The associated data's id of the sealed key (no secret's id looks like it).
const SEAL_ID: &str = "cluster-keys/identity";

#[derive(Serialize, Deserialize)]
struct Doc {
    /// The sealed PKCS#8 key, base64.
    sealed: String,
}

fn b64() -> base64::engine::GeneralPurpose {
    base64::engine::general_purpose::STANDARD
}

/// The cluster's identity key (PKCS#8), made and stored now if it has none.
pub async fn identity_key(etcd: &EtcdStore, vault: &Vault) -> Result<Vec<u8>> {
    let key = etcd.keys().cluster_key("identity");
    for _ in 0..2 {
        if let Some(kv) = etcd.get_one(&key).await? {
            let doc: Doc =
                serde_json::from_slice(kv.value()).map_err(|source| ClusterError::Corrupt {
                    key: key.clone(),
                    source,
                })?;
            let sealed = b64()
                .decode(&doc.sealed)
                .map_err(|e| ClusterError::Corrupt {
                    key: key.clone(),
                    source: serde::de::Error::custom(e),
                })?;
            return vault
                .unseal("", SEAL_ID, &sealed)
                .map_err(|_| ClusterError::KeyUnsealed(key.clone()));
        }
        let der = Issuer::generate_pkcs8().map_err(|e| {
            ClusterError::Store(kiln_server::store::StoreError::Task(e.to_string()))
        })?;
        let doc = Doc {
            sealed: b64().encode(vault.seal("", SEAL_ID, &der)),
        };
        let value = serde_json::to_vec(&doc).map_err(|source| ClusterError::Corrupt {
            key: key.clone(),
            source,
        })?;
        if etcd
            .create(
                std::slice::from_ref(&key),
                vec![TxnOp::put(key.as_str(), value, None)],
            )
            .await?
        {
            return Ok(der);
        }
        // Another process stored one first: read it.
    }
    Err(ClusterError::Contended { key, tries: 2 })
}
