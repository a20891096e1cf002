//! Getting a request to the sandbox's port and its answer back. gRPC (HTTP/2 only, trailers)
//! goes over HTTP/2 with prior knowledge (h2c); everything else as HTTP/1.1, whatever the
//! client spoke. Small bodies are buffered so a connection that fails before the sandbox
//! answers can be retried once; large ones stream through. An upgraded connection (WebSocket
//! and the like) is spliced both ways once the sandbox agrees.

use axum::body::Body;
use axum::response::Response;
use http::{header, HeaderMap, HeaderValue, Method, Request, StatusCode};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use kiln_envd::{EnvdClient, EnvdError};

/// Request bodies up to this size are buffered (and retried once on a connection failure).
const SMALL_BODY: u64 = 1 << 20;

/// The request line and headers that go to the sandbox.
pub struct Head {
    pub method: Method,
    /// Path and query.
    pub path: String,
    pub headers: HeaderMap,
    /// Sent over HTTP/2 (a gRPC call).
    pub grpc: bool,
    /// The client asks for an upgrade.
    pub upgrade: bool,
}

/// Whether a request is a gRPC call: HTTP/2, not an upgrade, `application/grpc…`.
pub fn is_grpc(version: http::Version, headers: &HeaderMap, upgrade: bool) -> bool {
    version == http::Version::HTTP_2
        && !upgrade
        && headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|c| c.starts_with("application/grpc"))
}

/// A request body as it will be sent.
pub enum Prepared {
    /// Read whole: sent as one, and again on a retry.
    Buffered(bytes::Bytes),
    /// Passed through as it arrives.
    Streamed(Body),
}

/// Reads `body` whole when it is small enough to buffer: a `Content-Length` up to
/// [`SMALL_BODY`]; a chunked body to the agent (the JS SDK sends every upload so) read up to the
/// same size to tell; an empty one to another port (a chunked one there streams at once: its
/// client may wait for an answer before it sends the rest).
pub async fn prepare(body: Body, head: &Head, port: u16) -> Result<Prepared, axum::Error> {
    if head.upgrade || head.grpc {
        return Ok(Prepared::Streamed(body));
    }
    match head.headers.get(header::CONTENT_LENGTH) {
        Some(v) => {
            let small = v
                .to_str()
                .ok()
                .and_then(|s| s.parse::<u64>().ok())
                .is_some_and(|n| n <= SMALL_BODY);
            if !small {
                return Ok(Prepared::Streamed(body));
            }
            let c = http_body_util::BodyExt::collect(body).await?;
            Ok(Prepared::Buffered(c.to_bytes()))
        }
        None if port != kiln_proto::envd::ENVD_PORT => {
            if http_body::Body::is_end_stream(&body) {
                Ok(Prepared::Buffered(bytes::Bytes::new()))
            } else {
                Ok(Prepared::Streamed(body))
            }
        }
        None => Ok(match peek_body(body, SMALL_BODY).await? {
            Peeked::Whole(bytes) => Prepared::Buffered(bytes),
            Peeked::Partial(rest) => Prepared::Streamed(rest),
        }),
    }
}

/// Why a request did not get an answer.
pub enum Failed {
    /// The request could not be built from the client's.
    Build(http::Error),
    /// The port did not answer.
    Unreachable(EnvdError),
}

/// Sends `head` with `body` through `client` (`id`: for the log).
pub async fn send(
    client: &EnvdClient,
    head: &Head,
    body: Prepared,
    id: &str,
) -> Result<http::Response<Incoming>, Failed> {
    let build = |body: Body| -> Result<Request<Body>, Failed> {
        let mut r = Request::builder()
            .method(head.method.clone())
            .uri(head.path.as_str())
            .version(http::Version::HTTP_11)
            .body(body)
            .map_err(Failed::Build)?;
        *r.headers_mut() = head.headers.clone();
        Ok(r)
    };
    match body {
        _ if head.grpc => {
            let body = match body {
                Prepared::Streamed(b) => b,
                Prepared::Buffered(b) => Body::from(b),
            };
            let mut h2_headers = head.headers.clone();
            h2_headers.remove(header::HOST);
            h2_headers.insert(header::TE, HeaderValue::from_static("trailers"));
            let mut r = Request::builder()
                .method(head.method.clone())
                .uri(format!("http://localhost{}", head.path))
                .version(http::Version::HTTP_2)
                .body(body)
                .map_err(Failed::Build)?;
            *r.headers_mut() = h2_headers;
            client.send_h2(r).await.map_err(Failed::Unreachable)
        }
        Prepared::Buffered(bytes) => {
            let mut attempt = 0;
            loop {
                match client.send(build(Body::from(bytes.clone()))?).await {
                    Ok(r) => break Ok(r),
                    Err(e) if attempt == 0 => {
                        tracing::debug!(sandbox = id, error = %e, "retrying a request to the agent");
                        attempt += 1;
                        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                    }
                    Err(e) => break Err(Failed::Unreachable(e)),
                }
            }
        }
        Prepared::Streamed(body) => client.send(build(body)?).await.map_err(Failed::Unreachable),
    }
}

/// The client's answer to a `101 Switching Protocols` of the sandbox: the two upgraded
/// connections are spliced (in the background, holding `guard` until they close) when the
/// client asked for an upgrade (`client`).
pub fn splice<G: Send + 'static>(
    mut resp: http::Response<Incoming>,
    client: Option<hyper::upgrade::OnUpgrade>,
    guard: G,
) -> Response {
    debug_assert_eq!(resp.status(), StatusCode::SWITCHING_PROTOCOLS);
    if let Some(client) = client {
        let sandbox = hyper::upgrade::on(&mut resp);
        tokio::spawn(async move {
            let _in_use = guard;
            match tokio::try_join!(client, sandbox) {
                Ok((c, a)) => {
                    let mut c = TokioIo::new(c);
                    let mut a = TokioIo::new(a);
                    let _ = tokio::io::copy_bidirectional(&mut c, &mut a).await;
                }
                Err(e) => tracing::debug!(error = %e, "upgrade through the proxy failed"),
            }
        });
    }
    let (parts, _) = resp.into_parts();
    Response::from_parts(parts, Body::empty())
}

/// `body` as the client's answer, keeping `guard` until it ends or is dropped (frames and
/// trailers pass unchanged).
pub fn held_body<B, G>(body: B, guard: G) -> Body
where
    B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<axum::BoxError>,
    G: Send + 'static,
{
    let frames = futures::StreamExt::map(http_body_util::BodyStream::new(body), move |f| {
        let _held = &guard;
        f.map_err(Into::into)
    });
    Body::new(http_body_util::StreamBody::new(frames))
}

/// A request body read up to a limit: all of it, or what was read followed by the rest.
enum Peeked {
    Whole(bytes::Bytes),
    Partial(Body),
}

/// Reads `body` until it ends (data only) or passes `limit` bytes or yields trailers; then the
/// frames read go first in the body that streams on.
async fn peek_body(mut body: Body, limit: u64) -> Result<Peeked, axum::Error> {
    use http_body_util::BodyExt;
    let mut frames: Vec<http_body::Frame<bytes::Bytes>> = Vec::new();
    let mut size = 0u64;
    while size <= limit {
        match body.frame().await {
            None => {
                let mut whole = bytes::BytesMut::with_capacity(size as usize);
                for f in frames {
                    if let Ok(d) = f.into_data() {
                        whole.extend_from_slice(&d);
                    }
                }
                return Ok(Peeked::Whole(whole.freeze()));
            }
            Some(Err(e)) => return Err(e),
            Some(Ok(f)) => {
                let Some(d) = f.data_ref() else {
                    frames.push(f);
                    break;
                };
                size += d.len() as u64;
                frames.push(f);
            }
        }
    }
    let head = futures::stream::iter(frames.into_iter().map(Ok::<_, axum::Error>));
    let rest = http_body_util::BodyStream::new(body);
    let stream = futures::StreamExt::chain(head, rest);
    Ok(Peeked::Partial(Body::new(http_body_util::StreamBody::new(
        stream,
    ))))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A chunked body of `chunks` (as the JS SDK's uploads arrive).
    fn chunked(chunks: Vec<&'static [u8]>) -> Body {
        let frames = chunks
            .into_iter()
            .map(|c| Ok::<_, std::io::Error>(bytes::Bytes::from_static(c)));
        Body::from_stream(futures::stream::iter(frames))
    }

    #[tokio::test]
    async fn a_chunked_body_is_read_whole_up_to_the_limit_and_streams_on_past_it() {
        match peek_body(chunked(vec![b"ab", b"cd", b""]), 4)
            .await
            .unwrap()
        {
            Peeked::Whole(b) => assert_eq!(&b[..], b"abcd"),
            Peeked::Partial(_) => panic!("a body within the limit is read whole"),
        }
        match peek_body(chunked(vec![b"abc", b"def", b"gh"]), 4)
            .await
            .unwrap()
        {
            Peeked::Partial(rest) => {
                let all = http_body_util::BodyExt::collect(rest).await.unwrap();
                assert_eq!(
                    &all.to_bytes()[..],
                    b"abcdefgh",
                    "nothing lost or reordered"
                );
            }
            Peeked::Whole(_) => panic!("a body past the limit streams"),
        }
    }

    fn head(headers: HeaderMap, grpc: bool, upgrade: bool) -> Head {
        Head {
            method: Method::POST,
            path: "/".into(),
            headers,
            grpc,
            upgrade,
        }
    }

    #[tokio::test]
    async fn small_bodies_are_buffered_and_the_rest_streams() {
        let envd = kiln_proto::envd::ENVD_PORT;
        let mut sized = HeaderMap::new();
        sized.insert(header::CONTENT_LENGTH, HeaderValue::from_static("4"));
        let h = head(sized.clone(), false, false);
        let b = prepare(Body::from("abcd"), &h, 8000).await;
        assert!(matches!(b.unwrap(), Prepared::Buffered(x) if &x[..] == b"abcd"));
        for (grpc, upgrade) in [(true, false), (false, true)] {
            let h = head(sized.clone(), grpc, upgrade);
            let b = prepare(Body::from("abcd"), &h, envd).await.unwrap();
            assert!(
                matches!(b, Prepared::Streamed(_)),
                "grpc {grpc}, upgrade {upgrade}"
            );
        }
        let mut large = HeaderMap::new();
        large.insert(header::CONTENT_LENGTH, HeaderValue::from_static("2097152"));
        let b = prepare(Body::from("x"), &head(large, false, false), envd).await;
        assert!(matches!(b.unwrap(), Prepared::Streamed(_)));
        // Chunked: read to tell for the agent, streamed at once elsewhere (unless empty).
        let none = || head(HeaderMap::new(), false, false);
        let b = prepare(chunked(vec![b"ab", b"cd"]), &none(), envd).await;
        assert!(matches!(b.unwrap(), Prepared::Buffered(x) if &x[..] == b"abcd"));
        let b = prepare(chunked(vec![b"ab", b"cd"]), &none(), 8000).await;
        assert!(matches!(b.unwrap(), Prepared::Streamed(_)));
        let b = prepare(Body::empty(), &none(), 8000).await;
        assert!(matches!(b.unwrap(), Prepared::Buffered(x) if x.is_empty()));
    }

    #[test]
    fn grpc_is_http2_with_a_grpc_content_type() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/grpc+proto"),
        );
        assert!(is_grpc(http::Version::HTTP_2, &h, false));
        assert!(!is_grpc(http::Version::HTTP_2, &h, true));
        assert!(!is_grpc(http::Version::HTTP_11, &h, false));
        assert!(!is_grpc(http::Version::HTTP_2, &HeaderMap::new(), false));
    }
}
