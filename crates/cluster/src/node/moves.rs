//! A node's side of paused sandboxes in object storage. After a pause, [`Mover::store`]
//! uploads the files the driver names (chunks the bucket lacks only) and records them in
//! etcd; [`Mover::take_over`] makes a paused sandbox of another node this node's: ownership
//! first (revision-checked, so one node wins), then only the chunks this node's chunk cache
//! lacks, then the driver adopts the files and the normal resume runs it.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use crate::docs::b64;
use base64::Engine;
use kiln_server::api::{net_forwarded, AppState};
use kiln_server::driver::PortablePause;
use kiln_server::store::now_ms;
use kiln_server::{Error, Manager};

use crate::checkpoints::{no_checkpoint, CheckpointDoc, CheckpointFile, Moved};
use crate::objects::{ChunkCache, ChunkStore};
use crate::store::EtcdStore;

type Result<T, E = Error> = std::result::Result<T, E>;

/// Moves paused sandboxes' checkpoints between this node and the bucket.
#[derive(Clone)]
pub struct Mover {
    pub manager: Arc<Manager>,
    pub etcd: EtcdStore,
    pub chunks: ChunkStore,
    /// This node's cache of fetched chunks (files named by their hash), capped.
    pub cache: ChunkCache,
    pub node: String,
    /// Sandboxes being paused through the node-internal API, whose pause uploads its
    /// checkpoint itself (the `paused` event listener leaves them alone).
    pub api_pausing: Arc<std::sync::Mutex<HashSet<String>>>,
    /// One take-over of a sandbox at a time (two replicas may pick this node at once).
    pub taking: Arc<std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>>,
    /// The heads of this node's audit chains (a sandbox taken over continues its chain).
    pub heads: super::heads::Heads,
    /// The host's API state (its vault and sandboxes' sealed network settings): a sandbox's
    /// rules and egress proxy move with its checkpoint.
    pub app: Arc<AppState>,
}

fn unavailable(what: &str, e: impl std::fmt::Display) -> Error {
    tracing::warn!(error = %e, "{what}");
    Error::Unavailable(format!("{what}: object storage or etcd failed; retry"))
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

/// MB/s (MiB per second) of `bytes` in `ms` (0 for no time).
pub fn mb_per_s(bytes: u64, ms: u64) -> f64 {
    if ms == 0 {
        return 0.0;
    }
    bytes as f64 / (1 << 20) as f64 / (ms as f64 / 1000.0)
}

impl Mover {
    /// Uploads paused sandbox `id`'s files and records them as its checkpoint; the pause is
    /// safe against this node's loss once this returns.
    pub async fn store(&self, id: &str) -> Result<CheckpointDoc> {
        let portable = self.manager.portable_pause(id).await?;
        let network = self.network_leaving(id).await?;
        let recorded = self
            .upload_recorded(&portable, async |doc| {
                let doc = CheckpointDoc {
                    network: network.clone(),
                    ..doc.clone()
                };
                self.etcd.put_checkpoint(id, &doc).await
            })
            .await?;
        let Some(doc) = recorded else {
            return Err(Error::Conflict(format!(
                "sandbox \"{id}\" moved to another node while its checkpoint was stored"
            )));
        };
        let detail = format!(
            "checkpoint in object storage: {} files, {:.1} MiB in {} ms ({:.1} MB/s), {:.1} MiB \
             sent ({:.1} MB/s)",
            doc.files.len(),
            mib(doc.bytes),
            doc.upload_ms,
            mb_per_s(doc.bytes, doc.upload_ms),
            mib(doc.bytes_uploaded),
            mb_per_s(doc.bytes_uploaded, doc.upload_ms)
        );
        tracing::info!(sandbox = id, "{detail}");
        if let Err(e) = self.etcd.add_event_doc(id, "checkpoint", &detail).await {
            tracing::warn!(sandbox = id, error = %e, "recording the checkpoint event");
        }
        Ok(doc)
    }

    /// Uploads the files `portable` names (the chunks the bucket lacks), then `record`s them
    /// (false: the record was refused, None is answered), then makes sure no garbage
    /// collection that overlapped the upload took chunks it found in the bucket.
    pub(super) async fn upload_recorded(
        &self,
        portable: &PortablePause,
        record: impl AsyncFnOnce(&CheckpointDoc) -> crate::error::Result<bool>,
    ) -> Result<Option<CheckpointDoc>> {
        let t = Instant::now();
        let gc_before = crate::gc::round_mark(&self.etcd)
            .await
            .map_err(|e| unavailable("reading the garbage collection's state", e))?;
        let mut doc = CheckpointDoc {
            node: self.node.clone(),
            files: Vec::new(),
            bytes: 0,
            bytes_uploaded: 0,
            upload_ms: 0,
            at_ms: now_ms(),
            network: None,
        };
        for rel in &portable.files {
            let path = rel.to_string_lossy().into_owned();
            if !CheckpointFile::safe_path(&path) {
                return Err(Error::internal(format!(
                    "the driver named a file outside its directory: {path}"
                )));
            }
            let put = self
                .chunks
                .put_file(&portable.dir.join(rel))
                .await
                .map_err(|e| unavailable("storing files in object storage", e))?;
            doc.bytes += put.manifest.size;
            doc.bytes_uploaded += put.bytes_uploaded;
            doc.files.push(CheckpointFile {
                path,
                manifest: put.id,
                size: put.manifest.size,
            });
        }
        doc.upload_ms = t.elapsed().as_millis() as u64;
        if !record(&doc)
            .await
            .map_err(|e| unavailable("recording files in object storage", e))?
        {
            return Ok(None);
        }
        // Chunks this upload found in the bucket may have been collected meanwhile.
        let files: Vec<_> = doc
            .files
            .iter()
            .map(|f| (portable.dir.join(&f.path), f.manifest.clone()))
            .collect();
        crate::gc::settle(&self.etcd, &self.chunks, &gc_before, &files)
            .await
            .map_err(|e| unavailable("checking an upload against a garbage collection", e))?;
        Ok(Some(doc))
    }

    /// The files `doc` names, laid out under `dir` (only the chunks this node's cache lacks
    /// are fetched): the bytes fetched and those taken from the cache (or repeated in a
    /// file).
    pub(super) async fn fetch(
        &self,
        doc: &CheckpointDoc,
        dir: &std::path::Path,
    ) -> Result<(u64, u64)> {
        let using = self.cache.fetching().await;
        let (mut fetched, mut reused) = (0u64, 0u64);
        for f in &doc.files {
            if !CheckpointFile::safe_path(&f.path) {
                return Err(Error::internal(
                    "a record in object storage names a file outside its directory",
                ));
            }
            let dest = dir.join(&f.path);
            if let Some(parent) = dest.parent() {
                tokio::fs::create_dir_all(parent)
                    .await
                    .map_err(|e| Error::internal(format!("preparing fetched files: {e}")))?;
            }
            let got = self
                .chunks
                .get_file(&f.manifest, &dest, self.cache.dir())
                .await
                .map_err(|e| unavailable("fetching from object storage", e))?;
            fetched += got.bytes_fetched;
            reused += got.bytes_reused;
        }
        drop(using);
        if let Err(e) = self.cache.trim().await {
            tracing::warn!(error = %e, "trimming the chunk cache");
        }
        Ok((fetched, reused))
    }

    /// Makes paused sandbox `id`, owned by node `from`, this node's: ownership moves in
    /// etcd, its checkpoint's missing chunks are fetched and the driver adopts its files.
    /// Idempotent: a sandbox this node already holds is left as it is.
    pub async fn take_over(&self, id: &str, from: &str) -> Result<()> {
        let lock = self
            .taking
            .lock()
            .unwrap()
            .entry(id.to_string())
            .or_default()
            .clone();
        let taken = {
            let _one = lock.lock().await;
            self.take_over_locked(id, from).await
        };
        let mut taking = self.taking.lock().unwrap();
        // (This call's clone and the map's: nobody else waits.)
        if Arc::strong_count(&lock) <= 2 {
            taking.remove(id);
        }
        taken
    }

    async fn take_over_locked(&self, id: &str, from: &str) -> Result<()> {
        if kiln_server::SandboxService::get(self.manager.as_ref(), id).is_ok() {
            return Ok(());
        }
        let Some(doc) = self
            .etcd
            .checkpoint(id)
            .await
            .map_err(|e| unavailable("reading a checkpoint", e))?
        else {
            return Err(no_checkpoint(id, from));
        };
        // This node must have its template before the sandbox becomes its own.
        let known = kiln_server::store::SandboxStore::get_sandbox(&self.etcd, id)
            .await
            .map_err(|e| unavailable("reading a sandbox", e))?
            .ok_or_else(|| Error::SandboxNotFound(id.to_string()))?;
        self.manager.check_template(&known.template_id).await?;
        let rec = match self
            .etcd
            .move_owner(id, from, &self.node)
            .await
            .map_err(|e| unavailable("taking a sandbox over", e))?
        {
            Moved::To(rec) => rec,
            Moved::NotPaused => {
                return Err(Error::Conflict(format!(
                    "sandbox \"{id}\" is not paused: it cannot move"
                )))
            }
            Moved::Taken(other) => {
                return Err(Error::Conflict(format!(
                    "sandbox \"{id}\" was taken over by node {other} meanwhile; retry"
                )))
            }
        };
        let t = Instant::now();
        let got = match self.take_chain(id).await {
            Ok(()) => self.fetch_and_adopt(id, &doc, *rec).await,
            Err(e) => Err(e),
        };
        let (fetched, reused) = match got {
            Ok(got) => got,
            Err(e) => {
                // Handed back, so that the next resume places it afresh.
                if from != self.node {
                    if let Err(back) = self.heads.give(id, from).await {
                        tracing::warn!(sandbox = id, error = %back, "handing a sandbox's audit chain back");
                    }
                    if let Err(back) = self.etcd.move_owner(id, &self.node, from).await {
                        tracing::warn!(sandbox = id, error = %back, "handing a sandbox back");
                    }
                }
                return Err(e);
            }
        };
        let ms = t.elapsed().as_millis() as u64;
        let detail = format!(
            "checkpoint fetched from object storage: {:.1} MiB fetched in {ms} ms ({:.1} MB/s), \
             {:.1} MiB from the chunk cache or repeated chunks",
            mib(fetched),
            mb_per_s(fetched, ms),
            mib(reused)
        );
        tracing::info!(sandbox = id, "{detail}");
        if let Err(e) = self.etcd.add_event_doc(id, "checkpoint", &detail).await {
            tracing::warn!(sandbox = id, error = %e, "recording the checkpoint event");
        }
        Ok(())
    }

    /// Makes `id`'s audit chain this node's: what it records of the sandbox from now on
    /// continues the chain where the node it comes from left it.
    async fn take_chain(&self, id: &str) -> Result<()> {
        match self.heads.take(id).await {
            Ok(Some(head)) => {
                self.manager.audit().continue_chain(id, head).await;
                Ok(())
            }
            Ok(None) => Ok(()),
            Err(e) => Err(unavailable("taking over the sandbox's audit chain", e)),
        }
    }

    /// The checkpoint's files into this node's incoming directory, then adopted by the driver
    /// as paused sandbox `rec`: the bytes fetched and those reused ([`Mover::fetch`]).
    async fn fetch_and_adopt(
        &self,
        id: &str,
        doc: &CheckpointDoc,
        rec: kiln_server::store::SandboxRecord,
    ) -> Result<(u64, u64)> {
        let network = match &doc.network {
            Some(sealed) => Some(self.network_arriving(id, &rec.team, sealed).await?),
            None => None,
        };
        let dir = self.manager.incoming_dir(id).await?;
        let got = self.fetch(doc, &dir).await?;
        self.manager.adopt_paused(rec, &doc.node, network).await?;
        Ok(got)
    }

    /// Sandbox `id`'s network settings, sealed for the node that takes it over (base64; None:
    /// it has none).
    async fn network_leaving(&self, id: &str) -> Result<Option<String>> {
        let team = kiln_server::SandboxService::get(self.manager.as_ref(), id)?.team;
        let sealed = net_forwarded::moving(&self.app, id, &team)
            .await
            .map_err(|e| settings_err("reading", e))?;
        Ok(sealed.map(|s| b64().encode(s)))
    }

    /// The rules and egress proxy sandbox `id` of `team` arrives with (`sealed`, as
    /// [`Mover::network_leaving`] made it), attached for this node and recorded here.
    async fn network_arriving(
        &self,
        id: &str,
        team: &str,
        sealed: &str,
    ) -> Result<kiln_net::EgressPolicy> {
        let sealed = b64()
            .decode(sealed)
            .map_err(|e| Error::internal(format!("a checkpoint's network settings: {e}")))?;
        net_forwarded::arriving(&self.app, id, team, &sealed)
            .await
            .map_err(|e| settings_err("applying", e))
    }
}

/// A failure with a moving sandbox's network settings: a 400 (a secret its rules name is gone)
/// stays one; the rest are the node's.
fn settings_err(what: &str, e: kiln_server::api::ApiError) -> Error {
    let msg = format!("{what} the sandbox's network settings: {}", e.message);
    if e.status == http::StatusCode::BAD_REQUEST {
        Error::BadRequest(msg)
    } else {
        Error::Internal(msg)
    }
}

/// A pause through the API: the driver's pause, then its checkpoint stored when this node has
/// an object store (the pause answers after the upload). A sandbox its driver cannot move
/// stays paused here only (logged).
pub(super) async fn pause(
    n: &super::NodeApi,
    id: &str,
    memory: bool,
    require_healthy_guest: bool,
) -> Result<()> {
    let Some(m) = &n.mover else {
        return n
            .service
            .pause_checked(id, memory, require_healthy_guest)
            .await;
    };
    m.api_pausing.lock().unwrap().insert(id.to_string());
    if let Err(e) = n
        .service
        .pause_checked(id, memory, require_healthy_guest)
        .await
    {
        m.api_pausing.lock().unwrap().remove(id);
        return Err(e);
    }
    match m.store(id).await {
        Ok(_) => Ok(()),
        Err(Error::Driver(kiln_server::driver::DriverError::NotImplemented(what))) => {
            tracing::warn!(sandbox = id, "its checkpoint stays on this node: {what}");
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// Before a resume: a sandbox this node owns in etcd but does not hold (a take-over that
/// stopped after ownership moved) is fetched first.
pub(super) async fn held(n: &super::NodeApi, id: &str) -> Result<()> {
    let Some(m) = &n.mover else {
        return Ok(());
    };
    if kiln_server::SandboxService::get(m.manager.as_ref(), id).is_ok() {
        return Ok(());
    }
    match m.etcd.owner_of(id).await {
        Ok(Some(o)) if o == m.node => m.take_over(id, &m.node).await,
        _ => Ok(()),
    }
}

/// [`Mover::take_over`], on a node that has an object store; the sandbox's template is fetched
/// first when this node lacks it.
pub(super) async fn take_over(n: &super::NodeApi, id: &str, from: &str) -> Result<()> {
    match &n.mover {
        Some(m) => {
            let known = kiln_server::store::SandboxStore::get_sandbox(&m.etcd, id)
                .await
                .map_err(|e| unavailable("reading a sandbox", e))?;
            if let Some(r) = known {
                super::templates::ensure(n, &r.template_id).await?;
            }
            m.take_over(id, from).await
        }
        None => Err(Error::Conflict(format!(
            "sandbox \"{id}\" cannot move to this node: it has no object store configured"
        ))),
    }
}

/// Drops this node's copy of a sandbox another node owns now; whether there was one.
pub(super) async fn release(n: &super::NodeApi, id: &str) -> Result<bool> {
    let Some(m) = &n.mover else {
        return Ok(false);
    };
    let owner = m
        .etcd
        .owner_of(id)
        .await
        .map_err(|e| unavailable("reading a sandbox's owner", e))?;
    if owner.as_deref() == Some(m.node.as_str()) {
        return Err(Error::Conflict(format!(
            "sandbox \"{id}\" is still this node's"
        )));
    }
    if kiln_server::SandboxService::get(m.manager.as_ref(), id).is_err() {
        return Ok(false);
    }
    m.manager.kill(id, "moved: another node took it over").await
}

/// Uploads the checkpoints of pauses that did not come through the API (a sandbox paused at
/// the end of its timeout), as their `paused` events arrive; failures are logged.
pub async fn upload_other_pauses(
    m: Mover,
    mut events: tokio::sync::broadcast::Receiver<kiln_server::manager::LifecycleEvent>,
) {
    use tokio::sync::broadcast::error::RecvError;
    loop {
        let e = match events.recv().await {
            Ok(e) => e,
            Err(RecvError::Lagged(n)) => {
                tracing::warn!(
                    missed = n,
                    "lifecycle events missed by the checkpoint uploader"
                );
                continue;
            }
            Err(RecvError::Closed) => return,
        };
        if e.kind != "paused" || m.api_pausing.lock().unwrap().remove(&e.sandbox_id) {
            continue;
        }
        let m = m.clone();
        tokio::spawn(async move {
            match m.store(&e.sandbox_id).await {
                Ok(_) => {}
                Err(Error::Driver(kiln_server::driver::DriverError::NotImplemented(what))) => {
                    tracing::warn!(sandbox = %e.sandbox_id, "its checkpoint stays on this node: {what}");
                }
                Err(err) => {
                    tracing::warn!(sandbox = %e.sandbox_id, error = %err, "storing the checkpoint of a pause");
                }
            }
        });
    }
}
