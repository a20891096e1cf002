//! `POST /files`: octet-stream and multipart uploads, written by a thread with the user's
//! filesystem identity.

use std::io::{self, Write};
use std::path::{Path, PathBuf};

use bytes::Bytes;
use futures::{Stream, StreamExt};
use http::{header, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tokio::sync::mpsc;

use super::{io_status, ok_json, Query, WRITE_BATCH};
use crate::reply::api_error;
use crate::rpc::Body;
use crate::users::{with_fs_identity, User};

/// Metadata from `X-Metadata-<key>` headers.
fn metadata_headers(req: &Request<Incoming>) -> Result<Vec<(String, String)>, String> {
    let mut out = Vec::new();
    for (k, v) in req.headers() {
        if let Some(key) = k.as_str().strip_prefix("x-metadata-") {
            if key.is_empty() {
                return Err("empty X-Metadata- key".into());
            }
            let v = v
                .to_str()
                .map_err(|_| format!("metadata value of {key:?} is not printable ASCII"))?;
            out.push((key.to_ascii_lowercase(), v.to_string()));
        }
    }
    Ok(out)
}

/// Open `path` for writing as `user`, creating parent directories.
fn open_for_write(path: &Path, user: &User) -> io::Result<std::fs::File> {
    with_fs_identity(user, || {
        if let Some(parent) = path.parent() {
            crate::fs::create_dirs(parent, user)?;
        }
        if path.is_dir() {
            return Err(io::Error::from_raw_os_error(libc::EISDIR));
        }
        // An existing file is truncated by ftruncate(2), which gVisor reports to watchers as
        // a write as Linux does for `O_TRUNC` (gVisor's `O_TRUNC` reports nothing).
        let existed = std::fs::symlink_metadata(path).is_ok();
        let f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(!existed)
            .open(path)?;
        if existed {
            f.set_len(0)?;
        }
        // The file belongs to the writing user, as envd makes it (its chown is also the
        // attribute change a watcher sees between the create and the write). Best effort:
        // a user may not take over another's file.
        let _ = std::os::unix::fs::fchown(&f, Some(user.uid), Some(user.gid));
        Ok(f)
    })
}

/// Write a stream of chunks to `path` from a dedicated blocking thread (bounded queue).
async fn write_stream<S>(
    path: PathBuf,
    user: User,
    gzip: bool,
    metadata: Vec<(String, String)>,
    mut body: S,
) -> Result<(), (StatusCode, String)>
where
    S: Stream<Item = Result<Bytes, String>> + Unpin,
{
    let (tx, mut rx) = mpsc::channel::<Bytes>(16);
    let p2 = path.clone();
    let user_for_cleanup = user.clone();
    let writer = tokio::task::spawn_blocking(move || -> io::Result<()> {
        let file = open_for_write(&p2, &user)?;
        let written = (|| -> io::Result<()> {
            if gzip {
                let mut dec =
                    flate2::write::GzDecoder::new(io::BufWriter::with_capacity(1 << 20, file));
                while let Some(chunk) = rx.blocking_recv() {
                    dec.write_all(&chunk)?;
                }
                dec.try_finish()?;
                dec.finish()?.flush()?;
            } else {
                let mut w = file;
                while let Some(chunk) = rx.blocking_recv() {
                    w.write_all(&chunk)?;
                }
            }
            Ok(())
        })();
        if let Err(e) = written {
            // Do not leave a truncated file behind (it would also keep the space used).
            let _ = with_fs_identity(&user, || std::fs::remove_file(&p2));
            return Err(e);
        }
        // An overwrite replaces the file's metadata: user xattrs where the filesystem has
        // them, else the agent's store (cleared when the upload carries none).
        let meta: std::collections::BTreeMap<String, String> = metadata.into_iter().collect();
        let in_xattrs = with_fs_identity(&user, || crate::fs::replace_xattrs(&p2, &meta))?;
        crate::metastore::store().set(&p2, if in_xattrs { Default::default() } else { meta });
        Ok(())
    });
    let mut recv_err = None;
    // Coalesce the body's (often small) frames into large buffers: one copy, few hand-offs.
    let mut acc = bytes::BytesMut::new();
    loop {
        let next = body.next().await;
        let c = match next {
            Some(Ok(c)) => {
                if acc.is_empty() && c.len() >= WRITE_BATCH {
                    c
                } else {
                    if acc.capacity() - acc.len() < c.len() {
                        acc.reserve(WRITE_BATCH.max(c.len()));
                    }
                    acc.extend_from_slice(&c);
                    if acc.len() < WRITE_BATCH {
                        continue;
                    }
                    acc.split().freeze()
                }
            }
            Some(Err(e)) => {
                recv_err = Some(e);
                break;
            }
            None => {
                if !acc.is_empty() {
                    let _ = tx.send(acc.split().freeze()).await;
                }
                break;
            }
        };
        if tx.send(c).await.is_err() {
            // The writer failed (its error is reported below). Drain the rest of the body so
            // the client gets our answer instead of a reset connection.
            while let Some(Ok(_)) = body.next().await {}
            break;
        }
    }
    drop(tx);
    let res = writer.await.map_err(|e| {
        (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("write task failed: {e}"),
        )
    })?;
    if let Err(e) = res {
        let st =
            if e.kind() == io::ErrorKind::InvalidInput || e.kind() == io::ErrorKind::InvalidData {
                StatusCode::BAD_REQUEST
            } else {
                io_status(&e)
            };
        let msg = if st == StatusCode::INSUFFICIENT_STORAGE {
            format!("write {}: not enough disk space: {e}", path.display())
        } else {
            format!("write {}: {e}", path.display())
        };
        return Err((st, msg));
    }
    if let Some(e) = recv_err {
        let (u, p) = (user_for_cleanup, path.clone());
        let _ =
            tokio::task::spawn_blocking(move || with_fs_identity(&u, || std::fs::remove_file(&p)))
                .await;
        return Err((
            StatusCode::BAD_REQUEST,
            format!("upload of {} broke off: {e}", path.display()),
        ));
    }
    Ok(())
}

/// One written file as the upload answers it, with the metadata the upload set (keys
/// lowercased, as stored).
fn write_info(path: &Path, metadata: &[(String, String)]) -> serde_json::Value {
    let mut v = serde_json::json!({
        "name": path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
        "type": "file",
        "path": path.to_string_lossy(),
    });
    if !metadata.is_empty() {
        let m: serde_json::Map<String, serde_json::Value> = metadata
            .iter()
            .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
            .collect();
        v["metadata"] = serde_json::Value::Object(m);
    }
    v
}

/// The `file` parts of a multipart upload, each with the path it goes to (before resolution
/// against the user's home). The first part goes to the `path` query parameter when given, later
/// ones to their own file names (or `path` again when they have none).
pub(crate) struct FileParts {
    mp: multer::Multipart<'static>,
    path: Option<String>,
    signed: bool,
    seen: usize,
}

impl FileParts {
    /// `content_type`: the request's `Content-Type` (with its boundary). `signed`: the request
    /// is authorized by a URL signature covering only `path`, so every part must go there.
    pub(crate) fn new<S, E>(
        content_type: &str,
        body: S,
        path: Option<&str>,
        signed: bool,
    ) -> Result<Self, (StatusCode, String)>
    where
        S: Stream<Item = Result<Bytes, E>> + Send + 'static,
        E: Into<Box<dyn std::error::Error + Send + Sync>> + 'static,
    {
        let boundary = multer::parse_boundary(content_type).map_err(|e| {
            (
                StatusCode::BAD_REQUEST,
                format!("bad multipart content type: {e}"),
            )
        })?;
        Ok(FileParts {
            mp: multer::Multipart::new(body, boundary),
            path: path.map(str::to_string),
            signed,
            seen: 0,
        })
    }

    /// The next `file` part and its target path; parts with other names are skipped.
    pub(crate) async fn next(
        &mut self,
    ) -> Result<Option<(String, multer::Field<'static>)>, (StatusCode, String)> {
        loop {
            let field = match self.mp.next_field().await {
                Ok(Some(f)) => f,
                Ok(None) => return Ok(None),
                Err(e) => {
                    return Err((
                        StatusCode::BAD_REQUEST,
                        format!("malformed multipart body: {e}"),
                    ))
                }
            };
            if field.name() != Some("file") {
                continue;
            }
            let target = part_target(self.path.as_deref(), field.file_name(), self.seen == 0)?;
            if self.signed && Some(target.as_str()) != self.path.as_deref() {
                return Err((
                    StatusCode::UNAUTHORIZED,
                    "the file URL signature does not cover this multipart file name".into(),
                ));
            }
            self.seen += 1;
            return Ok(Some((target, field)));
        }
    }
}

/// Where a `file` part goes: `path` for the first part, else its file name, else `path`.
fn part_target(
    path: Option<&str>,
    file_name: Option<&str>,
    first: bool,
) -> Result<String, (StatusCode, String)> {
    match (path, file_name) {
        (Some(p), _) if first => Ok(p.to_string()),
        (_, Some(f)) if !f.is_empty() => Ok(f.to_string()),
        (Some(p), _) => Ok(p.to_string()),
        _ => Err((
            StatusCode::BAD_REQUEST,
            "multipart file part has no file name and no `path` parameter was given".into(),
        )),
    }
}

/// `signed`: the request is authorized by a URL signature, which covers only `q.path`; every
/// multipart part must then go to exactly that path.
pub(super) async fn upload(
    req: Request<Incoming>,
    q: Query,
    user: User,
    signed: bool,
) -> Response<Body> {
    let ct = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let metadata = match metadata_headers(&req) {
        Ok(m) => m,
        Err(e) => return api_error(StatusCode::BAD_REQUEST, e),
    };
    let gzip = req
        .headers()
        .get(header::CONTENT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.trim().eq_ignore_ascii_case("gzip"))
        .unwrap_or(false);
    let mime = ct
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    if mime == "multipart/form-data" {
        let body = req.into_body().into_data_stream();
        let mut parts = match FileParts::new(&ct, body, q.path.as_deref(), signed) {
            Ok(p) => p,
            Err((st, m)) => return api_error(st, m),
        };
        let mut written = Vec::new();
        loop {
            let (target, field) = match parts.next().await {
                Ok(Some(p)) => p,
                Ok(None) => break,
                Err((st, m)) => return api_error(st, m),
            };
            let path = match crate::fs::resolve(&target, &user) {
                Ok(p) => p,
                Err(e) => return api_error(StatusCode::BAD_REQUEST, e.message),
            };
            let stream = field.map(|r| r.map_err(|e| e.to_string()));
            if let Err((st, m)) = write_stream(
                path.clone(),
                user.clone(),
                false,
                metadata.clone(),
                Box::pin(stream),
            )
            .await
            {
                return api_error(st, m);
            }
            written.push(write_info(&path, &metadata));
        }
        if written.is_empty() {
            return api_error(StatusCode::BAD_REQUEST, "multipart body has no `file` part");
        }
        return ok_json(&serde_json::Value::Array(written));
    }
    let Some(p) = q.path.as_deref() else {
        return api_error(
            StatusCode::BAD_REQUEST,
            "query parameter `path` is required for octet-stream uploads",
        );
    };
    let path = match crate::fs::resolve(p, &user) {
        Ok(p) => p,
        Err(e) => return api_error(StatusCode::BAD_REQUEST, e.message),
    };
    let stream = req
        .into_body()
        .into_data_stream()
        .map(|r| r.map_err(|e| e.to_string()));
    if let Err((st, m)) =
        write_stream(path.clone(), user, gzip, metadata.clone(), Box::pin(stream)).await
    {
        return api_error(st, m);
    }
    ok_json(&serde_json::Value::Array(vec![write_info(
        &path, &metadata,
    )]))
}
