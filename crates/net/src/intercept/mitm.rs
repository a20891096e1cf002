//! One intercepted connection: TLS to the upstream first (verified as any client would: the
//! host's roots, the SNI name or the IP), then the sandbox's TLS accepted with a leaf for the
//! same name, then HTTP relayed request by request with hyper (HTTP/2 or HTTP/1.1 towards the
//! sandbox, as its ALPN chose; HTTP/1.1 towards the upstream), the host's rule headers set on
//! each. An upstream that cannot be reached or fails verification is never bypassed: the
//! sandbox gets a `502` naming what failed, and the connection ends.

use std::convert::Infallible;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;

use super::{HostRules, Transforms};

const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

type Body = BoxBody<Bytes, hyper::Error>;

/// Counts the bytes read from and written to a stream.
struct Counted<S> {
    inner: S,
    read: Arc<AtomicU64>,
    written: Arc<AtomicU64>,
}

impl<S: AsyncRead + Unpin> AsyncRead for Counted<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        let n = buf.filled().len() - before;
        self.read.fetch_add(n as u64, Ordering::Relaxed);
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Counted<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = &r {
            self.written.fetch_add(*n as u64, Ordering::Relaxed);
        }
        r
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

fn text(status: StatusCode, msg: String) -> Response<Body> {
    let mut r = Response::new(
        Full::new(Bytes::from(format!("kiln egress: {msg}\n")))
            .map_err(|n: Infallible| match n {})
            .boxed(),
    );
    *r.status_mut() = status;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

/// Headers HTTP/2 forbids (connection-specific), dropped from HTTP/1.1 answers relayed to an
/// HTTP/2 client.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "upgrade",
];

/// An HTTP/2 request as the HTTP/1.1 upstream takes it: `Host` from the authority, the path
/// as the target.
fn to_http1(req: &mut Request<Incoming>) {
    if let Some(a) = req.uri().authority().map(|a| a.as_str().to_string()) {
        if !req.headers().contains_key(http::header::HOST) {
            if let Ok(v) = http::HeaderValue::from_str(&a) {
                req.headers_mut().insert(http::header::HOST, v);
            }
        }
    }
    let path = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "/".into());
    if let Ok(u) = path.parse() {
        *req.uri_mut() = u;
    }
    *req.version_mut() = http::Version::HTTP_11;
}

/// Relays an intercepted connection: `client` is the sandbox's (its first bytes, the
/// ClientHello, already read into `peeked`), `upstream` the connection to its destination
/// (or why there is none), `name` the SNI name or the IP the leaf and the check use. Counts
/// the sandbox's bytes into `out` (sent) and `inn` (received). An error says what failed.
#[allow(clippy::too_many_arguments)]
pub async fn relay<U>(
    t: Arc<Transforms>,
    host: HostRules,
    name: &str,
    client: TcpStream,
    peeked: Vec<u8>,
    upstream: io::Result<U>,
    out: Arc<AtomicU64>,
    inn: Arc<AtomicU64>,
) -> io::Result<()>
where
    U: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    // The upstream first: a sandbox whose upstream fails verification is told so.
    let up = async {
        let tcp = upstream?;
        let sn = ServerName::try_from(name.to_string())
            .map_err(|_| io::Error::other(format!("{name:?} is not a TLS server name")))?;
        let c = tokio_rustls::TlsConnector::from(t.interceptor.upstream());
        tokio::time::timeout(HANDSHAKE_TIMEOUT, c.connect(sn, tcp))
            .await
            .map_err(|_| io::Error::other("the upstream TLS handshake timed out"))?
    }
    .await
    .map_err(|e| io::Error::other(format!("upstream {name}: {e}")));
    // Each answer leaves as soon as it is written (see the egress proxy).
    client.set_nodelay(true)?;
    let (rd, wr) = client.into_split();
    let stream = Counted {
        inner: tokio::io::join(std::io::Cursor::new(peeked).chain(rd), wr),
        read: out,
        written: inn,
    };
    // A failed upstream is answered in HTTP/1.1 (one plain answer); else HTTP/2 is offered too.
    let alpn: &[&[u8]] = match up {
        Ok(_) => &[b"h2", b"http/1.1"],
        Err(_) => &[b"http/1.1"],
    };
    let leaf = t
        .interceptor
        .ca
        .server_config(name, alpn)
        .map_err(io::Error::other)?;
    let acceptor = tokio_rustls::TlsAcceptor::from(leaf);
    let mut tls = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream))
        .await
        .map_err(|_| io::Error::other("the sandbox's TLS handshake timed out"))?
        .map_err(|e| io::Error::other(format!("the sandbox's TLS handshake: {e}")))?;
    let up = match up {
        Ok(up) => up,
        Err(e) => {
            // One answer saying why, then the end of the connection.
            let body = format!("kiln egress: {e}\n");
            let head = format!(
                "HTTP/1.1 502 Bad Gateway\r\ncontent-type: text/plain; charset=utf-8\r\n\
                 content-length: {}\r\nconnection: close\r\n\r\n",
                body.len()
            );
            let _ = tls.write_all(head.as_bytes()).await;
            let _ = tls.write_all(body.as_bytes()).await;
            let _ = tls.shutdown().await;
            return Err(e);
        }
    };
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(up))
        .await
        .map_err(|e| io::Error::other(format!("upstream {name}: {e}")))?;
    let upstream_conn = tokio::spawn(conn);
    let sender = Arc::new(tokio::sync::Mutex::new(sender));
    let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
    // Shared by every request of the connection (a clone per request would copy the rules).
    let host = Arc::new(host);
    let svc = hyper::service::service_fn(move |mut req: Request<Incoming>| {
        let (t, host, sender) = (t.clone(), host.clone(), sender.clone());
        async move {
            if h2 {
                to_http1(&mut req);
            }
            if let Err(e) = host
                .apply(
                    req.headers_mut(),
                    &t.team,
                    t.secrets.as_ref(),
                    t.tokens.as_deref(),
                )
                .await
            {
                tracing::warn!(rule = %host.key, error = %e, "egress transform not applied");
                return Ok::<_, Infallible>(text(
                    StatusCode::BAD_GATEWAY,
                    format!("the network rule for {} cannot be applied: {e}", host.key),
                ));
            }
            let mut s = sender.lock().await;
            if s.ready().await.is_err() {
                return Ok(text(
                    StatusCode::BAD_GATEWAY,
                    "the upstream closed the connection".into(),
                ));
            }
            Ok(match s.send_request(req).await {
                Ok(mut r) => {
                    if h2 {
                        for h in HOP_BY_HOP {
                            r.headers_mut().remove(*h);
                        }
                        *r.version_mut() = http::Version::HTTP_2;
                    }
                    r.map(|b| b.boxed())
                }
                Err(e) => text(StatusCode::BAD_GATEWAY, format!("upstream: {e}")),
            })
        }
    });
    let r = if h2 {
        hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
            .serve_connection(TokioIo::new(tls), svc)
            .await
            .map_err(io::Error::other)
    } else {
        hyper::server::conn::http1::Builder::new()
            .serve_connection(TokioIo::new(tls), svc)
            .await
            .map_err(io::Error::other)
    };
    upstream_conn.abort();
    r
}
