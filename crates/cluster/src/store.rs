//! [`EtcdStore`]: a connection to an etcd cluster and the read and revision-checked write
//! primitives every state method is built from.

use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, GetOptions, KeyValue, SortOrder, SortTarget, Txn,
    TxnOp, TxnOpResponse,
};

use crate::error::{ClusterError, Result};
use crate::keys::Keys;
use crate::retry::{self, Kind};

/// How often a revision-checked write is tried before it gives up with
/// [`ClusterError::Contended`].
pub(crate) const MAX_TRIES: u32 = 64;

/// kiln's state in an etcd v3 cluster, under one key prefix (see [`crate::keys`]).
#[derive(Clone)]
pub struct EtcdStore {
    client: Client,
    keys: Keys,
}

/// What a read-modify-write decided after seeing the keys it read.
pub(crate) enum Step<R> {
    /// Nothing to write.
    Done(R),
    /// Commit these operations, provided none of the keys read changed since.
    Write(Vec<TxnOp>, R),
}

impl EtcdStore {
    /// Connects to the cluster members at `endpoints` (`http://host:port`); the store's keys
    /// live under `prefix` (e.g. `/kiln`). Requests go to a member that has a leader, and a
    /// member that stops answering is left for the others.
    pub async fn connect(endpoints: &[String], prefix: &str) -> Result<Self> {
        let opts = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(2))
            .with_timeout(Duration::from_secs(5))
            .with_keep_alive(Duration::from_secs(2), Duration::from_secs(2))
            .with_require_leader(true);
        let client = Client::connect(endpoints, Some(opts)).await?;
        Ok(Self::with_client(client, prefix))
    }

    /// A store over a client made elsewhere.
    pub fn with_client(client: Client, prefix: &str) -> Self {
        Self {
            client,
            keys: Keys::new(prefix),
        }
    }

    /// The etcd client (a cheap clone sharing the connections).
    pub fn client(&self) -> Client {
        self.client.clone()
    }

    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    /// A read of `key` with `opts` (tried again while the cluster is failing over).
    pub(crate) async fn get(
        &self,
        key: &str,
        opts: GetOptions,
    ) -> Result<etcd_client::GetResponse> {
        Ok(retry::run(&self.client, Kind::Read, |mut c| {
            let opts = opts.clone();
            async move { c.get(key, Some(opts)).await }
        })
        .await?)
    }

    /// The store's revision now: a linearizable read, so every write committed before the
    /// call is at or below it.
    pub(crate) async fn revision(&self) -> Result<i64> {
        let opts = GetOptions::new().with_count_only();
        let r = self.get(&self.keys.dir("owners"), opts).await?;
        Ok(r.header().map_or(0, |h| h.revision()))
    }

    /// One txn (a write unless it only reads).
    pub(crate) async fn txn(&self, kind: Kind, txn: Txn) -> Result<etcd_client::TxnResponse> {
        Ok(retry::run(&self.client, kind, |mut c| {
            let txn = txn.clone();
            async move { c.txn(txn).await }
        })
        .await?)
    }

    /// A new lease of `ttl_s` seconds, its id (tried again while the cluster is failing over:
    /// a repeated grant leaves at most an unused lease, which expires by itself).
    pub(crate) async fn grant_lease(&self, ttl_s: i64) -> Result<i64> {
        let r = retry::run(&self.client, Kind::Read, |mut c| async move {
            c.lease_grant(ttl_s, None).await
        })
        .await?;
        Ok(r.id())
    }

    /// The value at `key`, if any.
    pub(crate) async fn get_one(&self, key: &str) -> Result<Option<KeyValue>> {
        let mut r = self.get(key, GetOptions::new()).await?;
        Ok(r.take_kvs().into_iter().next())
    }

    /// Every key under `prefix`, in key order (at `revision` when non-zero).
    pub(crate) async fn get_prefix(&self, prefix: &str, revision: i64) -> Result<Vec<KeyValue>> {
        Ok(self.get_prefix_at(prefix, revision).await?.0)
    }

    /// Every key under `prefix`, in key order, read in pages of [`PAGE`] keys at one revision
    /// (`revision`, else the first page's): one answer for a large directory (ten thousand
    /// sandboxes) would pass the client's message limit of 4 MiB. Returns them with the
    /// revision read at.
    pub(crate) async fn get_prefix_at(
        &self,
        prefix: &str,
        revision: i64,
    ) -> Result<(Vec<KeyValue>, i64)> {
        let end = prefix_end(prefix);
        let (mut out, mut rev, mut start) = (Vec::new(), revision, prefix.as_bytes().to_vec());
        loop {
            let mut opts = GetOptions::new().with_range(end.clone()).with_limit(PAGE);
            if rev > 0 {
                opts = opts.with_revision(rev);
            }
            let mut r = retry::run(&self.client, Kind::Read, |mut c| {
                let (start, opts) = (start.clone(), opts.clone());
                async move { c.get(start, Some(opts)).await }
            })
            .await?;
            if rev <= 0 {
                rev = r.header().map_or(0, |h| h.revision());
            }
            let more = r.more();
            let kvs = r.take_kvs();
            match kvs.last() {
                Some(last) if more => {
                    start = last.key().to_vec();
                    start.push(0);
                }
                _ => {
                    out.extend(kvs);
                    return Ok((out, rev));
                }
            }
            out.extend(kvs);
        }
    }

    /// Keys in `[start, end)` in key order, at most `limit` (0: all).
    pub(crate) async fn get_range(
        &self,
        start: &str,
        end: &str,
        limit: i64,
        keys_only: bool,
    ) -> Result<Vec<KeyValue>> {
        let mut opts = GetOptions::new().with_range(end).with_limit(limit);
        if keys_only {
            opts = opts.with_keys_only();
        }
        Ok(self.get(start, opts).await?.take_kvs())
    }

    /// Keys under `prefix` created after revision `after`, oldest first, at most `limit`, read
    /// at `revision` (0: now). Returns them with the revision read at.
    pub(crate) async fn created_after(
        &self,
        prefix: &str,
        after: i64,
        limit: i64,
        revision: i64,
    ) -> Result<(Vec<KeyValue>, i64)> {
        let mut opts = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Ascend)
            .with_limit(limit)
            .with_min_create_revision(after.saturating_add(1).max(0));
        if revision > 0 {
            opts = opts.with_revision(revision);
        }
        let mut r = self.get(prefix, opts).await?;
        let rev = r.header().map(|h| h.revision()).unwrap_or(revision);
        Ok((r.take_kvs(), rev))
    }

    /// The values at `keys`, all read at one revision (one etcd txn of gets).
    pub(crate) async fn get_many(&self, keys: &[String]) -> Result<Vec<Option<KeyValue>>> {
        if keys.len() == 1 {
            return Ok(vec![self.get_one(&keys[0]).await?]);
        }
        let ops: Vec<TxnOp> = keys.iter().map(|k| TxnOp::get(k.as_str(), None)).collect();
        let r = self.txn(Kind::Read, Txn::new().and_then(ops)).await?;
        Ok(r.op_responses()
            .into_iter()
            .map(|op| match op {
                TxnOpResponse::Get(mut g) => g.take_kvs().into_iter().next(),
                _ => None,
            })
            .collect())
    }

    /// One txn that succeeds only when every key in `absent` is missing; false when one exists.
    pub(crate) async fn create(&self, absent: &[String], ops: Vec<TxnOp>) -> Result<bool> {
        let cmp: Vec<Compare> = absent
            .iter()
            .map(|k| Compare::create_revision(k.as_str(), CompareOp::Equal, 0))
            .collect();
        let r = self
            .txn(Kind::Write, Txn::new().when(cmp).and_then(ops))
            .await?;
        Ok(r.succeeded())
    }

    /// One unconditional txn.
    pub(crate) async fn commit(&self, ops: Vec<TxnOp>) -> Result<()> {
        self.txn(Kind::Write, Txn::new().and_then(ops)).await?;
        Ok(())
    }

    /// Commits `ops` in one txn, provided each of `keys` still is as `seen` (same mod
    /// revision, or still absent); false when one changed.
    pub(crate) async fn commit_guarded(
        &self,
        keys: &[String],
        seen: &[Option<KeyValue>],
        ops: Vec<TxnOp>,
    ) -> Result<bool> {
        let cmp: Vec<Compare> = keys
            .iter()
            .zip(seen)
            .map(|(k, kv)| match kv {
                Some(kv) => Compare::mod_revision(k.as_str(), CompareOp::Equal, kv.mod_revision()),
                None => Compare::create_revision(k.as_str(), CompareOp::Equal, 0),
            })
            .collect();
        let r = self
            .txn(Kind::Write, Txn::new().when(cmp).and_then(ops))
            .await?;
        Ok(r.succeeded())
    }

    /// Reads `keys` at one revision, lets `plan` decide what to write from what it saw, and
    /// commits that in one txn guarded by the mod revision of every key read (or its absence).
    /// When another writer got in between, reads and plans again.
    pub(crate) async fn read_modify_write<R>(
        &self,
        keys: &[String],
        mut plan: impl FnMut(&[Option<KeyValue>]) -> Result<Step<R>>,
    ) -> Result<R> {
        for attempt in 0..MAX_TRIES {
            let seen = self.get_many(keys).await?;
            let (ops, out) = match plan(&seen)? {
                Step::Done(out) => return Ok(out),
                Step::Write(ops, out) => (ops, out),
            };
            if self.commit_guarded(keys, &seen, ops).await? {
                return Ok(out);
            }
            tokio::time::sleep(backoff(attempt)).await;
        }
        Err(ClusterError::Contended {
            key: keys.first().cloned().unwrap_or_default(),
            tries: MAX_TRIES,
        })
    }
}

/// Keys per page of a directory read ([`EtcdStore::get_prefix_at`]).
const PAGE: i64 = 1000;

/// The end of the key range of `prefix`: the prefix with its last byte that can grow grown.
fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(b) = end.pop() {
        if b < 0xff {
            end.push(b + 1);
            return end;
        }
    }
    // Every byte 0xff (or empty): to the end of the key space.
    vec![0]
}

/// A short wait that grows with the attempt and differs between racing writers.
pub(crate) fn backoff(attempt: u32) -> Duration {
    let jitter = u64::from(uuid::Uuid::new_v4().as_bytes()[0] % 8);
    Duration::from_millis((u64::from(attempt.min(10)) * 3 + jitter).min(40))
}

#[cfg(test)]
mod tests {
    use super::prefix_end;

    #[test]
    fn a_prefix_range_ends_after_its_last_key() {
        assert_eq!(prefix_end("/kiln/sandboxes/"), b"/kiln/sandboxes0".to_vec());
        assert_eq!(prefix_end("a\u{7f}"), b"a\x80".to_vec());
        assert_eq!(prefix_end(""), vec![0]);
    }
}
