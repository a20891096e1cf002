//! `GET /snapshots` (filters `sandboxID`, `name`; `limit`/`nextToken` pagination) and
//! `DELETE /templates/{snapshotID}`.

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine;
use serde::Deserialize;

use super::wire::snapshot_json;
use super::{ApiError, ApiResult, St};

#[derive(Debug, Deserialize)]
pub struct SnapshotQuery {
    #[serde(rename = "sandboxID")]
    sandbox_id: Option<String>,
    name: Option<String>,
    limit: Option<String>,
    #[serde(rename = "nextToken")]
    next_token: Option<String>,
}

fn cursor(created_at_ms: i64, id: &str) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(format!("{created_at_ms}:{id}"))
}

fn decode_cursor(s: &str) -> ApiResult<(i64, String)> {
    let bad = || ApiError::bad_request(format!("invalid nextToken {s:?}"));
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(s)
        .map_err(|_| bad())?;
    let raw = String::from_utf8(raw).map_err(|_| bad())?;
    let (ms, id) = raw.split_once(':').ok_or_else(bad)?;
    Ok((ms.parse().map_err(|_| bad())?, id.to_string()))
}

pub async fn list_snapshots(State(st): St, Query(q): Query<SnapshotQuery>) -> ApiResult<Response> {
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
        .snapshots(q.sandbox_id.as_deref(), q.name.as_deref())
        .await?;
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
pub async fn delete_template(State(st): St, Path(id): Path<String>) -> ApiResult<StatusCode> {
    st.manager.delete_snapshot(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}
