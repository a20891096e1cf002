//! The keys of the whole cluster, kept in etcd at `cluster-keys/{name}`, sealed by the
//! cluster's vault (its key derived from the cluster secret). Each is made once, by the first
//! process that needs it: a create where absent, so of processes starting together one key
//! wins and all read it.
//! - `identity`: the workload identity key, one ECDSA P-256 key (PKCS#8) for every node and
//!   replica, so a token any node mints (E2B's `iam.tokens`) verifies against the JWKS any
//!   replica serves.
//! - `interception-ca`: the egress interception CA (certificate and key), one for every node,
//!   so a sandbox keeps trusting the leaves its node's egress proxy presents wherever it runs
//!   (a resume, a drain move or a fork on another node keeps the trust store it had).

use std::path::Path;
use std::sync::Arc;

use crate::docs::b64;
use base64::Engine;
use etcd_client::TxnOp;
use kiln_server::identity::Issuer;
use kiln_server::vault::Vault;
use serde::{Deserialize, Serialize};

use crate::error::{ClusterError, Result};
use crate::secret::ClusterSecret;
use crate::store::EtcdStore;

#[derive(Serialize, Deserialize)]
struct Doc {
    /// The sealed key, base64.
    sealed: String,
}

fn task_err(e: impl std::fmt::Display) -> ClusterError {
    ClusterError::Store(kiln_server::store::StoreError::Task(e.to_string()))
}

/// The cluster's key `name`: read and unsealed, or made with `make`, sealed and stored now if
/// the cluster has none.
async fn cluster_key(
    etcd: &EtcdStore,
    vault: &Vault,
    name: &str,
    mut make: impl FnMut() -> Result<Vec<u8>>,
) -> Result<Vec<u8>> {
    let key = etcd.keys().cluster_key(name);
    // The associated data's id of the sealed key (no secret's id looks like it).
    let seal_id = format!("cluster-keys/{name}");
    let corrupt = |e: String| ClusterError::Corrupt {
        key: key.clone(),
        source: serde::de::Error::custom(e),
    };
    for _ in 0..2 {
        if let Some(kv) = etcd.get_one(&key).await? {
            let doc: Doc =
                serde_json::from_slice(kv.value()).map_err(|e| corrupt(e.to_string()))?;
            let sealed = b64()
                .decode(&doc.sealed)
                .map_err(|e| corrupt(e.to_string()))?;
            return vault
                .unseal("", &seal_id, &sealed)
                .map_err(|_| ClusterError::KeyUnsealed(key.clone()));
        }
        let made = make()?;
        let doc = Doc {
            sealed: b64().encode(vault.seal("", &seal_id, &made)),
        };
        let value = serde_json::to_vec(&doc).map_err(|e| corrupt(e.to_string()))?;
        if etcd
            .create(
                std::slice::from_ref(&key),
                vec![TxnOp::put(key.as_str(), value, None)],
            )
            .await?
        {
            return Ok(made);
        }
        // Another process stored one first: read it.
    }
    Err(ClusterError::Contended { key, tries: 2 })
}

/// The vault every process of the cluster seals with (teams' secrets, the cluster's keys):
/// its key derived from the cluster `secret`, its records in etcd.
pub fn cluster_vault(etcd: &EtcdStore, secret: &ClusterSecret) -> Result<Vault> {
    Ok(Vault::with_store(
        &secret.vault_key(),
        Arc::new(crate::secrets::EtcdSecrets::new(etcd.clone())),
        None,
    )?)
}

/// The cluster's identity key (PKCS#8), made and stored now if it has none.
pub async fn identity_key(etcd: &EtcdStore, vault: &Vault) -> Result<Vec<u8>> {
    cluster_key(etcd, vault, "identity", || {
        Issuer::generate_pkcs8().map_err(task_err)
    })
    .await
}

/// The interception CA as the cluster keeps it.
#[derive(Serialize, Deserialize)]
struct CaDoc {
    cert: String,
    key: String,
}

/// Makes the cluster's interception CA the one of state directory `dir` (where a node's
/// egress proxy loads it): the cluster's when it has one (written over the directory's own,
/// said in the log, since sandboxes started before on this node trust the one they had),
/// else the directory's (made there first if it has none) becomes the cluster's.
pub async fn adopt_interception_ca(etcd: &EtcdStore, vault: &Vault, dir: &Path) -> Result<()> {
    use kiln_net::intercept::ca;
    // Whether the directory had a CA before (sandboxes of this node may trust it).
    let had = ca::read_pems(dir).ok();
    let own = || ca::Ca::open(dir).and_then(|_| ca::read_pems(dir));
    let doc = cluster_key(etcd, vault, "interception-ca", || {
        let (cert, key) = own().map_err(task_err)?;
        serde_json::to_vec(&CaDoc { cert, key }).map_err(task_err)
    })
    .await?;
    let doc: CaDoc = serde_json::from_slice(&doc).map_err(|source| ClusterError::Corrupt {
        key: etcd.keys().cluster_key("interception-ca"),
        source,
    })?;
    if ca::read_pems(dir).is_ok_and(|(c, _)| c == doc.cert) {
        return Ok(());
    }
    ca::install(dir, &doc.cert, &doc.key).map_err(task_err)?;
    if had.is_some() {
        tracing::warn!(
            "this node's interception CA is now the cluster's: sandboxes it started before \
             trust its own, and their network rules' HTTPS fails until `update_network` \
             gives them the cluster's"
        );
    }
    Ok(())
}
