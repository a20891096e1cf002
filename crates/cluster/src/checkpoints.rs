//! Paused sandboxes' checkpoints in object storage, as the cluster records them: under
//! `checkpoints/{id}` the node that stored it and, for each file of the paused sandbox (the
//! driver's list), its path and the manifest id of its chunks in the bucket. The record is
//! written by the owning node after its upload (guarded: only while `owners/{id}` names that
//! node) and dropped in the same transaction as any publication of the sandbox in a state
//! other than paused (see [`EtcdStore::publish_sandbox`]), so a record always describes the
//! latest pause. Ownership moves with [`EtcdStore::move_owner`], a revision-checked write:
//! of two nodes taking one paused sandbox over, one wins.

use std::path::{Component, Path};

use etcd_client::{Compare, CompareOp, Txn, TxnOp};
use kiln_server::store::{SandboxRecord, SandboxState};
use serde::{Deserialize, Serialize};

use crate::docs::{json, parse, SandboxDoc};
use crate::error::Result;
use crate::retry::Kind;
use crate::store::EtcdStore;

/// One file of a stored checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointFile {
    /// Relative to the paused sandbox's directory (the driver's path).
    pub path: String,
    /// The chunk store's manifest id of its bytes.
    pub manifest: String,
    pub size: u64,
}

/// Where a paused sandbox's checkpoint is in object storage.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointDoc {
    /// The node that stored it.
    pub node: String,
    pub files: Vec<CheckpointFile>,
    /// The bytes of its files, and those the upload sent (the bucket lacked them).
    pub bytes: u64,
    pub bytes_uploaded: u64,
    /// How long the upload took, in ms.
    pub upload_ms: u64,
    pub at_ms: i64,
    /// The sandbox's network settings (`rules`, `egressProxy`, `iam`) as its node recorded
    /// them, sealed by the cluster's vault (base64): the node taking it over attaches them
    /// before it runs (None: it has none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<String>,
}

impl CheckpointFile {
    /// Whether `path` stays inside the directory it is relative to (plain names only).
    pub fn safe_path(path: &str) -> bool {
        let p = Path::new(path);
        !path.is_empty() && p.components().all(|c| matches!(c, Component::Normal(_)))
    }
}

/// What became of a take-over of a paused sandbox.
#[derive(Debug, Clone, PartialEq)]
pub enum Moved {
    /// The node now owns it; the record as it was read (paused).
    To(Box<SandboxRecord>),
    /// It is not paused (or no longer exists): nothing moved.
    NotPaused,
    /// Another node owns it now (`owners/{id}` named neither the old owner nor this node).
    Taken(String),
}

impl EtcdStore {
    /// Records `doc` for sandbox `id`, provided `owners/{id}` still names `doc.node`; false
    /// when it does not (the sandbox moved meanwhile).
    pub async fn put_checkpoint(&self, id: &str, doc: &CheckpointDoc) -> Result<bool> {
        let k = self.keys();
        let owned = Compare::value(k.owner(id), CompareOp::Equal, doc.node.as_bytes());
        let txn =
            Txn::new()
                .when([owned])
                .and_then([TxnOp::put(k.checkpoint(id), json(doc), None)]);
        Ok(self.txn(Kind::Write, txn).await?.succeeded())
    }

    /// The checkpoint of sandbox `id` in object storage, if its latest pause stored one.
    pub async fn checkpoint(&self, id: &str) -> Result<Option<CheckpointDoc>> {
        match self.get_one(&self.keys().checkpoint(id)).await? {
            Some(kv) => Ok(Some(parse(kv.key(), kv.value())?)),
            None => Ok(None),
        }
    }

    /// The manifest ids every checkpoint record, every snapshot's and every template's files
    /// record names: what the bucket's garbage collection must keep. One read of each
    /// directory; a record that does not parse fails it (the collection then deletes nothing).
    pub async fn live_manifests(&self) -> Result<std::collections::HashSet<String>> {
        let mut live = std::collections::HashSet::new();
        for dir in ["checkpoints", "snapshot-files"] {
            for kv in self.get_prefix(&self.keys().dir(dir), 0).await? {
                let doc: CheckpointDoc = parse(kv.key(), kv.value())?;
                live.extend(doc.files.into_iter().map(|f| f.manifest));
            }
        }
        live.extend(self.template_manifests().await?);
        Ok(live)
    }

    /// The node recorded as owning sandbox `id`.
    pub async fn owner_of(&self, id: &str) -> Result<Option<String>> {
        Ok(self
            .get_one(&self.keys().owner(id))
            .await?
            .map(|kv| String::from_utf8_lossy(kv.value()).into_owned()))
    }

    /// Makes node `to` the owner of paused sandbox `id`, taken from node `from`: one
    /// transaction that holds only while the sandbox's record and owner are as read (paused,
    /// owned by `from`, or by `to` already when an earlier take-over stopped half-way).
    pub async fn move_owner(&self, id: &str, from: &str, to: &str) -> Result<Moved> {
        let k = self.keys();
        let (skey, okey) = (k.sandbox(id), k.owner(id));
        let Some(rec_kv) = self.get_one(&skey).await? else {
            return Ok(Moved::NotPaused);
        };
        let rec: SandboxRecord = parse::<SandboxDoc>(rec_kv.key(), rec_kv.value())?.into();
        if rec.state != SandboxState::Paused {
            return Ok(Moved::NotPaused);
        }
        let owner_kv = self.get_one(&okey).await?;
        let owner = owner_kv
            .as_ref()
            .map(|kv| String::from_utf8_lossy(kv.value()).into_owned());
        match owner.as_deref() {
            Some(o) if o == to => return Ok(Moved::To(Box::new(rec))),
            Some(o) if o != from => return Ok(Moved::Taken(o.to_string())),
            _ => {}
        }
        let owner_same = match &owner_kv {
            Some(kv) => Compare::mod_revision(okey.as_str(), CompareOp::Equal, kv.mod_revision()),
            None => Compare::create_revision(okey.as_str(), CompareOp::Equal, 0),
        };
        let rec_same =
            Compare::mod_revision(skey.as_str(), CompareOp::Equal, rec_kv.mod_revision());
        let txn = Txn::new()
            .when([owner_same, rec_same])
            .and_then([TxnOp::put(okey.as_str(), to.as_bytes(), None)]);
        if self.txn(Kind::Write, txn).await?.succeeded() {
            return Ok(Moved::To(Box::new(rec)));
        }
        match self.owner_of(id).await?.as_deref() {
            Some(o) if o == to => Ok(Moved::To(Box::new(rec))),
            Some(o) if o != from => Ok(Moved::Taken(o.to_string())),
            _ => Ok(Moved::NotPaused),
        }
    }
}

/// The 409 of a paused sandbox whose checkpoint is only on its node's disk.
pub fn no_checkpoint(id: &str, node: &str) -> kiln_server::Error {
    kiln_server::Error::Conflict(format!(
        "sandbox \"{id}\" is paused on node {node} and its checkpoint lives on that node's \
         disk only (no object store is configured there, or the pause predates it): it \
         resumes only on node {node}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_relative_paths_are_safe() {
        for ok in ["disk.img", "checkpoint/checkpoint.img", "a/b/c"] {
            assert!(CheckpointFile::safe_path(ok), "{ok}");
        }
        for bad in ["", "/etc/passwd", "../x", "a/../../b", "./a", "a/./b/.."] {
            assert!(!CheckpointFile::safe_path(bad), "{bad}");
        }
    }
}
