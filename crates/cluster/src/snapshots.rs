//! Snapshots on etcd. `snapshots/{id}` holds a snapshot's record and, on a cluster, the node
//! that keeps its files (a snapshot is restored on the node that took it);
//! `snapshot-names/{name}` makes a name unique cluster-wide; `snapshot-files/{id}` says where its
//! files are in object storage, when its node stored them there (then any node with its
//! template can start sandboxes from it). A snapshot deleted while its node
//! is out of the cluster leaves that node a note, `snapshot-drops/{node}/{id}`, and the node
//! deletes the files when it is back ([`EtcdStore::snapshot_drops`]).

use etcd_client::{Compare, CompareOp, Txn, TxnOp};
use kiln_server::store::SnapshotRecord;

use crate::checkpoints::CheckpointDoc;
use crate::docs::{json, parse, SnapshotDoc};
use crate::error::{ClusterError, Result};
use crate::retry::Kind;
use crate::store::{EtcdStore, Step};

/// A snapshot and where its files are.
#[derive(Debug, Clone, PartialEq)]
pub struct Located {
    pub snapshot: SnapshotRecord,
    /// The node keeping its files (None: a snapshot of a one-host server's store).
    pub node: Option<String>,
    /// A fork's capture (never listed).
    pub transient: bool,
    /// Its source's network settings for creates from it, sealed (base64; None: none).
    pub network: Option<String>,
}

impl From<SnapshotDoc> for Located {
    fn from(mut d: SnapshotDoc) -> Self {
        let (node, network) = (d.node.take(), d.network.take());
        let transient = d.transient;
        Self {
            snapshot: d.into(),
            node,
            transient,
            network,
        }
    }
}

/// A snapshot deleted while its node was away, as the note left for the node has it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SnapshotDrop {
    pub id: String,
    pub team: String,
}

impl EtcdStore {
    /// Records snapshot `s`, kept on `node`; [`ClusterError::Exists`] when its id or name is
    /// taken.
    pub async fn insert_snapshot_at(&self, s: &SnapshotRecord, node: Option<&str>) -> Result<()> {
        self.insert_snapshot_doc(s, node, false, None).await
    }

    /// Records snapshot `s`, kept on `node`, with its source's sealed network settings for
    /// creates from it (`network`, see [`Located::network`]).
    pub async fn insert_snapshot_with_network(
        &self,
        s: &SnapshotRecord,
        node: &str,
        network: Option<String>,
    ) -> Result<()> {
        self.insert_snapshot_doc(s, Some(node), false, network)
            .await
    }

    /// Records `s`, a fork's capture kept on `node` for children on other nodes: found by id,
    /// never listed.
    pub async fn insert_fork_capture(&self, s: &SnapshotRecord, node: &str) -> Result<()> {
        self.insert_snapshot_doc(s, Some(node), true, None).await
    }

    async fn insert_snapshot_doc(
        &self,
        s: &SnapshotRecord,
        node: Option<&str>,
        transient: bool,
        network: Option<String>,
    ) -> Result<()> {
        let doc = SnapshotDoc {
            node: node.map(str::to_string),
            transient,
            network,
            ..SnapshotDoc::from(s)
        };
        let k = self.keys();
        let mut absent = vec![k.snapshot(&s.id)];
        let mut ops = vec![TxnOp::put(k.snapshot(&s.id), json(&doc), None)];
        if let Some(name) = &s.name {
            absent.push(k.snapshot_name(name));
            ops.push(TxnOp::put(k.snapshot_name(name), s.id.as_bytes(), None));
        }
        if !self.create(&absent, ops).await? {
            return Err(ClusterError::Exists {
                what: "snapshot",
                id: s.name.clone().unwrap_or_else(|| s.id.clone()),
            });
        }
        Ok(())
    }

    /// The snapshot whose id or name is `key`.
    pub async fn snapshot_at(&self, key: &str) -> Result<Option<Located>> {
        let k = self.keys();
        let seen = self
            .get_many(&[k.snapshot(key), k.snapshot_name(key)])
            .await?;
        let kv = match (&seen[0], &seen[1]) {
            (Some(kv), _) => Some(kv.clone()),
            (None, Some(name)) => {
                let id = String::from_utf8_lossy(name.value()).into_owned();
                self.get_one(&k.snapshot(&id)).await?
            }
            (None, None) => None,
        };
        kv.map(|kv| Ok(parse::<SnapshotDoc>(kv.key(), kv.value())?.into()))
            .transpose()
    }

    /// Every snapshot, oldest first.
    pub async fn snapshots_at(&self) -> Result<Vec<Located>> {
        let mut out: Vec<Located> = Vec::new();
        for kv in self.get_prefix(&self.keys().dir("snapshots"), 0).await? {
            out.push(parse::<SnapshotDoc>(kv.key(), kv.value())?.into());
        }
        out.sort_by(|a, b| {
            let (a, b) = (&a.snapshot, &b.snapshot);
            (a.created_at_ms, &a.id).cmp(&(b.created_at_ms, &b.id))
        });
        Ok(out)
    }

    /// Deletes snapshot `id` (and its name); with `away`, leaves the node that keeps its files
    /// a note to delete them. False when there was no such snapshot.
    pub async fn delete_snapshot_at(&self, id: &str, away: Option<&str>) -> Result<bool> {
        let key = self.keys().snapshot(id);
        self.read_modify_write(std::slice::from_ref(&key), |seen| {
            let Some(kv) = &seen[0] else {
                return Ok(Step::Done(false));
            };
            let s: SnapshotDoc = parse(kv.key(), kv.value())?;
            let mut ops = vec![
                TxnOp::delete(key.as_str(), None),
                TxnOp::delete(self.keys().snapshot_files(&s.id), None),
            ];
            if let Some(name) = &s.name {
                ops.push(TxnOp::delete(self.keys().snapshot_name(name), None));
            }
            if let Some(node) = away {
                let note = SnapshotDrop {
                    id: s.id.clone(),
                    team: s.team.clone(),
                };
                ops.push(TxnOp::put(
                    self.keys().snapshot_drop(node, &s.id),
                    json(&note),
                    None,
                ));
            }
            Ok(Step::Write(ops, true))
        })
        .await
    }

    /// Records where snapshot `id`'s files are in object storage; false when the snapshot was
    /// deleted meanwhile (nothing is written).
    pub async fn put_snapshot_files(&self, id: &str, doc: &CheckpointDoc) -> Result<bool> {
        let k = self.keys();
        let exists = Compare::create_revision(k.snapshot(id), CompareOp::Greater, 0);
        let txn =
            Txn::new()
                .when([exists])
                .and_then([TxnOp::put(k.snapshot_files(id), json(doc), None)]);
        Ok(self.txn(Kind::Write, txn).await?.succeeded())
    }

    /// Where snapshot `id`'s files are in object storage (None: only on its node).
    pub async fn snapshot_files(&self, id: &str) -> Result<Option<CheckpointDoc>> {
        match self.get_one(&self.keys().snapshot_files(id)).await? {
            Some(kv) => Ok(Some(parse(kv.key(), kv.value())?)),
            None => Ok(None),
        }
    }

    /// The snapshots deleted while `node` was away, whose files it still has.
    pub async fn snapshot_drops(&self, node: &str) -> Result<Vec<SnapshotDrop>> {
        let mut out = Vec::new();
        for kv in self
            .get_prefix(&self.keys().snapshot_drops_of(node), 0)
            .await?
        {
            out.push(parse::<SnapshotDrop>(kv.key(), kv.value())?);
        }
        Ok(out)
    }

    /// Removes `node`'s note about snapshot `id` (its files are gone).
    pub async fn forget_snapshot_drop(&self, node: &str, id: &str) -> Result<()> {
        let key = self.keys().snapshot_drop(node, id);
        self.commit(vec![TxnOp::delete(key, None)]).await
    }
}
