//! A fork through a control replica. Its children run beside their parent while the parent's
//! node has room (the node forks them itself: the fastest way); the rest, or all of them when
//! that node is draining, run on other nodes: the parent's node captures it once (a transient
//! snapshot, never listed) with its files in object storage, each child is placed as a create
//! is and its node borrows the capture, and the capture is deleted once the children are
//! made (they keep the layers they stack on). Without an object store on the parent's node,
//! children that do not fit beside it fail alone, and a fork of a sandbox on a draining node
//! is refused (409). A capture whose replica died before deleting it is deleted by the
//! leading replica once it is [`CAPTURE_LEFT_AFTER`] old ([`ClusterService::drop_left_captures`]).

use std::time::Duration;

use kiln_server::manager::check_fork_count;
use kiln_server::store::{now_ms, SandboxRecord};
use kiln_server::Error;

use super::placement;
use super::service::ClusterService;
use crate::nodes::NodeInfo;
use crate::snapshots::Located;
use crate::wire::{error_of, Op};

/// How old a fork's capture is when it counts as left behind (a fork takes seconds).
pub(super) const CAPTURE_LEFT_AFTER: Duration = Duration::from_secs(600);

type Result<T, E = Error> = std::result::Result<T, E>;

impl ClusterService {
    /// `count` children of running sandbox `id`, one result per child: those beside it first.
    pub(super) async fn fork_spread(
        &self,
        id: &str,
        count: u32,
        timeout_secs: Option<i64>,
    ) -> Result<Vec<Result<SandboxRecord>>> {
        check_fork_count(count)?;
        let node = self.owner(id)?;
        let memory = u64::from(self.cfg.default_memory_mb);
        // Not among the candidates: draining (it takes no new sandboxes).
        let here = self.candidates().into_iter().find(|n| n.name == node.name);
        let local = here.map_or(0, |n| placement::room(&n, memory, count));
        let mut out = Vec::with_capacity(count as usize);
        if local > 0 {
            out.extend(self.fork_here(id, local, timeout_secs).await?);
        }
        let away = count - local;
        if away == 0 {
            return Ok(out);
        }
        match self.fork_away(id, &node, away, timeout_secs).await {
            Ok(children) => out.extend(children),
            Err(e) if local == 0 => {
                let why = match self.cache.is_draining(&node.name) {
                    true => "is draining",
                    false => "has no room",
                };
                return Err(Error::Conflict(format!(
                    "sandbox \"{id}\" runs on node {}, which {why}, and its fork's children \
                     cannot run on another node: {e}",
                    node.name
                )));
            }
            Err(e) => {
                let why = format!("no room beside the parent, and not elsewhere: {e}");
                out.extend((0..away).map(|_| Err(Error::Conflict(why.clone()))));
            }
        }
        Ok(out)
    }

    /// `count` children forked by the parent's node beside it.
    async fn fork_here(
        &self,
        id: &str,
        count: u32,
        timeout_secs: Option<i64>,
    ) -> Result<Vec<Result<SandboxRecord>>> {
        let a = self
            .call(
                id,
                Op::Fork {
                    count,
                    timeout_secs,
                },
            )
            .await?;
        Ok(a.children
            .into_iter()
            .map(|c| match c.sandbox {
                Some(s) => Ok(s.into()),
                None => Err(error_of(
                    http::StatusCode::from_u16(c.status)
                        .unwrap_or(http::StatusCode::INTERNAL_SERVER_ERROR),
                    c.message,
                    "",
                )),
            })
            .collect())
    }

    /// `count` children on nodes other than `parent`, from a capture in object storage.
    async fn fork_away(
        &self,
        id: &str,
        parent: &NodeInfo,
        count: u32,
        timeout_secs: Option<i64>,
    ) -> Result<Vec<Result<SandboxRecord>>> {
        let a = self.call(id, Op::ForkOut { timeout_secs }).await?;
        let (Some(snap), Some(child)) = (a.snapshot, a.create) else {
            return Err(Error::internal(
                "the node answered a fork's capture without the capture or its children's create",
            ));
        };
        // A child stacks on the parent's template: a node that borrows the capture must hold
        // it (or fetch it).
        let mut away = self.candidates();
        away.retain(|n| n.name != parent.name);
        if let Some(r) = self.cache.sandbox(id) {
            away = self.able_to_run(away, &r.template_id).await;
        }
        let children = (0..count).map(|_| {
            let nodes = away.clone();
            let at = self.pick(&nodes);
            self.place(child.clone(), at, nodes)
        });
        let out = futures::future::join_all(children).await;
        if let Err(e) = self.drop_snapshot(&snap.id, &snap.team).await {
            tracing::warn!(sandbox = id, snapshot = %snap.id, error = %e, "deleting a fork's capture");
        }
        Ok(out)
    }
}

/// The fork captures among `all` made before `before_ms`: (id, team).
fn left_captures(all: Vec<Located>, before_ms: i64) -> Vec<(String, String)> {
    all.into_iter()
        .filter(|l| l.transient && l.snapshot.created_at_ms < before_ms)
        .map(|l| (l.snapshot.id, l.snapshot.team))
        .collect()
}

impl ClusterService {
    /// Deletes the fork captures older than [`CAPTURE_LEFT_AFTER`] (their fork's replica died
    /// before it deleted them): how many went.
    pub(super) async fn drop_left_captures(&self) -> usize {
        let all = match self.etcd.snapshots_at().await {
            Ok(all) => all,
            Err(e) => {
                tracing::warn!(error = %e, "reading the snapshots for left fork captures");
                return 0;
            }
        };
        let before = now_ms() - CAPTURE_LEFT_AFTER.as_millis() as i64;
        let mut dropped = 0;
        for (id, team) in left_captures(all, before) {
            match self.drop_snapshot(&id, &team).await {
                Ok(()) => dropped += 1,
                Err(e) => {
                    tracing::warn!(snapshot = %id, error = %e, "deleting a left fork capture")
                }
            }
        }
        dropped
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_old_captures_count_as_left() {
        let snap = |id: &str, at: i64, transient: bool| Located {
            snapshot: kiln_server::store::SnapshotRecord {
                id: id.into(),
                name: None,
                sandbox_id: "p".into(),
                template_id: "base".into(),
                envd_token: None,
                env_vars: Default::default(),
                created_at_ms: at,
                size_bytes: 0,
                team: "t".into(),
            },
            node: Some("n1".into()),
            transient,
            network: None,
        };
        let all = vec![
            snap("old-capture", 10, true),
            snap("young-capture", 100, true),
            snap("old-snapshot", 10, false),
        ];
        assert_eq!(
            left_captures(all, 50),
            [("old-capture".to_string(), "t".to_string())]
        );
    }
}
