//! `GET /console/builds/{templateID}`: the builds of one of the session's team's templates
//! (built through E2B's Template API), newest first, with their state, through the template
//! builds service ([`crate::tplbuild::Builds::recent_builds`]); the console then reads
//! a build's status and logs through the API's own
//! `/templates/{templateID}/builds/{buildID}/status`.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use super::{json_error, ConsoleState};
use crate::api::wire::ts;
use crate::api::ApiError;

pub async fn list(
    State(cs): State<Arc<ConsoleState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let Some(s) = cs.current(&headers).await else {
        return json_error(StatusCode::UNAUTHORIZED, "sign in to the console first");
    };
    let Some(builds) = cs.app.builds.as_ref() else {
        return ApiError::not_implemented("template builds").into_response();
    };
    match builds.recent_builds(&s.caller.team, &id).await {
        Ok((tpl, list)) => Json(json!({
            "templateID": tpl.id,
            "name": tpl.name,
            "builds": list.iter().map(|b| json!({
                "buildID": b.build_id,
                "status": b.status,
                "tags": b.tags,
                "reason": b.reason,
                "createdAt": ts(b.created_at_ms),
                "finishedAt": b.finished_at_ms.map(ts),
            })).collect::<Vec<_>>(),
        }))
        .into_response(),
        Err(e) => ApiError::from(e).into_response(),
    }
}
