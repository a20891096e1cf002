//! Build routes of E2B's Template API: `POST /v3/templates`, `GET /templates/{id}/files/
//! {hash}`, `POST /v2/templates/{id}/builds/{buildID}`, `GET /templates/{id}/builds/
//! {buildID}/status` and `…/logs`.

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Deserialize;
use serde_json::{json, Value};

use super::super::wire::{parse_json, ts};
use super::super::{ApiError, ApiResult, St};
use super::{build_of, builds_of, store_err, team_template};
use crate::store::{BuildLogRow, LEVELS};
use crate::tenancy::Caller;
use crate::tplbuild::{files, StartSpec};

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RequestV3 {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    alias: Option<String>,
    #[serde(default)]
    tags: Option<Vec<String>>,
    #[serde(default)]
    cpu_count: Option<i64>,
    #[serde(default, rename = "memoryMB")]
    memory_mb: Option<i64>,
}

/// `POST /v3/templates` → 202 `{templateID, buildID, public, names, tags, aliases}`.
pub async fn request(
    State(st): St,
    Extension(c): Extension<Caller>,
    body: Bytes,
) -> ApiResult<Response> {
    let b = builds_of(&st)?;
    let r: RequestV3 =
        parse_json(&body, false)?.ok_or_else(|| ApiError::bad_request("request body is empty"))?;
    let name = r
        .name
        .or(r.alias)
        .filter(|n| !n.is_empty())
        .ok_or_else(|| ApiError::bad_request("name is required"))?;
    if let Some(n) = r.cpu_count.filter(|n| !(1..=64).contains(n)) {
        return Err(ApiError::bad_request(format!(
            "cpuCount must be 1-64, got {n}"
        )));
    }
    let (t, build) = b
        .request(
            &c.team,
            &name,
            r.tags.unwrap_or_default(),
            r.cpu_count,
            r.memory_mb,
        )
        .await?;
    let body = json!({
        "templateID": t.id,
        "buildID": build.id,
        "public": t.public,
        "names": [t.name],
        "tags": build.tags,
        "aliases": [t.name],
    });
    Ok((StatusCode::ACCEPTED, Json(body)).into_response())
}

/// `GET /templates/{id}/files/{hash}` → 201 `{present, url}`: a single-use upload URL on
/// this server (given even when the files are present, for `forceUpload`), with the scheme
/// and host the client reached it by: `https` on a TLS connection (`--tls-cert`) or behind a
/// proxy saying `X-Forwarded-Proto: https`.
pub async fn files_link(
    State(st): St,
    Extension(c): Extension<Caller>,
    Path((id, hash)): Path<(String, String)>,
    tls: Option<Extension<crate::edge::Https>>,
    uri: axum::http::Uri,
    headers: HeaderMap,
) -> ApiResult<Response> {
    let (b, _) = team_template(&st, &c.team, &id).await?;
    if !files::is_hash(&hash) {
        return Err(ApiError::bad_request(format!(
            "files hash {hash:?} is not a SHA-256 in lowercase hex"
        )));
    }
    let present = b
        .db()
        .file_present(&c.team, &hash)
        .await
        .map_err(store_err)?
        && files::archive_path(b.files_dir(), &c.team, &hash).is_file();
    if present {
        // The collection of uploaded archives gives it its grace period again.
        b.db()
            .touch_file(&c.team, &hash, crate::store::now_ms())
            .await
            .map_err(store_err)?;
    }
    let token = b.tokens().issue(files::Upload {
        team: c.team.clone(),
        hash: hash.clone(),
    });
    let host = crate::routing::request_host(&headers, &uri)
        .ok_or_else(|| ApiError::bad_request("the request names no host"))?;
    let forwarded_https = headers
        .get("x-forwarded-proto")
        .and_then(|h| h.to_str().ok())
        .is_some_and(|p| p.eq_ignore_ascii_case("https"));
    let scheme = if tls.is_some() || forwarded_https {
        "https"
    } else {
        "http"
    };
    let url = format!("{scheme}://{host}{}/{token}", super::UPLOAD_PREFIX);
    Ok((
        StatusCode::CREATED,
        Json(json!({ "present": present, "url": url })),
    )
        .into_response())
}

/// `POST /v2/templates/{id}/builds/{buildID}` → 202.
pub async fn start(
    State(st): St,
    Extension(c): Extension<Caller>,
    Path((id, build)): Path<(String, String)>,
    body: Bytes,
) -> ApiResult<StatusCode> {
    let b = builds_of(&st)?;
    let spec: StartSpec = parse_json(&body, false)?.unwrap_or_default();
    let slot = b.reserve(&c.team).map_err(|e| {
        let mut a = ApiError::new(StatusCode::TOO_MANY_REQUESTS, e.to_string());
        a.retry_after = Some(10);
        a
    })?;
    b.start(&c.team, &id, &build, spec, slot).await?;
    Ok(StatusCode::ACCEPTED)
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StatusQuery {
    logs_offset: Option<u64>,
    limit: Option<u32>,
    level: Option<String>,
}

fn level_index(level: Option<&str>) -> ApiResult<usize> {
    match level {
        None | Some("") => Ok(0),
        Some(l) => LEVELS
            .iter()
            .position(|x| *x == l)
            .ok_or_else(|| ApiError::bad_request(format!("level must be one of {LEVELS:?}"))),
    }
}

fn entry_json(l: &BuildLogRow) -> Value {
    let mut v = json!({ "timestamp": ts(l.ts_ms), "message": l.message, "level": l.level });
    if let Some(s) = &l.step {
        v["step"] = json!(s);
    }
    v
}

/// `GET /templates/{id}/builds/{buildID}/status`.
pub async fn status(
    State(st): St,
    Extension(c): Extension<Caller>,
    Path((id, build)): Path<(String, String)>,
    Query(q): Query<StatusQuery>,
) -> ApiResult<Json<Value>> {
    let (b, t) = team_template(&st, &c.team, &id).await?;
    let row = build_of(b, &t, &build).await?;
    let limit = q.limit.unwrap_or(100).clamp(1, 100);
    let entries = b
        .db()
        .logs(
            &row.id,
            q.logs_offset.unwrap_or(0),
            limit,
            level_index(q.level.as_deref())?,
            false,
        )
        .await
        .map_err(store_err)?;
    let mut v = json!({
        "templateID": t.id,
        "buildID": row.id,
        "status": row.status,
        "logs": [],
        "logEntries": entries.iter().map(entry_json).collect::<Vec<_>>(),
    });
    if row.status == "error" {
        let tail = b
            .db()
            .logs(&row.id, 0, 10_000, 0, true)
            .await
            .map_err(store_err)?;
        let mut tail: Vec<Value> = tail.iter().take(20).map(entry_json).collect();
        tail.reverse();
        let mut reason = json!({
            "message": row.reason.clone().unwrap_or_else(|| "the build failed".into()),
            "logEntries": tail,
        });
        if let Some(s) = &row.reason_step {
            reason["step"] = json!(s);
        }
        v["reason"] = reason;
    }
    Ok(Json(v))
}

#[derive(Debug, Deserialize)]
pub struct LogsQuery {
    cursor: Option<i64>,
    limit: Option<u32>,
    direction: Option<String>,
    level: Option<String>,
    source: Option<String>,
}

/// `GET /templates/{id}/builds/{buildID}/logs` → `{logs}`: from `cursor` (milliseconds)
/// forward or backward.
pub async fn logs(
    State(st): St,
    Extension(c): Extension<Caller>,
    Path((id, build)): Path<(String, String)>,
    Query(q): Query<LogsQuery>,
) -> ApiResult<Json<Value>> {
    let (b, t) = team_template(&st, &c.team, &id).await?;
    let row = build_of(b, &t, &build).await?;
    let backward = match q.direction.as_deref() {
        None | Some("forward") => false,
        Some("backward") => true,
        Some(d) => {
            return Err(ApiError::bad_request(format!(
                "direction {d:?}: use forward or backward"
            )))
        }
    };
    if let Some(s) = q
        .source
        .as_deref()
        .filter(|s| !matches!(*s, "temporary" | "persistent"))
    {
        return Err(ApiError::bad_request(format!(
            "source {s:?}: use temporary or persistent"
        )));
    }
    let limit = q.limit.unwrap_or(100).clamp(1, 1000) as usize;
    let all = b
        .db()
        .logs(
            &row.id,
            0,
            100_000,
            level_index(q.level.as_deref())?,
            backward,
        )
        .await
        .map_err(store_err)?;
    let logs: Vec<Value> = all
        .iter()
        .filter(|l| match (q.cursor, backward) {
            (None, _) => true,
            (Some(c), false) => l.ts_ms >= c,
            (Some(c), true) => l.ts_ms <= c,
        })
        .take(limit)
        .map(entry_json)
        .collect();
    Ok(Json(json!({ "logs": logs })))
}
