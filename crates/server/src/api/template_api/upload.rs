//! `PUT /template-files/{token}`: the upload URL `GET /templates/{id}/files/{hash}` hands
//! out. The token alone authorises it (the SDK sends no API key): single use, bound to the
//! team and hash, valid for an hour. The body must declare its `Content-Length`, at most the
//! upload cap (413 beyond); the archive is checked (no absolute paths, no `..`, no links
//! leading out) before it is stored under its hash.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt;
use tokio::io::AsyncWriteExt;

use super::super::{ApiError, AppState};
use crate::tplbuild::files;

pub async fn put(
    State(st): State<Arc<AppState>>,
    Path(token): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    match store(&st, &token, &headers, body).await {
        Ok(()) => StatusCode::OK.into_response(),
        Err(e) => e.into_response(),
    }
}

async fn store(
    st: &AppState,
    token: &str,
    headers: &HeaderMap,
    body: Body,
) -> Result<(), ApiError> {
    let b = st
        .builds
        .as_ref()
        .ok_or_else(|| ApiError::not_implemented("template builds"))?;
    let up = b.tokens().take(token).ok_or_else(|| {
        ApiError::new(
            StatusCode::FORBIDDEN,
            "this upload URL is unknown, used or expired; ask for a new one",
        )
    })?;
    let declared = headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .ok_or_else(|| ApiError::new(StatusCode::LENGTH_REQUIRED, "Content-Length is required"))?;
    let too_big = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "the upload is larger than this server's cap of {} MiB \
                 (KILN_TEMPLATE_UPLOAD_MAX_MB)",
                b.upload_max() >> 20
            ),
        )
    };
    if declared > b.upload_max() {
        return Err(too_big());
    }
    let dest = files::archive_path(b.files_dir(), &up.team, &up.hash);
    let dir = dest
        .parent()
        .map(std::path::Path::to_path_buf)
        .unwrap_or_default();
    let io = |what: &'static str| {
        move |e: std::io::Error| {
            tracing::warn!(error = %e, "{what}");
            ApiError::internal(format!("{what} failed"))
        }
    };
    tokio::fs::create_dir_all(&dir)
        .await
        .map_err(io("creating the files directory"))?;
    let tmp = dir.join(format!(".{}.part", crate::auth::random_hex(8)));
    let written = async {
        let mut f = tokio::fs::File::create(&tmp)
            .await
            .map_err(io("creating the upload file"))?;
        let mut body = body;
        let mut n = 0u64;
        while let Some(frame) = body.frame().await {
            let frame =
                frame.map_err(|e| ApiError::bad_request(format!("reading the upload: {e}")))?;
            if let Some(d) = frame.data_ref() {
                n += d.len() as u64;
                if n > declared {
                    return Err(ApiError::bad_request(
                        "the upload is longer than its Content-Length",
                    ));
                }
                f.write_all(d).await.map_err(io("writing the upload"))?;
            }
        }
        if n != declared {
            return Err(ApiError::bad_request(format!(
                "the upload ended after {n} of {declared} bytes"
            )));
        }
        f.flush().await.map_err(io("writing the upload"))?;
        let (p, max) = (tmp.clone(), b.upload_max() * 8);
        tokio::task::spawn_blocking(move || files::check_archive(&p, max))
            .await
            .map_err(|e| ApiError::internal(format!("checking the upload: {e}")))?
            .map_err(|e| ApiError::bad_request(format!("refused: {e}")))?;
        tokio::fs::rename(&tmp, &dest)
            .await
            .map_err(io("storing the upload"))?;
        Ok(n)
    }
    .await;
    let n = match written {
        Ok(n) => n,
        Err(e) => {
            let _ = tokio::fs::remove_file(&tmp).await;
            return Err(e);
        }
    };
    b.db()
        .put_file(&up.team, &up.hash, n, crate::store::now_ms())
        .await
        .map_err(|e| ApiError::from(crate::Error::from(e)))?;
    Ok(())
}
