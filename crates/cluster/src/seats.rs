//! A team's seats: how creates of one team through different control replicas keep the
//! team's sandbox quota together. A create first takes a seat, `seats/{team}/{uuid}` on a
//! lease of its own ([`SEAT_TTL`]), in a txn guarded by the team's gate key
//! `seat-gates/{team}` (its mod revision as read; the txn writes it again): of two replicas
//! taking a seat at the same instant, one commits and the other reads again and counts the
//! first's seat. The count is the team's live sandboxes in the replica's view at the
//! revision the seats were read at, plus the seats taken: a seat stands for a sandbox its
//! node has not published yet. The create gives its seat back when it ends (its sandbox then
//! is in the view), or the lease ends it when its replica dies mid-create. A view reaches a
//! revision when its watch has sent every change under the prefix up to it; the nodes'
//! load reports (every second) move it on when the latest write was another prefix's.

use std::future::Future;

use etcd_client::{Client, Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp, TxnOpResponse};

use crate::error::{ClusterError, Result};
use crate::keys::escape;
use crate::retry::Kind;
use crate::store::{backoff, EtcdStore, MAX_TRIES};

/// How long a seat outlives a replica that took it and died (seconds): longer than a create.
pub const SEAT_TTL: i64 = 120;

/// A seat taken for one create; given back when dropped.
pub struct Seat {
    client: Client,
    lease: i64,
}

impl Drop for Seat {
    fn drop(&mut self) {
        let (mut client, lease) = (self.client.clone(), self.lease);
        // Revoking the lease deletes the seat; when there is no runtime to do it in, the
        // lease ends it after SEAT_TTL.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                if let Err(e) = client.lease_revoke(lease).await {
                    tracing::debug!(lease, error = %e, "giving a seat back (its lease ends it)");
                }
            });
        }
    }
}

/// The answer of [`EtcdStore::take_seat`].
pub enum Taken {
    Seat(Box<Seat>),
    /// The team has `max` already: `live` sandboxes and `seats` creates under way.
    Full {
        live: usize,
        seats: usize,
    },
    /// The view that counts live sandboxes did not reach this revision.
    ViewBehind(i64),
}

impl EtcdStore {
    fn seat_dir(&self, team: &str) -> String {
        format!("{}{}/", self.keys().dir("seats"), escape(team))
    }

    fn seat_gate(&self, team: &str) -> String {
        format!("{}{}", self.keys().dir("seat-gates"), escape(team))
    }

    /// The team's seats (creates under way) and the revision they were read at.
    pub async fn seats(&self, team: &str) -> Result<(usize, i64)> {
        let opts = GetOptions::new().with_prefix().with_count_only();
        let r = self.get(&self.seat_dir(team), opts).await?;
        let rev = r.header().map(|h| h.revision()).unwrap_or(0);
        Ok((r.count() as usize, rev))
    }

    /// Takes a seat for a create of `team`, whose quota is `max` sandboxes at once;
    /// `live(revision)` counts the team's live sandboxes as of at least that revision (None:
    /// the count cannot reach it now).
    /// The seat's lease lasts `ttl_s` seconds ([`SEAT_TTL`] for a create).
    pub async fn take_seat<F, Fut>(
        &self,
        team: &str,
        max: usize,
        ttl_s: i64,
        live: F,
    ) -> Result<Taken>
    where
        F: Fn(i64) -> Fut,
        Fut: Future<Output = Option<usize>>,
    {
        let (dir, gate) = (self.seat_dir(team), self.seat_gate(team));
        let lease = self.grant_lease(ttl_s).await?;
        let seat = Seat {
            client: self.client(),
            lease,
        };
        for attempt in 0..MAX_TRIES {
            let read = Txn::new().and_then([
                TxnOp::get(gate.as_str(), None),
                TxnOp::get(
                    dir.as_str(),
                    Some(GetOptions::new().with_prefix().with_count_only()),
                ),
            ]);
            let r = self.txn(Kind::Read, read).await?;
            let rev = r.header().map(|h| h.revision()).unwrap_or(0);
            let (mut gate_rev, mut seats) = (0, 0);
            for (i, op) in r.op_responses().into_iter().enumerate() {
                if let TxnOpResponse::Get(g) = op {
                    match i {
                        0 => gate_rev = g.kvs().first().map(|kv| kv.mod_revision()).unwrap_or(0),
                        _ => seats = g.count() as usize,
                    }
                }
            }
            let Some(live) = live(rev).await else {
                return Ok(Taken::ViewBehind(rev));
            };
            if live + seats >= max {
                return Ok(Taken::Full { live, seats });
            }
            let same = if gate_rev == 0 {
                Compare::create_revision(gate.as_str(), CompareOp::Equal, 0)
            } else {
                Compare::mod_revision(gate.as_str(), CompareOp::Equal, gate_rev)
            };
            let key = format!("{dir}{}", uuid::Uuid::new_v4().simple());
            let take = Txn::new().when([same]).and_then([
                TxnOp::put(gate.as_str(), "", None),
                TxnOp::put(key, "", Some(PutOptions::new().with_lease(lease))),
            ]);
            if self.txn(Kind::Write, take).await?.succeeded() {
                return Ok(Taken::Seat(Box::new(seat)));
            }
            tokio::time::sleep(backoff(attempt)).await;
        }
        Err(ClusterError::Contended {
            key: gate,
            tries: MAX_TRIES,
        })
    }
}
