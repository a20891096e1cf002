//! Snapshots through a control replica. A snapshot is taken by the node that runs its source
//! and stays there; etcd records it with that node's name, so every replica lists it (read
//! from etcd, not from the replica's view) and a create from it is placed on that node only.
//! When its node is away or draining, a create from it goes to any node if its files are in
//! object storage (the node borrows them); else it answers 503 (away) or 409 (draining).
//! Deleting goes to its node; while that node is away, the record goes at once and the node
//! removes the files when it is back.

use kiln_server::manager::{check_snapshot_name, snapshot_key};
use kiln_server::store::SnapshotRecord;
use kiln_server::Error;

use super::service::ClusterService;
use crate::nodes::NodeInfo;
use crate::snapshots::Located;
use crate::wire::{CreateDoc, Op};

type Result<T, E = Error> = std::result::Result<T, E>;

impl ClusterService {
    /// Takes a snapshot of sandbox `id` (of `team`) on the node that runs it.
    pub(super) async fn take_snapshot(
        &self,
        id: &str,
        team: &str,
        name: Option<String>,
        memory: bool,
    ) -> Result<SnapshotRecord> {
        if let Some(n) = &name {
            check_snapshot_name(n)?;
        }
        let op = Op::Snapshot {
            team: team.to_string(),
            name,
            memory,
        };
        let a = self.call(id, op).await?;
        a.snapshot
            .map(SnapshotRecord::from)
            .ok_or_else(|| Error::internal("the node answered a snapshot without its record"))
    }

    /// The snapshot of `team` that `key` (an id or name, `:tag` allowed) names.
    pub(super) async fn located(&self, key: &str, team: &str) -> Result<Option<Located>> {
        let Some(k) = snapshot_key(key) else {
            return Ok(None);
        };
        let found = self.etcd.snapshot_at(k).await?;
        Ok(found.filter(|l| l.snapshot.team == team))
    }

    /// `team`'s snapshots, oldest first, optionally of one sandbox or with one name.
    pub(super) async fn team_snapshots(
        &self,
        team: &str,
        sandbox_id: Option<&str>,
        name: Option<&str>,
    ) -> Result<Vec<SnapshotRecord>> {
        let all = self.etcd.snapshots_at().await?;
        Ok(all
            .into_iter()
            .filter(|l| !l.transient)
            .map(|l| l.snapshot)
            .filter(|s| s.team == team)
            .filter(|s| sandbox_id.is_none_or(|id| s.sandbox_id == id))
            .filter(|s| {
                name.is_none_or(|n| snapshot_key(n).is_some_and(|k| s.name.as_deref() == Some(k)))
            })
            .collect())
    }

    /// Deletes `team`'s snapshot `key`: on its node, or (the node being away) its record now
    /// and its files when the node is back.
    pub(super) async fn drop_snapshot(&self, key: &str, team: &str) -> Result<()> {
        if snapshot_key(key).is_none() {
            return Err(Error::bad_request(format!("invalid snapshot id {key:?}")));
        }
        let Some(l) = self.located(key, team).await? else {
            return Err(Error::NotFound(format!("snapshot {key:?} not found")));
        };
        let id = &l.snapshot.id;
        match l.node.as_deref().and_then(|name| self.live_node(name)) {
            Some(node) => self.nodes.delete_snapshot(&node.address, id, team).await,
            None => Ok(self
                .etcd
                .delete_snapshot_at(id, l.node.as_deref())
                .await
                .map(drop)?),
        }
    }

    /// Where create `doc` runs when its `templateID` names a snapshot of `team`: on the node
    /// that keeps the snapshot while that node is live and takes sandboxes (the answer);
    /// else, when the snapshot's files are in object storage, on any node, which borrows
    /// them (`doc.snapshot` set, None answered). None as well when it names no snapshot.
    pub(super) async fn snapshot_home(
        &self,
        doc: &mut CreateDoc,
        team: &str,
    ) -> Result<Option<NodeInfo>> {
        let template_id = doc.template_id.as_str();
        let Some(l) = self.located(template_id, team).await? else {
            return Ok(None);
        };
        let Some(name) = l.node else {
            return Err(Error::Conflict(format!(
                "snapshot {template_id:?} is in the state of a one-host server, not on a node"
            )));
        };
        let home = self.live_node(&name);
        if home.is_some() && !self.cache.is_draining(&name) {
            return Ok(home);
        }
        if self.etcd.snapshot_files(&l.snapshot.id).await?.is_some() {
            doc.snapshot = Some(l.snapshot.id);
            return Ok(None);
        }
        if home.is_none() {
            return Err(Error::Unavailable(format!(
                "snapshot {template_id:?} is kept on node {name}, which is not in the cluster \
                 now, and not in object storage; retry once the node is back"
            )));
        }
        Err(Error::Conflict(format!(
            "snapshot {template_id:?} is kept on node {name}, which is draining and takes no \
             new sandboxes, and not in object storage"
        )))
    }

    /// The nodes that can borrow the snapshot of create `doc` (`doc.snapshot`): those that can
    /// run the template the snapshot's sandbox was made of.
    pub(super) async fn snapshot_borrowers(
        &self,
        doc: &CreateDoc,
        team: &str,
    ) -> Result<Vec<NodeInfo>> {
        let nodes = self.candidates();
        let id = doc.snapshot.as_deref().unwrap_or(&doc.template_id);
        match self.located(id, team).await? {
            Some(l) => Ok(self.able_to_run(nodes, &l.snapshot.template_id).await),
            None => Ok(nodes),
        }
    }

    fn live_node(&self, name: &str) -> Option<NodeInfo> {
        self.cache.nodes().into_iter().find(|n| n.name == name)
    }
}
