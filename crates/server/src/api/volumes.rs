//! E2B's `/volumes` routes as the `e2b` 2.63 SDK sends them: create (201 with the volume's
//! content token), list, get (with the token), delete (204; 409 while a sandbox mounts it) —
//! per team (another team's volume is a 404). The files are served by
//! [`super::volume_content`].

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Deserialize;
use serde_json::{json, Value};

use super::wire::parse_json;
use super::{ApiError, ApiResult, St};
use crate::store::VolumeRecord;
use crate::tenancy::Caller;

#[derive(Deserialize)]
struct NewVolume {
    name: String,
}

fn with_token(v: &VolumeRecord) -> Value {
    json!({"volumeID": v.id, "name": v.name, "token": v.token})
}

/// `POST /volumes {name}` → 201 `{volumeID, name, token}`.
pub async fn create(
    State(st): St,
    Extension(c): Extension<Caller>,
    body: Bytes,
) -> ApiResult<Response> {
    let b: NewVolume =
        parse_json(&body, false)?.ok_or_else(|| ApiError::bad_request("request body is empty"))?;
    let m = st.manager.clone();
    let v = tokio::spawn(async move { m.create_volume(&c.team, &b.name).await })
        .await
        .map_err(|e| ApiError::internal(format!("volume task: {e}")))??;
    Ok((StatusCode::CREATED, Json(with_token(&v))).into_response())
}

/// `GET /volumes` → `[{volumeID, name}]`.
pub async fn list(State(st): St, Extension(c): Extension<Caller>) -> ApiResult<Json<Value>> {
    let all = st.manager.list_volumes(Some(&c.team)).await?;
    Ok(Json(Value::Array(
        all.iter()
            .map(|v| json!({"volumeID": v.id, "name": v.name}))
            .collect(),
    )))
}

/// `GET /volumes/{volumeID}` (id or name) → `{volumeID, name, token}`.
pub async fn get_one(
    State(st): St,
    Extension(c): Extension<Caller>,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    Ok(Json(with_token(&st.manager.volume(&c.team, &id).await?)))
}

/// `DELETE /volumes/{volumeID}` → 204; 409 while a live sandbox mounts it.
pub async fn delete(
    State(st): St,
    Extension(c): Extension<Caller>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    let m = st.manager.clone();
    tokio::spawn(async move { m.delete_volume(&c.team, &id).await })
        .await
        .map_err(|e| ApiError::internal(format!("volume task: {e}")))??;
    Ok(StatusCode::NO_CONTENT)
}

/// The `volumeMounts` of a create body: `[{name, path}]`.
pub fn mounts_of(v: Option<&Vec<Value>>) -> ApiResult<Vec<(String, String)>> {
    let mut out = Vec::new();
    for m in v.into_iter().flatten() {
        let name = m["name"].as_str();
        let path = m["path"].as_str();
        match (name, path) {
            (Some(n), Some(p)) => out.push((n.to_string(), p.to_string())),
            _ => {
                return Err(ApiError::bad_request(
                    "volumeMounts: each entry needs a string name and path",
                ))
            }
        }
    }
    Ok(out)
}

/// The `volumeMounts` a sandbox's info shows.
pub async fn info(st: &super::AppState, id: &str) -> ApiResult<Option<Value>> {
    let mounts = st.manager.mounts_of(id).await?;
    Ok((!mounts.is_empty()).then(|| {
        Value::Array(
            mounts
                .iter()
                .map(|m| json!({"name": m.name, "path": m.path}))
                .collect(),
        )
    }))
}
