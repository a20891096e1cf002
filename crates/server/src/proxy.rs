//! The sandbox proxy: forwards sandbox-addressed requests to a port inside the sandbox through
//! the driver's [`connect`](crate::driver::Driver::connect), streaming bodies both ways and
//! passing WebSocket/HTTP upgrades through.

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use http::{header, HeaderMap, HeaderName, HeaderValue, Request, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::json;

use crate::manager::Manager;
use crate::routing::{Target, SANDBOX_ID_HEADER, SANDBOX_PORT_HEADER};

/// Request bodies up to this size are buffered (and retried once on a connection failure).
const SMALL_BODY: u64 = 1 << 20;

/// Header carrying the envd access token.
pub const ACCESS_TOKEN_HEADER: &str = "x-access-token";
/// Header carrying the traffic access token (ports of `allowPublicTraffic=false` sandboxes).
pub const TRAFFIC_TOKEN_HEADER: &str = "e2b-traffic-access-token";

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

/// The answer when the client's request body cannot be read.
fn body_error(id: &str, e: axum::Error) -> Response {
    proxy_error(
        StatusCode::BAD_REQUEST,
        id,
        format!("reading the request body: {e}"),
    )
}

/// The answer when sandbox `id` takes no traffic.
fn no_route(id: &str, why: crate::manager::NoRoute) -> Response {
    use crate::manager::NoRoute;
    match why {
        NoRoute::WakeFailed => proxy_error(
            StatusCode::SERVICE_UNAVAILABLE,
            id,
            format!("The sandbox {id} could not be woken from standby; retry"),
        ),
        NoRoute::Paused => proxy_error(
            StatusCode::BAD_GATEWAY,
            id,
            format!("The sandbox {id} is paused: connect to it to resume it"),
        ),
        NoRoute::NotFound => proxy_error(
            StatusCode::BAD_GATEWAY,
            id,
            format!("The sandbox {id} was not found: it does not exist, was killed or timed out"),
        ),
    }
}

fn proxy_error(status: StatusCode, sandbox_id: &str, message: String) -> Response {
    (
        status,
        axum::Json(json!({
            "code": status.as_u16(),
            "message": message,
            "sandboxId": sandbox_id,
        })),
    )
        .into_response()
}

const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

fn strip_hop_by_hop(h: &mut HeaderMap) {
    // Headers named in Connection are hop-by-hop too.
    let named: Vec<HeaderName> = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for n in named {
        h.remove(n);
    }
    for n in HOP_BY_HOP {
        h.remove(*n);
    }
}

fn wants_upgrade(h: &HeaderMap) -> Option<HeaderValue> {
    let conn_upgrade = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| {
            v.split(',')
                .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
        });
    if conn_upgrade {
        h.get(header::UPGRADE).cloned()
    } else {
        None
    }
}

/// Whether the request carries a file-URL signature (checked by the agent itself).
fn has_signature(uri: &http::Uri) -> bool {
    uri.query()
        .map(|q| q.split('&').any(|kv| kv.starts_with("signature=")))
        .unwrap_or(false)
}

/// Forwards `req` to `target`.
pub async fn forward(manager: &Manager, target: Target, mut req: Request<Body>) -> Response {
    let id = target.sandbox_id.as_str();
    let crate::manager::PortRoute {
        route,
        client,
        in_use,
        audit,
    } = match manager.open_route(id, target.port).await {
        Ok(r) => r,
        Err(why) => return no_route(id, why),
    };
    // The envd access token guards the agent's port; a sandbox's other ports are public
    // (E2B's default, allowPublicTraffic=true).
    let envd_token = match target.port {
        kiln_proto::envd::ENVD_PORT => route.envd_token.as_ref(),
        _ => None,
    };
    let mut host = HeaderValue::from_static("localhost");
    if target.port != kiln_proto::envd::ENVD_PORT {
        if let Some(v) = route
            .ingress
            .masked_host(target.port)
            .and_then(|h| HeaderValue::from_str(&h).ok())
        {
            host = v;
        }
        if let Some(token) = &route.ingress.traffic_token {
            let ok = req
                .headers()
                .get(TRAFFIC_TOKEN_HEADER)
                .is_some_and(|v| constant_time_eq(v.as_bytes(), token.as_bytes()));
            if !ok {
                return proxy_error(
                    StatusCode::FORBIDDEN,
                    id,
                    format!(
                        "port {} of this sandbox is private: send its traffic access token \
                         in the e2b-traffic-access-token header",
                        target.port
                    ),
                );
            }
        }
    }
    if let Some(token) = envd_token {
        let presented = req
            .headers()
            .get(ACCESS_TOKEN_HEADER)
            .and_then(|v| v.to_str().ok());
        let ok = match presented {
            Some(p) => constant_time_eq(p.as_bytes(), token.as_bytes()),
            None => has_signature(req.uri()),
        };
        if !ok {
            return proxy_error(
                StatusCode::UNAUTHORIZED,
                id,
                "missing or invalid envd access token (X-Access-Token)".into(),
            );
        }
    }

    // `/kiln/…` on the agent's port is the server's private control channel (detach before a
    // checkpoint, forwarding to localhost): never reachable by clients.
    if target.port == kiln_proto::envd::ENVD_PORT && req.uri().path().starts_with("/kiln/") {
        return proxy_error(
            StatusCode::NOT_FOUND,
            id,
            format!("no route for {}", req.uri().path()),
        );
    }
    let upgrade = wants_upgrade(req.headers());
    let client_upgrade = upgrade.as_ref().map(|_| hyper::upgrade::on(&mut req));

    let scheme = match req.extensions().get::<crate::edge::Https>() {
        Some(_) => "https",
        None => "http",
    };
    let (parts, body) = req.into_parts();
    // gRPC (HTTP/2 only, trailers) reaches the sandbox's server over HTTP/2 as well (h2c with
    // prior knowledge); everything else goes as HTTP/1.1, whatever the client spoke.
    let grpc = parts.version == http::Version::HTTP_2
        && upgrade.is_none()
        && parts
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|c| c.starts_with("application/grpc"));
    let mut headers = parts.headers;
    strip_hop_by_hop(&mut headers);
    // The host the client addressed, for services that name themselves in their answers (the
    // DevTools front of the browser templates rewrites its WebSocket URLs to it). Always ours:
    // a client's own X-Forwarded-* never reaches the sandbox.
    let original_host = crate::routing::request_host(&headers, &parts.uri)
        .and_then(|h| HeaderValue::from_str(h).ok());
    headers.remove("x-forwarded-host");
    headers.remove("x-forwarded-proto");
    if let Some(h) = original_host {
        headers.insert("x-forwarded-host", h);
        headers.insert("x-forwarded-proto", HeaderValue::from_static(scheme));
    }
    headers.remove(TRAFFIC_TOKEN_HEADER);
    headers.remove(SANDBOX_ID_HEADER);
    headers.remove(SANDBOX_PORT_HEADER);
    headers.insert(header::HOST, host);
    if let Some(u) = &upgrade {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        headers.insert(header::UPGRADE, u.clone());
    }
    let path = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/")
        .to_string();
    let method = parts.method;
    // Operations on the agent's port go on the sandbox's audit record.
    let mut tap = match target.port {
        kiln_proto::envd::ENVD_PORT if upgrade.is_none() => {
            crate::audit::tap::Tap::begin(&audit, id, &method, &parts.uri, &headers)
        }
        _ => None,
    };
    let build = |body: Body| -> Result<Request<Body>, http::Error> {
        let mut r = Request::builder()
            .method(method.clone())
            .uri(path.as_str())
            .version(http::Version::HTTP_11)
            .body(body)?;
        *r.headers_mut() = headers.clone();
        Ok(r)
    };
    // Small bodies (every Connect request, small uploads) are buffered so that a connection
    // that fails before the agent answers can be retried once; large ones stream through. A
    // chunked body to the agent (the JS SDK sends every upload so) is read up to the same
    // size to tell; one to another port streams at once (its client may wait for an answer).
    let mut body = body;
    let mut buffered = None;
    if upgrade.is_none() && !grpc {
        match headers.get(header::CONTENT_LENGTH) {
            Some(v) => {
                let small = v
                    .to_str()
                    .ok()
                    .and_then(|s| s.parse::<u64>().ok())
                    .is_some_and(|n| n <= SMALL_BODY);
                if small {
                    match http_body_util::BodyExt::collect(body).await {
                        Ok(c) => buffered = Some(c.to_bytes()),
                        Err(e) => return body_error(id, e),
                    }
                    body = Body::empty();
                }
            }
            None if target.port != kiln_proto::envd::ENVD_PORT => {
                if http_body::Body::is_end_stream(&body) {
                    buffered = Some(bytes::Bytes::new());
                }
            }
            None => match peek_body(body, SMALL_BODY).await {
                Ok(Peeked::Whole(bytes)) => {
                    buffered = Some(bytes);
                    body = Body::empty();
                }
                Ok(Peeked::Partial(rest)) => body = rest,
                Err(e) => return body_error(id, e),
            },
        }
    }
    let sent = if grpc {
        let body = match tap.as_mut() {
            Some(t) => t.wrap_request(body),
            None => body,
        };
        let mut h2_headers = headers.clone();
        h2_headers.remove(header::HOST);
        h2_headers.insert(header::TE, HeaderValue::from_static("trailers"));
        let req = Request::builder()
            .method(method.clone())
            .uri(format!("http://localhost{path}"))
            .version(http::Version::HTTP_2)
            .body(body);
        match req {
            Ok(mut r) => {
                *r.headers_mut() = h2_headers;
                client.send_h2(r).await
            }
            Err(e) => return proxy_error(StatusCode::BAD_REQUEST, id, format!("bad request: {e}")),
        }
    } else if let Some(bytes) = buffered {
        if let Some(t) = tap.as_mut() {
            t.request(&bytes);
        }
        let mut attempt = 0;
        loop {
            let req = match build(Body::from(bytes.clone())) {
                Ok(r) => r,
                Err(e) => {
                    return proxy_error(StatusCode::BAD_REQUEST, id, format!("bad request: {e}"))
                }
            };
            match client.send(req).await {
                Ok(r) => break Ok(r),
                Err(e) if attempt == 0 => {
                    tracing::debug!(sandbox = id, error = %e, "retrying a request to the agent");
                    attempt += 1;
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                }
                Err(e) => break Err(e),
            }
        }
    } else {
        let body = match tap.as_mut() {
            Some(t) => t.wrap_request(body),
            None => body,
        };
        match build(body) {
            Ok(req) => client.send(req).await,
            Err(e) => return proxy_error(StatusCode::BAD_REQUEST, id, format!("bad request: {e}")),
        }
    };
    let mut resp = match sent {
        Ok(r) => r,
        Err(e) => {
            return proxy_error(
                StatusCode::BAD_GATEWAY,
                id,
                format!("cannot reach port {} of sandbox {id}: {e}", target.port),
            );
        }
    };

    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        if let Some(client_upgrade) = client_upgrade {
            let agent_upgrade = hyper::upgrade::on(&mut resp);
            tokio::spawn(async move {
                let _in_use = in_use;
                match tokio::try_join!(client_upgrade, agent_upgrade) {
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
        return Response::from_parts(parts, Body::empty());
    }

    let (mut parts, body) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    let resp = Response::from_parts(parts, held_body(body, in_use));
    match tap {
        Some(t) => t.response(resp).await,
        None => resp,
    }
}

/// `body` as the client's answer, keeping `guard` until it ends or is dropped (frames and
/// trailers pass unchanged).
fn held_body<B, G>(body: B, guard: G) -> Body
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

/// Equality of two secrets in time that does not depend on where they differ.
pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_are_removed() {
        let mut h = HeaderMap::new();
        h.insert("connection", HeaderValue::from_static("keep-alive, x-foo"));
        h.insert("x-foo", HeaderValue::from_static("1"));
        h.insert("transfer-encoding", HeaderValue::from_static("chunked"));
        h.insert("content-type", HeaderValue::from_static("application/json"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key("content-type"));
    }

    #[test]
    fn upgrade_detection_and_signature() {
        let mut h = HeaderMap::new();
        h.insert("upgrade", HeaderValue::from_static("websocket"));
        assert!(wants_upgrade(&h).is_none());
        h.insert(
            "connection",
            HeaderValue::from_static("keep-alive, Upgrade"),
        );
        assert_eq!(wants_upgrade(&h).unwrap(), "websocket");
        assert!(has_signature(
            &"/files?path=a&signature=v1_x".parse().unwrap()
        ));
        assert!(!has_signature(&"/files?path=a".parse().unwrap()));
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
    }

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
}
