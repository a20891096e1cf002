//! Volumes through a control replica. A volume's files live on one node, its home: a create
//! picks a live node that takes sandboxes (as a sandbox's create does), records the volume in
//! etcd (its name taken and the team's cap checked in one txn, [`crate::volumes`]) and has
//! that node make it; lists and reads answer from etcd; a delete goes to the home node (which
//! refuses while a sandbox mounts it) and then forgets the record. A create that mounts
//! volumes runs on their home node, so all the volumes it mounts must share one. The content
//! API is forwarded to the home node as it comes ([`forward_content`]).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use kiln_server::manager::volumes::{check_inserted, check_mount_path, check_name, MAX_MOUNTS};
use kiln_server::store::{now_ms, MountRecord, VolumeRecord};
use kiln_server::{ApiError, Error, SandboxService};

use super::service::ClusterService;
use crate::nodes::NodeInfo;
use crate::volumes::VolumeDoc;
use crate::wire::{MountDoc, Op, VolumeCall};

type Result<T, E = Error> = std::result::Result<T, E>;

fn not_found(key: &str) -> Error {
    Error::NotFound(format!("volume \"{key}\" not found"))
}

impl ClusterService {
    /// The live node that keeps volume `d`'s files (503 while it is away).
    fn home_of(&self, d: &VolumeDoc) -> Result<NodeInfo> {
        self.cache
            .nodes()
            .into_iter()
            .find(|n| n.name == d.node)
            .ok_or_else(|| {
                Error::Unavailable(format!(
                    "volume \"{}\" is kept by node {}, which is not in the cluster now; retry \
                     once it is back",
                    d.name, d.node
                ))
            })
    }

    pub(super) async fn cluster_create_volume(
        &self,
        team: &str,
        name: &str,
    ) -> Result<VolumeRecord> {
        check_name(name)?;
        let node = self.pick(&self.candidates()).ok_or_else(|| {
            Error::Unavailable("no node of the cluster can keep a volume now; retry".into())
        })?;
        let d = VolumeDoc {
            id: format!("vol_{}", kiln_server::auth::random_hex(8)),
            team: team.to_string(),
            name: name.to_string(),
            token: kiln_server::auth::random_hex(24),
            size_mb: self.cfg.volume_mb,
            created_at_ms: now_ms(),
            node: node.name.clone(),
        };
        let cap = self.team_quota(team).await?.max_volumes;
        let got = self.etcd.insert_volume(&d, cap).await?;
        check_inserted(got, team, name, cap, "kiln control")?;
        let call = VolumeCall::Keep { volume: d.clone() };
        if let Err(e) = self.nodes.volume(&node.address, &d.id, &call).await {
            if let Err(r) = self.etcd.remove_volume(&d).await {
                tracing::warn!(volume = %d.id, error = %r, "forgetting a volume its node did not make");
            }
            return Err(e);
        }
        tracing::info!(volume = %d.id, node = %d.node, team, "volume created");
        Ok(d.record())
    }

    pub(super) async fn cluster_volume(&self, team: &str, key: &str) -> Result<VolumeRecord> {
        let d = self.etcd.volume_for(team, key).await?;
        d.map(|d| d.record()).ok_or_else(|| not_found(key))
    }

    /// Volume `id` when `token` is its content token (any team: the token is the key).
    async fn volume_doc_by_token(&self, id: &str, token: &str) -> Result<Option<VolumeDoc>> {
        let d = self.etcd.volume_doc(id).await?;
        Ok(
            d.filter(|d| {
                kiln_server::proxy::constant_time_eq(d.token.as_bytes(), token.as_bytes())
            }),
        )
    }

    pub(super) async fn cluster_volume_by_token(
        &self,
        id: &str,
        token: &str,
    ) -> Result<Option<VolumeRecord>> {
        Ok(self
            .volume_doc_by_token(id, token)
            .await?
            .map(|d| d.record()))
    }

    pub(super) async fn cluster_list_volumes(
        &self,
        team: Option<&str>,
    ) -> Result<Vec<VolumeRecord>> {
        let all = self.etcd.volumes_of(team).await?;
        Ok(all.iter().map(VolumeDoc::record).collect())
    }

    pub(super) async fn cluster_delete_volume(&self, team: &str, key: &str) -> Result<()> {
        let d = self
            .etcd
            .volume_for(team, key)
            .await?
            .ok_or_else(|| not_found(key))?;
        let node = self.home_of(&d)?;
        let call = VolumeCall::Delete {
            team: team.to_string(),
        };
        self.nodes.volume(&node.address, &d.id, &call).await?;
        self.etcd.remove_volume(&d).await?;
        tracing::info!(volume = %d.id, node = %d.node, team, "volume deleted");
        Ok(())
    }

    /// The `volumeMounts` of a create by `team`, resolved against its volumes: checked as one
    /// host checks them, and all kept by one node.
    pub(super) async fn cluster_resolve_mounts(
        &self,
        team: &str,
        asked: &[(String, String)],
    ) -> Result<Vec<MountRecord>> {
        if asked.len() > MAX_MOUNTS {
            return Err(Error::bad_request(format!(
                "at most {MAX_MOUNTS} volume mounts per sandbox"
            )));
        }
        let mut out: Vec<MountRecord> = Vec::new();
        let mut home: Option<VolumeDoc> = None;
        for (name, path) in asked {
            let path = check_mount_path(path)?;
            if out.iter().any(|m| m.path == path) {
                return Err(Error::bad_request(format!(
                    "two volumes are mounted at {path:?}"
                )));
            }
            let d = self.etcd.volume_for(team, name).await?.ok_or_else(|| {
                Error::bad_request(format!(
                    "volumeMounts: volume \"{name}\" not found; create it with Volume.create"
                ))
            })?;
            if let Some(h) = home.as_ref().filter(|h| h.node != d.node) {
                return Err(Error::Conflict(format!(
                    "volumes \"{}\" and \"{}\" are kept by different nodes ({} and {}); a \
                     sandbox mounts volumes of one node",
                    h.name, d.name, h.node, d.node
                )));
            }
            out.push(MountRecord {
                volume_id: d.id.clone(),
                name: d.name.clone(),
                path,
            });
            home.get_or_insert(d);
        }
        out.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(out)
    }

    /// The node a create mounting `mounts` runs on: their home, live and taking sandboxes.
    pub(super) async fn mounts_home(&self, mounts: &[MountRecord]) -> Result<Option<NodeInfo>> {
        let Some(first) = mounts.first() else {
            return Ok(None);
        };
        let d = self
            .etcd
            .volume_doc(&first.volume_id)
            .await?
            .ok_or_else(|| not_found(&first.name))?;
        let node = self.home_of(&d)?;
        if self.cache.is_draining(&node.name) {
            return Err(Error::Conflict(format!(
                "volume \"{}\" is kept by node {}, which is draining: it takes no new \
                 sandboxes; undrain it to mount the volume",
                d.name, node.name
            )));
        }
        Ok(Some(node))
    }

    /// The volumes sandbox `id` mounts, asked of its node.
    pub(super) async fn node_mounts(&self, id: &str) -> Result<Vec<MountRecord>> {
        let Ok(node) = self.owner(id) else {
            return Ok(Vec::new());
        };
        let a = self.nodes.op(&node.address, id, &Op::Mounts).await?;
        Ok(a.mounts.into_iter().map(MountDoc::into).collect())
    }
}

/// What the replica's volume-content forwarding needs.
pub struct ContentGate {
    pub service: Arc<ClusterService>,
    /// The sandbox domain (a request to a sandbox's port is never a volume's).
    pub domain: Arc<str>,
}

/// The middleware (its state: the gate) answering `/volumecontent/{id}/…` itself: the
/// volume's token checked against its record, then the request forwarded, streamed both
/// ways, to the node that keeps the volume. Everything else goes on.
pub async fn forward_content(
    State(g): State<Arc<ContentGate>>,
    req: Request,
    next: Next,
) -> Response {
    let Some(rest) = req.uri().path().strip_prefix("/volumecontent/") else {
        return next.run(req).await;
    };
    if super::unavailable::to_a_sandbox(&req, &g.domain) {
        return next.run(req).await;
    }
    let id = rest.split('/').next().unwrap_or_default().to_string();
    let rest = match req.uri().query() {
        Some(q) => format!("{rest}?{q}"),
        None => rest.to_string(),
    };
    let token = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(|t| t.trim().to_string());
    let Some(token) = token else {
        return ApiError::unauthorized(
            "a volume token is required (Authorization: Bearer <token>)",
        )
        .into_response();
    };
    let s = &g.service;
    let doc = match s.volume_doc_by_token(&id, &token).await {
        Ok(d) => d,
        Err(e) => return ApiError::from(e).into_response(),
    };
    let Some(doc) = doc else {
        return ApiError::unauthorized(format!("the token is not valid for volume \"{id}\""))
            .into_response();
    };
    let node = match s.home_of(&doc) {
        Ok(n) => n,
        Err(e) => return ApiError::from(e).into_response(),
    };
    let method = req.method().clone();
    let content_type = req.headers().get(header::CONTENT_TYPE).cloned();
    let body = reqwest::Body::wrap_stream(req.into_body().into_data_stream());
    let answer = s
        .nodes
        .volume_content(
            &node.address,
            method,
            &rest,
            &token,
            content_type.as_ref(),
            body,
        )
        .await;
    match answer {
        Ok(r) => super::builds::relay(r),
        Err(e) => ApiError::from(e).into_response(),
    }
}
