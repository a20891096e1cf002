//! The headers each side sees: hop-by-hop headers stay on their hop; the sandbox gets the
//! `Host` the sandbox's ingress settings name (`maskRequestHost`) or `localhost`, the host and
//! scheme the client addressed as `X-Forwarded-*` (never the client's own), and none of the
//! proxy's routing and token headers.

use http::{header, HeaderMap, HeaderName, HeaderValue, Uri};

use super::access::TRAFFIC_TOKEN_HEADER;
use crate::routing::{SANDBOX_ID_HEADER, SANDBOX_PORT_HEADER};
use crate::store::Ingress;

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

/// Removes the hop-by-hop headers, those named in `Connection` included.
pub fn strip_hop_by_hop(h: &mut HeaderMap) {
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

/// The protocol a request asks to upgrade to (`Connection: upgrade` with `Upgrade`).
pub fn wants_upgrade(h: &HeaderMap) -> Option<HeaderValue> {
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

/// What the request that reaches a sandbox carries besides the client's own headers.
pub struct Outgoing<'a> {
    /// The sandbox port the request goes to.
    pub port: u16,
    pub ingress: &'a Ingress,
    /// `https` when the client came over TLS.
    pub scheme: &'static str,
    /// The protocol the client upgrades to, passed on.
    pub upgrade: Option<&'a HeaderValue>,
}

/// The client's `headers` (with its request `uri`) as the sandbox sees them.
pub fn request_headers(mut headers: HeaderMap, uri: &Uri, out: &Outgoing<'_>) -> HeaderMap {
    strip_hop_by_hop(&mut headers);
    // The host the client addressed, for services that name themselves in their answers (the
    // DevTools front of the browser templates rewrites its WebSocket URLs to it). Always ours:
    // a client's own X-Forwarded-* never reaches the sandbox.
    let original_host =
        crate::routing::request_host(&headers, uri).and_then(|h| HeaderValue::from_str(h).ok());
    headers.remove("x-forwarded-host");
    headers.remove("x-forwarded-proto");
    if let Some(h) = original_host {
        headers.insert("x-forwarded-host", h);
        headers.insert("x-forwarded-proto", HeaderValue::from_static(out.scheme));
    }
    headers.remove(TRAFFIC_TOKEN_HEADER);
    headers.remove(SANDBOX_ID_HEADER);
    headers.remove(SANDBOX_PORT_HEADER);
    headers.insert(header::HOST, host_for(out.ingress, out.port));
    if let Some(u) = out.upgrade {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        headers.insert(header::UPGRADE, u.clone());
    }
    headers
}

/// The `Host` of a request to `port`: the sandbox's mask on ports other than the agent's,
/// else `localhost`.
fn host_for(ingress: &Ingress, port: u16) -> HeaderValue {
    let masked = match port {
        kiln_proto::envd::ENVD_PORT => None,
        p => ingress.masked_host(p),
    };
    masked
        .and_then(|h| HeaderValue::from_str(&h).ok())
        .unwrap_or_else(|| HeaderValue::from_static("localhost"))
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
    fn upgrade_detection() {
        let mut h = HeaderMap::new();
        h.insert("upgrade", HeaderValue::from_static("websocket"));
        assert!(wants_upgrade(&h).is_none());
        h.insert(
            "connection",
            HeaderValue::from_static("keep-alive, Upgrade"),
        );
        assert_eq!(wants_upgrade(&h).unwrap(), "websocket");
    }

    #[test]
    fn the_sandbox_sees_the_mask_and_forwarded_host_but_no_routing_headers() {
        let masked = Ingress {
            traffic_token: Some("t".into()),
            mask_request_host: Some("app.internal:${PORT}".into()),
        };
        let mut h = HeaderMap::new();
        h.insert("host", HeaderValue::from_static("8000-sbx.kiln.test"));
        h.insert("x-forwarded-host", HeaderValue::from_static("evil"));
        h.insert(TRAFFIC_TOKEN_HEADER, HeaderValue::from_static("t"));
        h.insert(SANDBOX_ID_HEADER, HeaderValue::from_static("sbx"));
        h.insert("connection", HeaderValue::from_static("upgrade"));
        h.insert("upgrade", HeaderValue::from_static("websocket"));
        let ws = HeaderValue::from_static("websocket");
        let out = Outgoing {
            port: 8000,
            ingress: &masked,
            scheme: "https",
            upgrade: Some(&ws),
        };
        let got = request_headers(h.clone(), &"/".parse().unwrap(), &out);
        assert_eq!(got["host"], "app.internal:8000");
        assert_eq!(got["x-forwarded-host"], "8000-sbx.kiln.test");
        assert_eq!(got["x-forwarded-proto"], "https");
        assert_eq!(
            (got["connection"].as_bytes(), got["upgrade"].as_bytes()),
            (&b"upgrade"[..], &b"websocket"[..])
        );
        assert!(!got.contains_key(TRAFFIC_TOKEN_HEADER) && !got.contains_key(SANDBOX_ID_HEADER));
        // The agent's port is never masked; no upgrade asked, none passed on.
        let out = Outgoing {
            port: kiln_proto::envd::ENVD_PORT,
            upgrade: None,
            ..out
        };
        let got = request_headers(h, &"/".parse().unwrap(), &out);
        assert_eq!(got["host"], "localhost");
        assert!(!got.contains_key("upgrade") && !got.contains_key("connection"));
        assert_eq!(host_for(&Ingress::default(), 8000), "localhost");
    }
}
