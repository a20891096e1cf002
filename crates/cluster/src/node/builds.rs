//! The cluster's template builds, on the node started with `--template-builds` (its build
//! node): replicas forward E2B's Template API here (`/internal/v1/api/…`, the caller's team
//! and key id in headers, since the replica checked the API key) and the server's own handlers
//! answer it over this host's build service, so a team's templates, builds, tags and layers
//! live here ([`api`]). A create naming a template the team built here is sent here too and
//! resolved to its last layer ([`resolve`]).

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::delete;
use axum::{Extension, Json};
use kiln_server::api::template_api;
use kiln_server::tenancy::Caller;
use kiln_server::ApiError;
use tower::ServiceExt;

use super::NodeApi;
use crate::wire::{
    BuiltQuery, BUILDS_PREFIX, HOST_HEADER, KEY_ID_HEADER, LENGTH_HEADER, TEAM_HEADER,
};

fn take(headers: &mut HeaderMap, name: &str) -> Option<String> {
    headers
        .remove(name)
        .and_then(|v| v.to_str().ok().map(str::to_string))
}

/// `DELETE /templates/{id}` on the build node: a template the team built here, else 404 (the
/// replica then deletes the snapshot of that id itself).
async fn delete_built(
    State(st): State<Arc<kiln_server::api::AppState>>,
    Extension(c): Extension<Caller>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Result<StatusCode, ApiError> {
    if template_api::delete_built(&st, &c.team, &id).await? {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::not_found(format!("template {id:?} not found")))
    }
}

/// `/internal/v1/api/…`: one Template API request a replica forwarded.
pub(super) async fn api(State(n): State<Arc<NodeApi>>, req: Request) -> Response {
    let (mut parts, body) = req.into_parts();
    let Some(rest) = parts
        .uri
        .path()
        .strip_prefix(BUILDS_PREFIX)
        .map(str::to_string)
    else {
        return ApiError::not_found("no such route").into_response();
    };
    let team = take(&mut parts.headers, TEAM_HEADER);
    let key_id = take(&mut parts.headers, KEY_ID_HEADER);
    // The upload links name the host the client used.
    if let Some(host) = take(&mut parts.headers, HOST_HEADER) {
        if let Ok(v) = HeaderValue::from_str(&host) {
            parts.headers.insert(header::HOST, v);
        }
    }
    if let Some(len) = take(&mut parts.headers, LENGTH_HEADER) {
        if let Ok(v) = HeaderValue::from_str(&len) {
            parts.headers.insert(header::CONTENT_LENGTH, v);
        }
    }
    parts.headers.remove(header::AUTHORIZATION);
    let mut inner = match super::inner_request(parts, &rest, Body::new(body)) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    if let (Some(team), Some(key_id)) = (team, key_id) {
        inner.extensions_mut().insert(Caller { key_id, team });
    } else if !rest.starts_with(template_api::UPLOAD_PREFIX) {
        return ApiError::unauthorized("a forwarded Template API call names no caller")
            .into_response();
    }
    let routes = template_api::routes()
        .merge(template_api::upload_routes())
        .route("/templates/{templateID}", delete(delete_built))
        .with_state(n.app.clone());
    let routes = if rest.starts_with(template_api::UPLOAD_PREFIX) {
        routes
    } else {
        routes.layer(axum::middleware::from_fn(kiln_server::edge::limit_api_body))
    };
    match routes.oneshot(inner).await {
        Ok(r) => r,
        Err(never) => match never {},
    }
}

/// `POST /internal/v1/builds/resolve`: whether `team` built a template named `template` here.
pub(super) async fn resolve(
    State(n): State<Arc<NodeApi>>,
    Json(q): Json<BuiltQuery>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let built = template_api::resolve_for_create(&n.app, &q.team, &q.template).await?;
    Ok(Json(serde_json::json!({ "built": built.is_some() })))
}
