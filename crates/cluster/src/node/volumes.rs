//! A node's side of volumes: the node that keeps a volume's files (its home, named in its
//! etcd record, [`crate::volumes`]) makes it when a replica creates it, deletes it, mounts it
//! into the sandboxes placed here, and serves its content API, which replicas forward here
//! ([`content`]: the server's own handlers, the volume's token checked by them). A volume
//! whose record names this node but that it does not have yet (a replica that stopped between
//! the record and the call) is made at its first use ([`keep_local`]).

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::Json;
use kiln_server::{ApiError, Error};
use tower::ServiceExt;

use super::NodeApi;
use crate::wire::{VolumeCall, VOLUME_TOKEN_HEADER};

/// Makes volume `id` on this node when its record names this node and the node lacks it.
pub(super) async fn keep_local(n: &NodeApi, id: &str) -> Result<(), Error> {
    let doc = n
        .etcd
        .volume_doc(id)
        .await?
        .ok_or_else(|| Error::NotFound(format!("volume \"{id}\" not found")))?;
    if doc.node != n.name {
        return Err(Error::Conflict(format!(
            "volume \"{}\" is kept by node {}, not by this one",
            doc.name, doc.node
        )));
    }
    n.manager.adopt_volume(&doc.record()).await
}

/// `POST /internal/v1/volumes/{id}`: keep or delete one volume.
pub(super) async fn call(
    State(n): State<Arc<NodeApi>>,
    Path(id): Path<String>,
    Json(c): Json<VolumeCall>,
) -> Result<Json<serde_json::Value>, ApiError> {
    match c {
        VolumeCall::Keep { volume } => {
            if volume.id != id || volume.node != n.name {
                return Err(ApiError::bad_request(
                    "the volume named is not one for this node",
                ));
            }
            n.manager.adopt_volume(&volume.record()).await?;
        }
        VolumeCall::Delete { team } => match n.manager.delete_volume(&team, &id).await {
            // Never made here (its create stopped half-way): nothing to delete.
            Ok(()) | Err(Error::NotFound(_)) => {}
            Err(e) => return Err(e.into()),
        },
    }
    Ok(Json(serde_json::json!({})))
}

/// `/internal/v1/volumecontent/{id}/…`: the volume-content API of a volume this node keeps,
/// as a replica forwards it (the volume's token in [`VOLUME_TOKEN_HEADER`], since
/// `Authorization` carries the cluster secret), answered by the server's own handlers.
pub(super) async fn content(State(n): State<Arc<NodeApi>>, req: Request) -> Response {
    let (mut parts, body) = req.into_parts();
    let Some(rest) = parts
        .uri
        .path()
        .strip_prefix(&format!("{}/volumecontent/", crate::wire::API_PREFIX))
        .map(str::to_string)
    else {
        return ApiError::not_found("no such route").into_response();
    };
    let id = rest.split('/').next().unwrap_or_default().to_string();
    let Some(token) = parts.headers.remove(VOLUME_TOKEN_HEADER) else {
        return ApiError::unauthorized("a volume token is required").into_response();
    };
    let known = n
        .manager
        .volume_by_token(&id, token.to_str().unwrap_or_default())
        .await;
    if matches!(known, Ok(None)) {
        if let Err(e) = keep_local(&n, &id).await {
            tracing::debug!(volume = %id, error = %e, "a volume of this node's record");
        }
    }
    let mut bearer = b"Bearer ".to_vec();
    bearer.extend_from_slice(token.as_bytes());
    match HeaderValue::from_bytes(&bearer) {
        Ok(v) => parts.headers.insert(header::AUTHORIZATION, v),
        Err(_) => return ApiError::unauthorized("a malformed volume token").into_response(),
    };
    let path = format!("/volumecontent/{rest}");
    let inner = match super::inner_request(parts, &path, Body::new(body)) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let routes = kiln_server::api::volume_content::routes().with_state(n.app.clone());
    match routes.oneshot(inner).await {
        Ok(r) => r,
        Err(never) => match never {},
    }
}
