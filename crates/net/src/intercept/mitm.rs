//! One intercepted connection: TLS to the upstream first (verified as any client would: the
//! host's roots, the SNI name or the IP), then the sandbox's TLS accepted with a leaf for the
//! same name, then HTTP/1.1 relayed request by request with hyper, the host's rule headers set
//! on each. An upstream that cannot be reached or fails verification is never bypassed: the
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
    let leaf = t
        .interceptor
        .ca
        .server_config(name, &[b"http/1.1"])
        .map_err(io::Error::other)?;
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
    let (rd, wr) = client.into_split();
    let stream = Counted {
        inner: tokio::io::join(std::io::Cursor::new(peeked).chain(rd), wr),
        read: out,
        written: inn,
    };
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
    let svc = hyper::service::service_fn(move |mut req: Request<Incoming>| {
        let (t, host, sender) = (t.clone(), host.clone(), sender.clone());
        async move {
            if let Err(e) = host
                .apply(req.headers_mut(), &t.team, t.secrets.as_ref())
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
                Ok(r) => r.map(|b| b.boxed()),
                Err(e) => text(StatusCode::BAD_GATEWAY, format!("upstream: {e}")),
            })
        }
    });
    let r = hyper::server::conn::http1::Builder::new()
        .serve_connection(TokioIo::new(tls), svc)
        .await
        .map_err(io::Error::other);
    upstream_conn.abort();
    r
}
