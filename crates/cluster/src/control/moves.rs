//! Where a resume of a paused sandbox runs: on its node when that node is live and not
//! draining; else on another node, which takes the sandbox over from its checkpoint in object
//! storage (placed as a create is). A paused sandbox whose checkpoint is only on its node's
//! disk resumes there (a draining node) or answers 409 (a lost node). After a move, the old
//! node (when live) drops its copy.

use kiln_server::store::SandboxState;
use kiln_server::{Error, SandboxService};

use super::placement;
use super::service::{ClusterService, VIEW_WAIT};
use crate::checkpoints::no_checkpoint;
use crate::wire::{Op, OpAnswer};

type Result<T, E = Error> = std::result::Result<T, E>;

impl ClusterService {
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
        let memory_mb = u64::from(self.config().default_memory_mb);
        let mut nodes = self.candidates();
        nodes.retain(|n| n.name != from);
        for _ in 0..3 {
            let Some(node) = placement::place(
                &nodes,
                memory_mb,
                placement::DEFAULT_K,
                placement::random_index,
            )
            .cloned() else {
                break;
            };
            match self.nodes.op(&node.address, id, &op).await {
                Ok(a) => {
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
                Err(Error::Unavailable(m)) => {
                    tracing::warn!(node = %node.name, error = %m, "resuming on another node");
                    nodes.retain(|n| n.name != node.name);
                }
                Err(e) => return Err(e),
            }
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
