//! Where a resume of a paused sandbox runs: on its node when that node is live and not
//! draining; else on another node, which takes the sandbox over from its checkpoint in object
//! storage (placed as a create is). A paused sandbox whose checkpoint is only on its node's
//! disk resumes there (a draining node) or answers 409 (a lost node). After a move, the old
//! node (when live) drops its copy. The leading replica also moves the paused sandboxes of a
//! draining node, paused, to other nodes one at a time ([`ClusterService::move_off_draining`]),
//! so that a drained node ends up holding nothing paused that object storage can carry.

use std::collections::HashSet;

use kiln_server::store::SandboxState;
use kiln_server::{Error, SandboxService};

use super::placement;
use super::service::{ClusterService, VIEW_WAIT};
use crate::checkpoints::no_checkpoint;
use crate::nodes::NodeInfo;
use crate::wire::{Op, OpAnswer};

type Result<T, E = Error> = std::result::Result<T, E>;

/// What became of one paused sandbox of a draining node.
#[derive(Debug)]
pub(super) enum DrainMove {
    /// Moved, paused, to this node.
    Moved(String),
    /// It stays: its checkpoint is on its node's disk only.
    NoCheckpoint,
    /// No other node could take it now, or the move failed.
    Failed(Error),
}

impl ClusterService {
    /// Moves one paused sandbox of a live draining node (none in `skip`) to another node,
    /// still paused: the other node takes it over from its checkpoint in object storage and
    /// the drained node drops its copy. None when no such sandbox is left.
    pub(super) async fn move_off_draining(
        &self,
        skip: &HashSet<String>,
    ) -> Option<(String, DrainMove)> {
        let live = self.cache.nodes();
        let (from, id) = live
            .iter()
            .filter(|n| self.cache.is_draining(&n.name))
            .find_map(|n| {
                let id = self
                    .cache
                    .paused_on(&n.name)
                    .into_iter()
                    .find(|id| !skip.contains(id))?;
                Some((n.clone(), id))
            })?;
        let outcome = match self.etcd.checkpoint(&id).await {
            Ok(None) => DrainMove::NoCheckpoint,
            Ok(Some(_)) => self.adopt_elsewhere(&id, &from).await,
            Err(e) => DrainMove::Failed(Error::Unavailable(format!(
                "reading the checkpoint record: {e}"
            ))),
        };
        Some((id, outcome))
    }

    async fn adopt_elsewhere(&self, id: &str, from: &NodeInfo) -> DrainMove {
        let op = Op::Adopt {
            from: from.name.clone(),
        };
        match self.on_another_node(id, &from.name, &op).await {
            Ok((to, a)) => {
                self.cache.wait_for(a.revision, VIEW_WAIT).await;
                if let Err(e) = self.nodes.op(&from.address, id, &Op::Release).await {
                    tracing::warn!(sandbox = %id, node = %from.name, error = %e, "dropping a moved sandbox's old copy");
                }
                DrainMove::Moved(to.name)
            }
            Err(e) => DrainMove::Failed(e),
        }
    }

    /// Sends `op` for paused sandbox `id` to a node other than `from`, placed as a create is
    /// (best of k by free memory), trying up to three while they cannot be reached: the node
    /// that answered and its answer. Err: a node's refusal, else the last node unreachable,
    /// else no node to try (`Capacity`).
    async fn on_another_node(&self, id: &str, from: &str, op: &Op) -> Result<(NodeInfo, OpAnswer)> {
        let memory_mb = u64::from(self.config().default_memory_mb);
        let mut nodes = self.candidates();
        nodes.retain(|n| n.name != from);
        if let Some(r) = self.cache.sandbox(id) {
            nodes = self.able_to_run(nodes, &r.template_id).await;
        }
        let mut last = None;
        for _ in 0..3 {
            let Some(to) = placement::place(
                &nodes,
                memory_mb,
                placement::DEFAULT_K,
                placement::random_index,
            )
            .cloned() else {
                break;
            };
            match self.nodes.op(&to.address, id, op).await {
                Ok(a) => return Ok((to, a)),
                Err(Error::Unavailable(m)) => {
                    tracing::warn!(node = %to.name, error = %m, "a paused sandbox's move to another node");
                    nodes.retain(|n| n.name != to.name);
                    last = Some(Error::Unavailable(m));
                }
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or_else(|| Error::Capacity {
            limit: "no other node can take a paused sandbox now".into(),
            retry_after_secs: 5,
            quota: false,
        }))
    }

    /// The live node that owns `id` once this replica's view shows an owner other than
    /// `from` (within [`VIEW_WAIT`]).
    async fn new_owner(&self, id: &str, from: &str) -> Option<NodeInfo> {
        let start = tokio::time::Instant::now();
        loop {
            match self.cache.owner(id) {
                Some(n) if n.name != from => return Some(n),
                _ if start.elapsed() >= VIEW_WAIT => return None,
                _ => tokio::time::sleep(std::time::Duration::from_millis(20)).await,
            }
        }
    }

    /// Whether a resume of paused sandbox `id` would run it on another node (its node is not
    /// live, or draining).
    pub(super) fn moves_on_resume(&self, id: &str) -> bool {
        self.cache
            .owner(id)
            .is_none_or(|n| self.cache.is_draining(&n.name))
    }

    /// A resume (`connect`: a connect) of `id`, on the node it should run on.
    pub(super) async fn resume_op(
        &self,
        id: &str,
        memory: bool,
        secs: i64,
        connect: bool,
    ) -> Result<OpAnswer> {
        let here = if connect {
            Op::Connect { secs, memory }
        } else {
            Op::Resume { memory, secs }
        };
        let rec = self.get(id)?;
        let live = self.cache.owner(id);
        if rec.state != SandboxState::Paused || !self.moves_on_resume(id) {
            return self.call(id, here).await;
        }
        let Some(from) = self.cache.owner_name(id) else {
            return Err(Error::SandboxNotFound(id.to_string()));
        };
        let stored = self.etcd.checkpoint(id).await.map_err(|e| {
            tracing::warn!(sandbox = id, error = %e, "reading a checkpoint record");
            Error::Unavailable("the cluster's state is unreachable; retry".into())
        })?;
        if stored.is_none() {
            // A draining node's paused sandbox without a stored checkpoint resumes there.
            if live.is_some() {
                return self.call(id, here).await;
            }
            return Err(no_checkpoint(id, &from));
        }
        let op = Op::TakeOver {
            from: from.clone(),
            memory,
            secs,
            connect,
        };
        match self.on_another_node(id, &from, &op).await {
            Ok((_, a)) => {
                self.cache.wait_for(a.revision, VIEW_WAIT).await;
                if let Some(old) = live {
                    let nodes = self.nodes.clone();
                    let id = id.to_string();
                    tokio::spawn(async move {
                        if let Err(e) = nodes.op(&old.address, &id, &Op::Release).await {
                            tracing::warn!(sandbox = %id, node = %old.name, error = %e, "dropping a moved sandbox's old copy");
                        }
                    });
                }
                return Ok(a);
            }
            Err(Error::Conflict(m)) => {
                // Another node took it over meanwhile (the leader moving it off its
                // draining node, or another replica's resume): it resumes there.
                if let Some(owner) = self.new_owner(id, &from).await {
                    if !self.cache.is_draining(&owner.name) {
                        return self.call(id, here).await;
                    }
                }
                return Err(Error::Conflict(m));
            }
            Err(Error::Unavailable(_) | Error::Capacity { .. }) => {}
            Err(e) => return Err(e),
        }
        if live.is_some() {
            // No other node can take it: it resumes on its draining node.
            return self.call(id, here).await;
        }
        Err(Error::Capacity {
            limit: "no node of the cluster can resume a sandbox now".into(),
            retry_after_secs: 5,
            quota: false,
        })
    }
}
