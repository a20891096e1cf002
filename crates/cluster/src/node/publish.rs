//! What a node tells the cluster about its sandboxes: after each lifecycle event, and after
//! each call a control replica made, the sandbox's record as the node's store now has it
//! goes to etcd (with the event), under the node's lease. One task writes them all in turn,
//! each time reading the record afresh, so the last write of a sandbox is its latest state.

use std::sync::Arc;

use kiln_server::manager::LifecycleEvent;
use kiln_server::store::SandboxStore;
use tokio::sync::{broadcast, mpsc, oneshot};

use crate::owners::Published;
use crate::store::EtcdStore;

enum Job {
    /// Publish the sandbox, then answer with the revision written (0: nothing).
    Sandbox(String, oneshot::Sender<i64>),
    /// Publish the sandbox an event is about, with the event.
    Event(LifecycleEvent),
}

/// The node's writer of sandbox records to etcd.
#[derive(Clone)]
pub struct Publisher {
    tx: mpsc::Sender<Job>,
}

impl Publisher {
    /// Starts publishing the records of `store` as node `node` holding `lease`, and every
    /// event of `events`.
    pub fn start(
        etcd: EtcdStore,
        store: Arc<dyn SandboxStore>,
        node: String,
        lease: i64,
        mut events: broadcast::Receiver<LifecycleEvent>,
    ) -> Self {
        let (tx, mut rx) = mpsc::channel::<Job>(1024);
        tokio::spawn(async move {
            while let Some(job) = rx.recv().await {
                let (id, event, done) = match job {
                    Job::Sandbox(id, done) => (id, None, Some(done)),
                    Job::Event(e) => (e.sandbox_id.clone(), Some(e), None),
                };
                let revision = publish_one(&etcd, store.as_ref(), &node, lease, &id, event).await;
                if let Some(done) = done {
                    let _ = done.send(revision);
                }
            }
        });
        let events_tx = tx.clone();
        tokio::spawn(async move {
            loop {
                match events.recv().await {
                    Ok(e) => {
                        if events_tx.send(Job::Event(e)).await.is_err() {
                            return;
                        }
                    }
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        tracing::warn!(missed = n, "lifecycle events not published");
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                }
            }
        });
        Self { tx }
    }

    /// Publishes sandbox `id` as it now is, and waits until that is done: the etcd revision
    /// of the write (0 when nothing was written).
    pub async fn sandbox(&self, id: &str) -> i64 {
        let (done, wait) = oneshot::channel();
        if self
            .tx
            .send(Job::Sandbox(id.to_string(), done))
            .await
            .is_err()
        {
            return 0;
        }
        wait.await.unwrap_or(0)
    }
}

/// Publishes sandbox `id` as `store` now has it (with `event`): the revision written, 0 when
/// nothing was.
async fn publish_one(
    etcd: &EtcdStore,
    store: &dyn SandboxStore,
    node: &str,
    lease: i64,
    id: &str,
    event: Option<LifecycleEvent>,
) -> i64 {
    let rec = match store.get_sandbox(id).await {
        Ok(Some(rec)) => rec,
        Ok(None) => return 0,
        Err(e) => {
            tracing::warn!(sandbox = %id, error = %e, "reading a sandbox to publish");
            return 0;
        }
    };
    match etcd
        .publish_sandbox(node, lease, &rec, event.as_ref())
        .await
    {
        Ok(Published::At(rev)) => rev,
        Ok(Published::Ended) => {
            tracing::warn!(sandbox = %id, "not published: the cluster ended it");
            0
        }
        Ok(Published::Moved) => {
            tracing::info!(sandbox = %id, "not published: another node owns it now");
            0
        }
        Ok(Published::LeaseGone) => {
            tracing::warn!(sandbox = %id, "not published: the node's lease is gone");
            0
        }
        Err(e) => {
            tracing::warn!(sandbox = %id, error = %e, "publishing a sandbox");
            0
        }
    }
}
