//! Deciding whether a request is for the API or for a sandbox (the envd proxy).
//!
//! The e2b SDK addresses a sandbox either with the `E2b-Sandbox-Id` / `E2b-Sandbox-Port` headers
//! (always sent; the only way when `E2B_SANDBOX_URL` points all sandbox traffic at one URL), or
//! with a host name `{port}-{sandboxID}.{domain}`.

use http::HeaderMap;

pub const SANDBOX_ID_HEADER: &str = "e2b-sandbox-id";
pub const SANDBOX_PORT_HEADER: &str = "e2b-sandbox-port";

/// A sandbox port a request is addressed to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub sandbox_id: String,
    pub port: u16,
}

/// Why a request that looks sandbox-addressed cannot be routed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    #[error("invalid E2b-Sandbox-Port header {0:?}: expected a port number 1-65535")]
    BadPort(String),
    #[error("E2b-Sandbox-Port given without E2b-Sandbox-Id")]
    MissingId,
    #[error("invalid sandbox id {0:?}")]
    BadId(String),
}

fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

fn parse_port(s: &str) -> Option<u16> {
    s.trim().parse::<u16>().ok().filter(|p| *p != 0)
}

/// Parses `{port}-{sandboxID}.{domain}` (an optional `:port` suffix of the host is ignored).
/// Returns None when `host` is not under `domain` or not of that form.
pub fn parse_host(host: &str, domain: &str) -> Option<Target> {
    let host = host.trim().trim_end_matches('.');
    let host = match host.rsplit_once(':') {
        Some((h, p)) if p.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => host,
    };
    let domain = domain.trim().trim_matches('.');
    if domain.is_empty() {
        return None;
    }
    let label = host
        .to_ascii_lowercase()
        .strip_suffix(&format!(".{}", domain.to_ascii_lowercase()))?
        .to_string();
    if label.contains('.') {
        return None;
    }
    let (port, id) = label.split_once('-')?;
    let port = parse_port(port)?;
    if !valid_id(id) {
        return None;
    }
    Some(Target {
        sandbox_id: id.to_string(),
        port,
    })
}

/// The host a request addressed: its Host header, else (HTTP/2, whose `:authority` hyper puts
/// in the URI) the URI's authority.
pub fn request_host<'a>(headers: &'a HeaderMap, uri: &'a http::Uri) -> Option<&'a str> {
    headers
        .get(http::header::HOST)
        .and_then(|h| h.to_str().ok())
        .or_else(|| uri.authority().map(|a| a.as_str()))
}

/// The sandbox target of a request, from its headers first, then the host it addressed (see
/// [`request_host`]). `Ok(None)`: an ordinary API request.
pub fn target_of_request(
    headers: &HeaderMap,
    uri: &http::Uri,
    domain: &str,
) -> Result<Option<Target>, RouteError> {
    match target_of(headers, domain)? {
        None if !headers.contains_key(http::header::HOST) => {
            Ok(uri.authority().and_then(|a| parse_host(a.as_str(), domain)))
        }
        t => Ok(t),
    }
}

/// The sandbox target of a request, from its headers first, then its Host.
/// `Ok(None)`: an ordinary API request.
pub fn target_of(headers: &HeaderMap, domain: &str) -> Result<Option<Target>, RouteError> {
    let hdr = |name: &str| {
        headers
            .get(name)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).trim().to_string())
    };
    let id = hdr(SANDBOX_ID_HEADER).filter(|s| !s.is_empty());
    let port = hdr(SANDBOX_PORT_HEADER).filter(|s| !s.is_empty());
    match (id, port) {
        (Some(id), port) => {
            if !valid_id(&id) {
                return Err(RouteError::BadId(id));
            }
            let port = match port {
                None => kiln_proto::envd::ENVD_PORT,
                Some(p) => parse_port(&p).ok_or(RouteError::BadPort(p))?,
            };
            Ok(Some(Target {
                sandbox_id: id,
                port,
            }))
        }
        (None, Some(_)) => Err(RouteError::MissingId),
        (None, None) => {
            let host = headers
                .get(http::header::HOST)
                .and_then(|h| h.to_str().ok())
                .unwrap_or("");
            Ok(parse_host(host, domain))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn t(id: &str, port: u16) -> Option<Target> {
        Some(Target {
            sandbox_id: id.into(),
            port,
        })
    }

    #[test]
    fn host_form() {
        assert_eq!(
            parse_host("49983-abc123.kiln.local", "kiln.local"),
            t("abc123", 49983)
        );
        assert_eq!(
            parse_host("8080-abc.kiln.local:3000", "kiln.local"),
            t("abc", 8080)
        );
        assert_eq!(
            parse_host("8080-ABC.Kiln.Local.", "kiln.local"),
            t("abc", 8080)
        );
        assert_eq!(parse_host("8080-abc.other.dev", "kiln.local"), None);
        assert_eq!(parse_host("kiln.local", "kiln.local"), None);
        assert_eq!(parse_host("abc.kiln.local", "kiln.local"), None);
        assert_eq!(parse_host("x-abc.kiln.local", "kiln.local"), None);
        assert_eq!(parse_host("0-abc.kiln.local", "kiln.local"), None);
        assert_eq!(parse_host("99999-abc.kiln.local", "kiln.local"), None);
        assert_eq!(parse_host("80-a.b.kiln.local", "kiln.local"), None);
        assert_eq!(parse_host("80-.kiln.local", "kiln.local"), None);
        assert_eq!(parse_host("127.0.0.1:3000", "kiln.local"), None);
        assert_eq!(parse_host("80-abc.kiln.local", ""), None);
    }

    #[test]
    fn headers_win_over_host() {
        let mut h = HeaderMap::new();
        h.insert("host", HeaderValue::from_static("8080-zzz.kiln.local"));
        assert_eq!(target_of(&h, "kiln.local").unwrap(), t("zzz", 8080));
        h.insert("E2b-Sandbox-Id", HeaderValue::from_static("abc"));
        h.insert("E2b-Sandbox-Port", HeaderValue::from_static("49983"));
        assert_eq!(target_of(&h, "kiln.local").unwrap(), t("abc", 49983));
        h.remove("E2b-Sandbox-Port");
        assert_eq!(target_of(&h, "kiln.local").unwrap(), t("abc", 49983));
    }

    #[test]
    fn http2_authority_counts_when_there_is_no_host_header() {
        let uri: http::Uri = "https://8080-abc.kiln.local/x".parse().unwrap();
        let h = HeaderMap::new();
        assert_eq!(
            target_of_request(&h, &uri, "kiln.local").unwrap(),
            t("abc", 8080)
        );
        assert_eq!(request_host(&h, &uri), Some("8080-abc.kiln.local"));
        let mut h = HeaderMap::new();
        h.insert("host", HeaderValue::from_static("api.kiln.local"));
        assert_eq!(target_of_request(&h, &uri, "kiln.local").unwrap(), None);
        assert_eq!(request_host(&h, &uri), Some("api.kiln.local"));
    }

    #[test]
    fn api_requests_and_bad_headers() {
        let mut h = HeaderMap::new();
        h.insert("host", HeaderValue::from_static("127.0.0.1:3000"));
        assert_eq!(target_of(&h, "kiln.local").unwrap(), None);
        h.insert("E2b-Sandbox-Port", HeaderValue::from_static("80"));
        assert_eq!(target_of(&h, "kiln.local"), Err(RouteError::MissingId));
        h.insert("E2b-Sandbox-Id", HeaderValue::from_static("abc"));
        h.insert("E2b-Sandbox-Port", HeaderValue::from_static("http"));
        assert!(matches!(
            target_of(&h, "kiln.local"),
            Err(RouteError::BadPort(_))
        ));
        h.insert("E2b-Sandbox-Id", HeaderValue::from_static("../etc"));
        assert!(matches!(
            target_of(&h, "kiln.local"),
            Err(RouteError::BadId(_))
        ));
    }
}
