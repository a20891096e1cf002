//! A node's snapshots. A snapshot's files stay on the node that took it; its record goes to
//! etcd with the node's name (not on the node's lease: a node that is away keeps its
//! snapshots listed, and they are usable again when it is back), so every replica lists it
//! and places creates from it here. With an object store, its files are stored there too
//! ([`store_files`]), and another node borrows them for a create ([`borrow`]). Names are
//! unique cluster-wide. A snapshot deleted while this node was away is deleted here once the
//! node is back ([`drop_deleted`]).

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::Json;
use kiln_server::api::AppState;
use kiln_server::store::SnapshotRecord;
use kiln_server::{ApiError, Error, SandboxService};

use super::NodeApi;
use crate::error::ClusterError;
use crate::store::EtcdStore;
use crate::wire::{CreateDoc, OpAnswer, SnapshotDelete};

/// Takes a snapshot of sandbox `id` (of `team`) and records it in etcd as kept here (a
/// `transient` one as a fork's capture, never listed).
pub(super) async fn take(
    n: &NodeApi,
    id: &str,
    team: &str,
    name: Option<String>,
    memory: bool,
    transient: bool,
) -> Result<SnapshotRecord, Error> {
    if let Some(name) = &name {
        if n.etcd.snapshot_at(name).await?.is_some() {
            return Err(taken(name));
        }
    }
    let snap = n.service.snapshot_with(id, team, name, memory).await?;
    let recorded = match transient {
        true => n.etcd.insert_fork_capture(&snap, &n.name).await,
        false => match network_of(n, id, &snap.id, team).await {
            Ok(network) => {
                n.etcd
                    .insert_snapshot_with_network(&snap, &n.name, network)
                    .await
            }
            Err(e) => {
                if let Err(d) = n.service.delete_snapshot(&snap.id, team).await {
                    tracing::warn!(snapshot = %snap.id, error = %d, "deleting an unrecorded snapshot");
                }
                return Err(e);
            }
        },
    };
    match recorded {
        Ok(()) => Ok(snap),
        Err(e) => {
            // Not recorded, so no replica could find it: its files and settings go too.
            if let Err(d) = n.service.delete_snapshot(&snap.id, team).await {
                tracing::warn!(snapshot = %snap.id, error = %d, "deleting an unrecorded snapshot");
            }
            forget_network(&n.app, &snap.id, team).await;
            match e {
                ClusterError::Exists { id, .. } => Err(taken(&id)),
                e => Err(e.into()),
            }
        }
    }
}

/// The network settings sandbox `id` of `team` runs with, recorded here for its snapshot
/// `snap` and sealed for the snapshot's record (base64; None: none), so a create from it
/// through any replica, on any node, inherits them.
async fn network_of(
    n: &NodeApi,
    id: &str,
    snap: &str,
    team: &str,
) -> Result<Option<String>, Error> {
    use base64::Engine;
    let sealed = kiln_server::api::net_forwarded::snapshot_taken(&n.app, id, snap, team)
        .await
        .map_err(|e| Error::Internal(format!("the snapshot's network settings: {}", e.message)))?;
    Ok(sealed.map(|s| crate::docs::b64().encode(s)))
}

/// `POST …/snapshots/{id}/delete`: deletes the snapshot's files here and its record.
pub(super) async fn delete(
    State(n): State<Arc<NodeApi>>,
    Path(id): Path<String>,
    Json(d): Json<SnapshotDelete>,
) -> Result<Json<OpAnswer>, ApiError> {
    Ok(Json(OpAnswer {
        flag: discard(&n, &id, &d.team).await?,
        ..Default::default()
    }))
}

/// Deletes snapshot `id` of `team`: its files here (gone already is fine), then its record;
/// whether there was a record.
async fn discard(n: &NodeApi, id: &str, team: &str) -> Result<bool, Error> {
    delete_files(n.service.as_ref(), id, team).await?;
    forget_network(&n.app, id, team).await;
    Ok(n.etcd.delete_snapshot_at(id, None).await?)
}

/// Forgets the network settings this node recorded for snapshot `id` (none is fine).
async fn forget_network(app: &AppState, id: &str, team: &str) {
    if let Err(e) = kiln_server::api::net_forwarded::snapshot_deleted(app, id, team).await {
        tracing::warn!(snapshot = %id, error = %e.message, "forgetting a snapshot's network settings");
    }
}

/// Deletes snapshot `id`'s files on this node (files gone already are fine).
async fn delete_files(service: &dyn SandboxService, id: &str, team: &str) -> Result<(), Error> {
    match service.delete_snapshot(id, team).await {
        Ok(()) | Err(Error::NotFound(_)) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Once recovery is over, deletes the files and network settings of the snapshots deleted
/// while node `node` was away.
pub(super) async fn drop_deleted(
    recovery: kiln_server::Recovery,
    app: Arc<AppState>,
    etcd: EtcdStore,
    node: String,
) {
    if recovery.done().await.is_err() {
        return;
    }
    let drops = match etcd.snapshot_drops(&node).await {
        Ok(d) => d,
        Err(e) => {
            tracing::warn!(error = %e, "reading the snapshots deleted while this node was away");
            return;
        }
    };
    for d in drops {
        match delete_files(app.manager.as_ref(), &d.id, &d.team).await {
            Ok(()) => {
                forget_network(&app, &d.id, &d.team).await;
                tracing::info!(snapshot = %d.id, "deleted while this node was away: files removed");
                if let Err(e) = etcd.forget_snapshot_drop(&node, &d.id).await {
                    tracing::warn!(snapshot = %d.id, error = %e, "forgetting a deleted snapshot");
                }
            }
            Err(e) => tracing::warn!(snapshot = %d.id, error = %e, "removing a deleted snapshot"),
        }
    }
}

fn taken(name: &str) -> Error {
    Error::Conflict(format!("a snapshot named {name:?} already exists"))
}

/// After a snapshot is taken: its files to object storage when this node has one, so any node
/// with its template can start sandboxes from it. A snapshot the driver cannot move, or one
/// whose upload failed, stays on this node only (logged).
pub(super) async fn store_files(n: &NodeApi, snap: &SnapshotRecord) {
    if n.mover.is_none() {
        return;
    }
    let id = snap.id.as_str();
    match upload(n, id).await {
        Ok(true) => {}
        Ok(false) => tracing::info!(snapshot = id, "deleted while its files were stored"),
        Err(Error::Driver(kiln_server::driver::DriverError::NotImplemented(what))) => {
            tracing::info!(
                snapshot = id,
                "the snapshot stays on this node only: {what}"
            )
        }
        Err(e) => tracing::warn!(snapshot = id, error = %e, "storing a snapshot's files"),
    }
}

/// Snapshot `id`'s files into object storage and recorded there; false when the snapshot was
/// deleted meanwhile.
async fn upload(n: &NodeApi, id: &str) -> Result<bool, Error> {
    let Some(m) = &n.mover else {
        return Err(Error::Driver(
            kiln_server::driver::DriverError::NotImplemented("object storage on this node"),
        ));
    };
    let portable = m.manager.portable_snapshot(id).await?;
    let stored = m
        .upload_recorded(&portable, async |doc| {
            m.etcd.put_snapshot_files(id, doc).await
        })
        .await?;
    if let Some(doc) = &stored {
        tracing::info!(
            snapshot = id,
            "snapshot in object storage: {} files, {} bytes ({} sent) in {} ms",
            doc.files.len(),
            doc.bytes,
            doc.bytes_uploaded,
            doc.upload_ms
        );
    }
    Ok(stored.is_some())
}

/// A fork's children that will run on other nodes: running sandbox `id` captured (memory
/// included, a transient snapshot) and its files stored in object storage; answers the
/// capture and the create each child is (its parent's settings and egress policy). The caller
/// deletes the capture once the children are made.
pub(super) async fn fork_out(
    n: &NodeApi,
    id: &str,
    timeout_secs: Option<i64>,
) -> Result<(SnapshotRecord, CreateDoc), Error> {
    let Some(m) = &n.mover else {
        return Err(Error::Conflict(format!(
            "sandbox \"{id}\"'s node has no object store: its fork's children run beside it"
        )));
    };
    if !m.manager.mounts_of(id).await?.is_empty() {
        return Err(Error::Conflict(format!(
            "sandbox \"{id}\" mounts volumes of its node: its fork's children run beside it"
        )));
    }
    let mut params = m.manager.fork_child_params(id, timeout_secs).await?;
    // The parent's rules and egress proxy, as given, for the node the child runs on.
    params.network_settings = kiln_server::api::net_forwarded::of_sandbox(&n.app, id, &params.team)
        .await
        .map_err(|e| Error::Internal(format!("the parent's network settings: {}", e.message)))?;
    let mut child = CreateDoc::of(&params)?;
    let snap = take(n, id, &params.team, None, true, true).await?;
    let stored = match upload(n, &snap.id).await {
        Ok(true) => Ok(()),
        Ok(false) => Err(Error::Conflict(format!(
            "the fork's capture of sandbox \"{id}\" was deleted while it was stored"
        ))),
        Err(e) => Err(e),
    };
    if let Err(e) = stored {
        if let Err(d) = discard(n, &snap.id, &snap.team).await {
            tracing::warn!(snapshot = %snap.id, error = %d, "deleting a fork's capture");
        }
        return Err(e);
    }
    child.template_id = snap.id.clone();
    child.snapshot = Some(snap.id.clone());
    Ok((snap, child))
}

/// A snapshot of another node laid out here for one create ([`borrow`]); creates from
/// borrowed snapshots run one at a time on a node.
pub(super) struct Borrowed {
    id: String,
    team: String,
    _one: tokio::sync::OwnedMutexGuard<()>,
}

/// Before a create from snapshot `id` (of `team`) that another node keeps: its files fetched
/// from object storage (only the chunks this node's cache lacks) and adopted here. None: this
/// node has the snapshot already, or no object store (the create then says what is missing).
pub(super) async fn borrow(n: &NodeApi, id: &str, team: &str) -> Result<Option<Borrowed>, Error> {
    let Some(m) = &n.mover else {
        return Ok(None);
    };
    let one = n.borrowing.clone().lock_owned().await;
    if m.manager.snapshot_for(id, team).await?.is_some() {
        return Ok(None);
    }
    let found = n.etcd.snapshot_at(id).await?;
    let Some(rec) = found.map(|l| l.snapshot).filter(|s| s.team == team) else {
        return Err(Error::NotFound(format!("snapshot {id:?} not found")));
    };
    let Some(doc) = n.etcd.snapshot_files(&rec.id).await? else {
        return Err(Error::Conflict(format!(
            "snapshot {id:?} is not in object storage: only its own node can start it"
        )));
    };
    // The snapshot stacks on its sandbox's template: fetched first when this node lacks it.
    super::templates::ensure(n, &rec.template_id).await?;
    let t = std::time::Instant::now();
    let dir = m.manager.incoming_snapshot_dir(&rec.id).await?;
    let (fetched, reused) = m.fetch(&doc, &dir).await?;
    let sid = rec.id.clone();
    m.manager.adopt_snapshot(rec).await?;
    tracing::info!(
        snapshot = %sid,
        "borrowed from object storage: {fetched} bytes fetched, {reused} from the chunk cache, \
         in {} ms",
        t.elapsed().as_millis()
    );
    Ok(Some(Borrowed {
        id: sid,
        team: team.to_string(),
        _one: one,
    }))
}

impl Borrowed {
    /// Drops this node's copy once the create is done (its sandbox keeps the layers it stacks
    /// on).
    pub(super) async fn give_back(self, n: &NodeApi) {
        if let Err(e) = n.service.delete_snapshot(&self.id, &self.team).await {
            tracing::warn!(snapshot = %self.id, error = %e, "dropping a borrowed snapshot");
        }
    }
}
