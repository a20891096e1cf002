//! The volume-content API (`/volumecontent/{volumeID}/path|dir|file?path=…`) as the `e2b`
//! 2.63 SDK's `Volume` calls it, authorised by the volume's own bearer token (not an API
//! key): stat, chown/chmod, remove, list, mkdir, streamed download and upload. Bodies stream
//! (no API body cap); the volume's size bounds uploads (507 when it is full). Paths with
//! `..` are 400; the file operations never leave the volume ([`crate::volume_fs`]).

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use futures::StreamExt;
use serde::Deserialize;
use tokio::io::AsyncWriteExt;

use super::{ApiError, ApiResult, AppState, St};
use crate::volume_fs::{Attrs, FsError, VolPath, Volume};

/// The content routes (merged outside the API-key layer).
pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route(
            "/volumecontent/{volumeID}/path",
            get(stat).patch(update).delete(remove),
        )
        .route("/volumecontent/{volumeID}/dir", get(list).post(make_dir))
        .route("/volumecontent/{volumeID}/file", get(read).put(write))
}

#[derive(Deserialize)]
pub struct Q {
    path: Option<String>,
    depth: Option<u32>,
    uid: Option<u32>,
    gid: Option<u32>,
    mode: Option<u32>,
    force: Option<bool>,
}

impl Q {
    fn path(&self) -> ApiResult<VolPath> {
        let p = self
            .path
            .as_deref()
            .ok_or_else(|| ApiError::bad_request("the path query parameter is required"))?;
        VolPath::parse(p).map_err(fs_err)
    }
    fn attrs(&self) -> Attrs {
        Attrs {
            uid: self.uid,
            gid: self.gid,
            mode: self.mode,
        }
    }
}

#[derive(Deserialize, Default)]
struct PatchBody {
    uid: Option<u32>,
    gid: Option<u32>,
    mode: Option<u32>,
}

fn fs_err(e: FsError) -> ApiError {
    let status = match &e {
        FsError::BadPath(_) => StatusCode::BAD_REQUEST,
        FsError::NotFound(_) => StatusCode::NOT_FOUND,
        FsError::Conflict(_) => StatusCode::CONFLICT,
        FsError::NoSpace(_) => StatusCode::INSUFFICIENT_STORAGE,
        FsError::Io(_) => StatusCode::INTERNAL_SERVER_ERROR,
    };
    ApiError::new(status, e.to_string())
}

/// Opens volume `id` for a request bearing its token (401 otherwise).
async fn open(st: &AppState, id: &str, headers: &HeaderMap) -> ApiResult<Arc<Volume>> {
    let token = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .ok_or_else(|| {
            ApiError::unauthorized("a volume token is required (Authorization: Bearer <token>)")
        })?;
    let Some(v) = st.manager.volume_by_token(id, token.trim()).await? else {
        return Err(ApiError::unauthorized(format!(
            "the token is not valid for volume \"{id}\""
        )));
    };
    let root = st.manager.volume_root(&v.id).await?;
    blocking(move || Volume::open(&root)).await.map(Arc::new)
}

/// Runs a blocking file operation off the async threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, FsError> + Send + 'static,
) -> ApiResult<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::internal(format!("volume task: {e}")))?
        .map_err(fs_err)
}

type Id = Path<String>;

async fn stat(
    State(st): St,
    Path(id): Id,
    Query(q): Query<Q>,
    h: HeaderMap,
) -> ApiResult<Response> {
    let p = q.path()?;
    let v = open(&st, &id, &h).await?;
    Ok(Json(blocking(move || v.stat(&p)).await?).into_response())
}

async fn update(
    State(st): St,
    Path(id): Id,
    Query(q): Query<Q>,
    h: HeaderMap,
    body: axum::body::Bytes,
) -> ApiResult<Response> {
    let p = q.path()?;
    let b: PatchBody = super::wire::parse_json(&body, true)?.unwrap_or_default();
    let v = open(&st, &id, &h).await?;
    let a = Attrs {
        uid: b.uid,
        gid: b.gid,
        mode: b.mode,
    };
    Ok(Json(blocking(move || v.update(&p, a)).await?).into_response())
}

async fn remove(
    State(st): St,
    Path(id): Id,
    Query(q): Query<Q>,
    h: HeaderMap,
) -> ApiResult<Response> {
    let p = q.path()?;
    let v = open(&st, &id, &h).await?;
    blocking(move || v.remove(&p)).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn list(
    State(st): St,
    Path(id): Id,
    Query(q): Query<Q>,
    h: HeaderMap,
) -> ApiResult<Response> {
    let p = q.path()?;
    let depth = q.depth.unwrap_or(1).min(64);
    let v = open(&st, &id, &h).await?;
    Ok(Json(blocking(move || v.list(&p, depth)).await?).into_response())
}

async fn make_dir(
    State(st): St,
    Path(id): Id,
    Query(q): Query<Q>,
    h: HeaderMap,
) -> ApiResult<Response> {
    let (p, a, force) = (q.path()?, q.attrs(), q.force.unwrap_or(false));
    let v = open(&st, &id, &h).await?;
    let s = blocking(move || v.make_dir(&p, force, a)).await?;
    Ok((StatusCode::CREATED, Json(s)).into_response())
}

async fn read(
    State(st): St,
    Path(id): Id,
    Query(q): Query<Q>,
    h: HeaderMap,
) -> ApiResult<Response> {
    let p = q.path()?;
    let v = open(&st, &id, &h).await?;
    let f = blocking(move || v.open_file(&p)).await?;
    let stream =
        tokio_util::io::ReaderStream::with_capacity(tokio::fs::File::from_std(f), 256 << 10);
    Ok((
        [(header::CONTENT_TYPE, "application/octet-stream")],
        Body::from_stream(stream),
    )
        .into_response())
}

/// `PUT …/file`: the body streams into the file (created, or overwritten; `force` makes
/// missing parent directories too) → 201 with its stat.
async fn write(
    State(st): St,
    Path(id): Id,
    Query(q): Query<Q>,
    h: HeaderMap,
    body: Body,
) -> ApiResult<Response> {
    let (p, a, force) = (q.path()?, q.attrs(), q.force.unwrap_or(false));
    let v = open(&st, &id, &h).await?;
    let pc = p.clone();
    let (f, dir) = blocking(move || v.create_file(&pc, force, a)).await?;
    let mut f = tokio::fs::File::from_std(f);
    let mut data = body.into_data_stream();
    while let Some(chunk) = data.next().await {
        let chunk = chunk.map_err(|e| ApiError::bad_request(format!("reading the body: {e}")))?;
        f.write_all(&chunk)
            .await
            .map_err(|e| fs_err(crate::volume_fs::write_error(e, &p)))?;
    }
    f.flush()
        .await
        .map_err(|e| fs_err(crate::volume_fs::write_error(e, &p)))?;
    drop(f);
    let s = blocking(move || Volume::stat_in(&dir, &p)).await?;
    Ok((StatusCode::CREATED, Json(s)).into_response())
}
