//! A node restarting: `kiln node` stopped by SIGTERM or SIGINT leaves its sandboxes running
//! (as `kiln serve` does) and a mark under `restarting/{name}`, on a lease of its own that
//! lasts the node's restart grace (`kiln node --restart-grace`). While the mark is there the
//! cluster holds the node's running sandboxes as they are instead of ending them
//! `died: node-lost` (calls to them answer 503 saying the node is restarting); the node back on
//! its state directory clears the mark and publishes its sandboxes again, so an upgrade or a
//! restart loses none. Past the grace the mark is gone with its lease and the node's sandboxes
//! are ended as a lost node's are. A node that loses its lease (killed, cut off) leaves no mark.

use std::time::Duration;

use etcd_client::{PutOptions, Txn, TxnOp};
use kiln_server::store::now_ms;
use serde::{Deserialize, Serialize};

use crate::docs::json;
use crate::error::Result;
use crate::retry::Kind;
use crate::store::EtcdStore;

/// The stored mark.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestartMark {
    pub since_ms: i64,
    /// How long the node's sandboxes are held.
    pub grace_s: u64,
}

impl EtcdStore {
    /// Marks node `name` restarting for `grace` (at least a second).
    pub async fn mark_restarting(&self, name: &str, grace: Duration) -> Result<()> {
        let grace_s = grace.as_secs().max(1);
        let lease = self.grant_lease(grace_s as i64).await?;
        let mark = RestartMark {
            since_ms: now_ms(),
            grace_s,
        };
        let put = TxnOp::put(
            self.keys().restarting(name),
            json(&mark),
            Some(PutOptions::new().with_lease(lease)),
        );
        self.txn(Kind::Write, Txn::new().and_then([put])).await?;
        Ok(())
    }

    /// Clears node `name`'s restart mark (it is back); whether there was one.
    pub async fn clear_restarting(&self, name: &str) -> Result<bool> {
        let key = self.keys().restarting(name);
        let r = self
            .txn(Kind::Write, Txn::new().and_then([TxnOp::delete(key, None)]))
            .await?;
        Ok(r.op_responses()
            .into_iter()
            .any(|op| matches!(op, etcd_client::TxnOpResponse::Delete(d) if d.deleted() > 0)))
    }
}
