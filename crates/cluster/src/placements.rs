//! Where a create with an `Idempotency-Key` was placed: `placements/{token}` names the node
//! the first replica sent it to, on an etcd lease as long as the API's idempotency window.
//! A retry of that create at any replica (the first one died mid-create, or the client gave
//! up waiting) goes to the same node, which runs one create per token
//! ([`crate::wire::CreateDoc::idempotency`]), so the cluster ends with one sandbox for the
//! key. A record naming a node that is no longer live is replaced.

use etcd_client::{PutOptions, TxnOp};
use sha2::{Digest, Sha256};

use crate::error::Result;
use crate::store::{EtcdStore, Step};

/// The token of a create's idempotency scope and key (`{team}/create/{key}`): a digest, so
/// keys of any length and characters make keys of one form.
pub fn token(scoped_key: &str) -> String {
    hex::encode(Sha256::digest(scoped_key.as_bytes()))
}

impl EtcdStore {
    /// The node create `token` goes to: the node recorded for it when `live` says that node
    /// is live, else `candidate` (recorded now). None when there is neither.
    pub async fn placement(
        &self,
        token: &str,
        candidate: Option<&str>,
        live: impl Fn(&str) -> bool,
    ) -> Result<Option<String>> {
        let key = self.keys().placement(token);
        if let Some(kv) = self.get_one(&key).await? {
            let node = String::from_utf8_lossy(kv.value()).into_owned();
            if live(&node) {
                return Ok(Some(node));
            }
        }
        let Some(candidate) = candidate else {
            return Ok(None);
        };
        let ttl = kiln_server::api::idempotency::WINDOW.as_secs() as i64;
        let lease = self.grant_lease(ttl).await?;
        self.read_modify_write(std::slice::from_ref(&key), |seen| {
            if let Some(kv) = &seen[0] {
                let node = String::from_utf8_lossy(kv.value()).into_owned();
                if live(&node) {
                    return Ok(Step::Done(Some(node)));
                }
            }
            let put = TxnOp::put(
                key.as_str(),
                candidate.as_bytes(),
                Some(PutOptions::new().with_lease(lease)),
            );
            Ok(Step::Write(vec![put], Some(candidate.to_string())))
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_digests_of_the_scoped_key() {
        let t = token("team/create/k-1");
        assert_eq!(t.len(), 64);
        assert_eq!(t, token("team/create/k-1"));
        assert_ne!(t, token("other/create/k-1"));
    }
}
