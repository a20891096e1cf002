//! What a control replica reads from the node that runs a sandbox: its egress policy, the
//! end of its console output (beside its events, which are in etcd) and its metrics samples.
//! Nothing here changes a sandbox.

use std::collections::BTreeMap;

use kiln_server::manager::{Logs, MetricSample};
use kiln_server::store::{EventStore, SandboxStore};
use kiln_server::{Error, SandboxService};

use super::service::ClusterService;
use crate::wire::{NetworkDoc, Op};

type Result<T> = std::result::Result<T, Error>;

impl ClusterService {
    /// The egress policy sandbox `id`'s node holds. A sandbox whose node is not in the
    /// cluster now (a paused one of a lost node) is still described: without its policy,
    /// which only its node holds.
    pub(super) async fn node_network(
        &self,
        id: &str,
    ) -> Result<(Option<kiln_net::EgressPolicy>, Option<serde_json::Value>)> {
        self.get(id)?;
        let Some(node) = self.cache.owner(id) else {
            return Ok((None, None));
        };
        let a = self.nodes.op(&node.address, id, &Op::Network).await?;
        Ok((a.network.map(NetworkDoc::into_policy).transpose()?, a.shown))
    }

    /// The logs of sandbox `id` of `team`: its events, and while it runs on a node of the
    /// cluster now the end of its console output (its events alone when the node does not
    /// answer).
    pub(super) async fn node_logs(&self, id: &str, team: &str) -> Result<Logs> {
        let rec = self.etcd.get_sandbox(id).await?;
        if rec.is_none_or(|r| r.team != team) {
            return Err(Error::SandboxNotFound(id.to_string()));
        }
        let events = self.etcd.events(id).await?;
        let console = match self.cache.owner(id) {
            Some(node) => {
                let op = Op::Console {
                    team: team.to_string(),
                };
                self.nodes
                    .op(&node.address, id, &op)
                    .await
                    .ok()
                    .and_then(|a| a.console)
            }
            None => None,
        };
        Ok(Logs { events, console })
    }

    /// The newest sample of each of `ids`: one call per sandbox to its node, all at once; a
    /// sandbox whose node does not answer is left out, as one without a sample is.
    pub(super) async fn node_latest_metrics(
        &self,
        ids: &[String],
    ) -> BTreeMap<String, MetricSample> {
        let calls = ids.iter().map(|id| async move {
            let node = self.owner(id).ok()?;
            let a = self
                .nodes
                .op(&node.address, id, &Op::LatestMetric)
                .await
                .ok()?;
            let m = a.metrics.into_iter().next_back()?;
            Some((id.clone(), MetricSample::from(m)))
        });
        futures::future::join_all(calls)
            .await
            .into_iter()
            .flatten()
            .collect()
    }

    /// The samples of `id` in a window, from its node.
    pub(super) async fn node_metrics_window(
        &self,
        id: &str,
        start_ms: Option<i64>,
        end_ms: Option<i64>,
    ) -> Result<Vec<MetricSample>> {
        let node = self.owner(id)?;
        let op = Op::Metrics { start_ms, end_ms };
        let a = self.nodes.op(&node.address, id, &op).await?;
        Ok(a.metrics.into_iter().map(MetricSample::from).collect())
    }
}
