//! `GET /files`: streamed (optionally gzip-compressed) downloads.

use std::io::{self, Read, Write};

use bytes::Bytes;
use futures::Stream;
use http::{header, Request, Response, StatusCode};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use tokio::sync::mpsc;

use super::{io_error, Query, READ_CHUNK};
use crate::reply::api_error;
use crate::rpc::Body;
use crate::users::{with_fs_identity, User};

fn accepts_gzip(req: &Request<Incoming>) -> bool {
    req.headers()
        .get_all(header::ACCEPT_ENCODING)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|e| {
            let mut it = e.split(';');
            let name = it.next().unwrap_or("").trim();
            let q0 = it.any(|p| p.trim().replace(' ', "") == "q=0");
            name.eq_ignore_ascii_case("gzip") && !q0
        })
}

/// Sends chunks written to it into the response body channel (blocking side).
struct ChannelWriter(mpsc::Sender<Result<Frame<Bytes>, io::Error>>);

impl Write for ChannelWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0
            .blocking_send(Ok(Frame::data(Bytes::copy_from_slice(buf))))
            .map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "client went away"))?;
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

pub(super) async fn download(req: Request<Incoming>, q: Query, user: User) -> Response<Body> {
    let Some(p) = q.path.as_deref() else {
        return api_error(
            StatusCode::BAD_REQUEST,
            "query parameter `path` is required",
        );
    };
    let path = match crate::fs::resolve(p, &user) {
        Ok(p) => p,
        Err(e) => return api_error(StatusCode::BAD_REQUEST, e.message),
    };
    let u = user.clone();
    let p2 = path.clone();
    let opened = tokio::task::spawn_blocking(move || {
        with_fs_identity(&u, || {
            std::fs::File::open(&p2).and_then(|f| f.metadata().map(|m| (f, m)))
        })
    })
    .await;
    let (mut file, meta) = match opened {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => return io_error(&format!("open {}", path.display()), &e),
        Err(e) => {
            return api_error(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("open task failed: {e}"),
            )
        }
    };
    if meta.is_dir() {
        return api_error(
            StatusCode::BAD_REQUEST,
            format!("path {} is a directory", path.display()),
        );
    }
    let gzip = accepts_gzip(&req);
    let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, io::Error>>(8);
    tokio::task::spawn_blocking(move || {
        let mut buf = vec![0u8; READ_CHUNK];
        if gzip {
            let mut enc = flate2::write::GzEncoder::new(
                ChannelWriter(tx.clone()),
                flate2::Compression::fast(),
            );
            loop {
                match file.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => {
                        if enc.write_all(&buf[..n]).is_err() {
                            return;
                        }
                    }
                    Err(e) => {
                        let _ = tx.blocking_send(Err(e));
                        return;
                    }
                }
            }
            let _ = enc.finish();
        } else {
            loop {
                match file.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => {
                        if tx
                            .blocking_send(Ok(Frame::data(Bytes::copy_from_slice(&buf[..n]))))
                            .is_err()
                        {
                            return;
                        }
                    }
                    Err(e) => {
                        let _ = tx.blocking_send(Err(e));
                        return;
                    }
                }
            }
        }
    });
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut b = Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .header(
            header::CONTENT_DISPOSITION,
            format!("attachment; filename=\"{}\"", header_safe(&name)),
        );
    if gzip {
        b = b
            .header(header::CONTENT_ENCODING, "gzip")
            .header(header::VARY, "Accept-Encoding");
    } else {
        b = b.header(header::CONTENT_LENGTH, meta.len());
    }
    let body = StreamBody::new(RecvStream(rx)).boxed_unsync();
    b.body(body).expect("valid response")
}

/// File name usable inside a quoted header parameter (printable ASCII only).
pub(super) fn header_safe(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_graphic() && c != '"' && c != '\\' || c == ' ' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

struct RecvStream(mpsc::Receiver<Result<Frame<Bytes>, io::Error>>);
impl Stream for RecvStream {
    type Item = Result<Frame<Bytes>, io::Error>;
    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        self.0.poll_recv(cx)
    }
}
