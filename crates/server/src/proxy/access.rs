//! Who may pass: the agent's port takes the envd access token (or a signed file URL, which the
//! agent checks itself); a sandbox's other ports are public unless it was created with
//! `allowPublicTraffic=false`, when they take its traffic access token; `/kiln/…` on the agent's
//! port is the server's private control channel (detach before a checkpoint, forwarding to
//! localhost) and never reachable by clients.

use http::{HeaderMap, Uri};
use kiln_proto::envd::ENVD_PORT;

use crate::manager::Route;

/// Header carrying the envd access token.
pub const ACCESS_TOKEN_HEADER: &str = "x-access-token";
/// Header carrying the traffic access token (ports of `allowPublicTraffic=false` sandboxes).
pub const TRAFFIC_TOKEN_HEADER: &str = "e2b-traffic-access-token";

/// Why a request is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    /// `port` of a sandbox with `allowPublicTraffic=false`, without its traffic access token.
    Private(u16),
    /// The agent's port without the envd access token (or a signature).
    NoEnvdToken,
    /// The server's private control channel on the agent's port (the path).
    Internal(String),
}

/// Whether a request to `port` of the sandbox of `route`, with `headers` and `uri`, may pass.
pub fn check(route: &Route, port: u16, headers: &HeaderMap, uri: &Uri) -> Result<(), Refused> {
    if port != ENVD_PORT {
        let Some(token) = &route.ingress.traffic_token else {
            return Ok(());
        };
        let ok = headers
            .get(TRAFFIC_TOKEN_HEADER)
            .is_some_and(|v| constant_time_eq(v.as_bytes(), token.as_bytes()));
        return if ok {
            Ok(())
        } else {
            Err(Refused::Private(port))
        };
    }
    if let Some(token) = &route.envd_token {
        let presented = headers
            .get(ACCESS_TOKEN_HEADER)
            .and_then(|v| v.to_str().ok());
        let ok = match presented {
            Some(p) => constant_time_eq(p.as_bytes(), token.as_bytes()),
            None => has_signature(uri),
        };
        if !ok {
            return Err(Refused::NoEnvdToken);
        }
    }
    if uri.path().starts_with("/kiln/") {
        return Err(Refused::Internal(uri.path().to_string()));
    }
    Ok(())
}

/// Whether the request carries a file-URL signature (checked by the agent itself).
fn has_signature(uri: &Uri) -> bool {
    uri.query()
        .map(|q| q.split('&').any(|kv| kv.starts_with("signature=")))
        .unwrap_or(false)
}

/// Equality of two secrets in time that does not depend on where they differ.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Ingress;
    use http::HeaderValue;

    fn route(envd: Option<&str>, traffic: Option<&str>) -> Route {
        Route {
            sandbox_id: "sbx".into(),
            envd_token: envd.map(str::to_string),
            ingress: Ingress {
                traffic_token: traffic.map(str::to_string),
                mask_request_host: None,
            },
        }
    }

    fn status(r: Result<(), Refused>) -> Option<Refused> {
        r.err()
    }

    #[test]
    fn the_agents_port_takes_its_token_or_a_signature() {
        let r = route(Some("envd"), Some("traffic"));
        let mut h = HeaderMap::new();
        let plain: Uri = "/files?path=a".parse().unwrap();
        let signed: Uri = "/files?path=a&signature=v1_x".parse().unwrap();
        let unauthorized = Some(Refused::NoEnvdToken);
        assert_eq!(status(check(&r, ENVD_PORT, &h, &plain)), unauthorized);
        assert_eq!(status(check(&r, ENVD_PORT, &h, &signed)), None);
        h.insert(ACCESS_TOKEN_HEADER, HeaderValue::from_static("envx"));
        assert_eq!(status(check(&r, ENVD_PORT, &h, &signed)), unauthorized);
        h.insert(ACCESS_TOKEN_HEADER, HeaderValue::from_static("envd"));
        assert_eq!(status(check(&r, ENVD_PORT, &h, &plain)), None);
        // The traffic token opens the other ports only.
        let mut t = HeaderMap::new();
        t.insert(TRAFFIC_TOKEN_HEADER, HeaderValue::from_static("traffic"));
        assert_eq!(status(check(&r, ENVD_PORT, &t, &plain)), unauthorized);
        // An insecure sandbox's agent needs no token.
        let open = route(None, None);
        assert_eq!(
            status(check(&open, ENVD_PORT, &HeaderMap::new(), &plain)),
            None
        );
    }

    #[test]
    fn private_ports_take_the_traffic_token_and_kiln_paths_stay_closed() {
        let private = route(Some("envd"), Some("traffic"));
        let uri: Uri = "/".parse().unwrap();
        let mut h = HeaderMap::new();
        assert_eq!(
            status(check(&private, 8000, &h, &uri)),
            Some(Refused::Private(8000))
        );
        h.insert(ACCESS_TOKEN_HEADER, HeaderValue::from_static("envd"));
        assert_eq!(
            status(check(&private, 8000, &h, &uri)),
            Some(Refused::Private(8000)),
            "the envd token is not the traffic token"
        );
        h.insert(TRAFFIC_TOKEN_HEADER, HeaderValue::from_static("traffic"));
        assert_eq!(status(check(&private, 8000, &h, &uri)), None);
        let public = route(Some("envd"), None);
        assert_eq!(status(check(&public, 8000, &HeaderMap::new(), &uri)), None);
        let kiln: Uri = "/kiln/detach".parse().unwrap();
        assert_eq!(
            status(check(&public, ENVD_PORT, &h, &kiln)),
            Some(Refused::Internal("/kiln/detach".into()))
        );
        assert_eq!(
            status(check(&route(None, None), ENVD_PORT, &h, &kiln)),
            Some(Refused::Internal("/kiln/detach".into()))
        );
        // Another port's `/kiln/` is the sandbox's own.
        assert_eq!(status(check(&public, 8000, &h, &kiln)), None);
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
    }
}
