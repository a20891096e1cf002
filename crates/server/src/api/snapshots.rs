//! `GET /snapshots` (filters `sandboxID`, `name`; `limit`/`nextToken` pagination) and
//! `DELETE /templates/{snapshotID}`.

use super::list::{cursor, decode_cursor};
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Deserialize;

use super::wire::snapshot_json;
use super::{ApiError, ApiResult, St};
use crate::tenancy::Caller;

#[derive(Debug, Deserialize)]
pub struct SnapshotQuery {
    #[serde(rename = "sandboxID")]
    sandbox_id: Option<String>,
    name: Option<String>,
    limit: Option<String>,
    #[serde(rename = "nextToken")]
    next_token: Option<String>,
}

pub async fn list_snapshots(
    State(st): St,
    Extension(c): Extension<Caller>,
    Query(q): Query<SnapshotQuery>,
) -> ApiResult<Response> {
    let limit: usize = match q.limit.as_deref() {
        None => 100,
        Some(l) => l
            .parse()
            .ok()
            .filter(|n| (1..=1000).contains(n))
            .ok_or_else(|| ApiError::bad_request(format!("limit must be 1-1000, got {l:?}")))?,
    };
    let after = q
        .next_token
        .as_deref()
        .filter(|t| !t.is_empty())
        .map(decode_cursor)
        .transpose()?;
    let mut all = st
        .manager
        .snapshots(&c.team, q.sandbox_id.as_deref(), q.name.as_deref())
        .await?;
    // Layers of template builds are the builds' own, not the team's snapshots.
    if let Some(b) = &st.builds {
        let layers: std::collections::HashSet<String> = b
            .db()
            .build_snapshot_ids()
            .await
            .map_err(crate::Error::from)?
            .into_iter()
            .collect();
        all.retain(|s| !layers.contains(&s.id));
    }
    if let Some(key) = after {
        all.retain(|s| (s.created_at_ms, s.id.clone()) > key);
    }
    let more = all.len() > limit;
    all.truncate(limit);
    let mut resp = Json(all.iter().map(snapshot_json).collect::<Vec<_>>()).into_response();
    if let (true, Some(last)) = (more, all.last()) {
        if let Ok(v) = cursor(last.created_at_ms, &last.id).parse() {
            resp.headers_mut().insert("x-next-token", v);
        }
    }
    Ok(resp)
}

/// `DELETE /templates/{templateID}`: deletes a snapshot (templates built with `kiln template
/// build` are managed with that command).
pub async fn delete_template(
    State(st): St,
    Extension(c): Extension<Caller>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    let snap = st.manager.snapshot_for(&id, &c.team).await?;
    st.manager.delete_snapshot(&id, &c.team).await?;
    if let Some(s) = snap {
        super::net_inherit::snapshot_deleted(&st, &s.id, &c.team).await?;
    }
    Ok(StatusCode::NO_CONTENT)
}
