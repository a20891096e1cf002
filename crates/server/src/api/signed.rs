//! Signed file URLs without routing headers: `download_url(...)` / `upload_url(...)` with
//! `E2B_SANDBOX_URL` set give `{sandbox_url}/files?path=…&signature=…`, a URL that names no
//! sandbox. A client without the SDK's `E2b-Sandbox-Id` header (curl, a browser, `urllib`)
//! reaches the sandbox whose envd access token made the signature: the signature covers the
//! path, the operation, the user and the expiry under that token (E2B's v1 scheme), so only
//! that sandbox's token reproduces it.

use axum::response::{IntoResponse, Response};
use base64::Engine;
use http::{Method, StatusCode, Uri};
use serde_json::json;
use sha2::Digest;

use crate::manager::SandboxService;
use crate::routing::Target;
use crate::store::SandboxState;

/// The query of a signed `/files` URL.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct SignedQuery {
    pub path: String,
    pub username: String,
    pub signature: String,
    pub expiration: Option<String>,
}

/// The query of `uri` when it is a signed `/files` request (GET reads, POST writes), with
/// the operation the signature must cover.
pub(crate) fn signed_files_query(
    method: &Method,
    uri: &Uri,
) -> Option<(SignedQuery, &'static str)> {
    if uri.path() != "/files" {
        return None;
    }
    let op = match *method {
        Method::GET => "read",
        Method::POST => "write",
        _ => return None,
    };
    let mut q = SignedQuery::default();
    for (k, v) in form_pairs(uri.query()?) {
        match k.as_str() {
            "path" => q.path = v,
            "username" => q.username = v,
            "signature" => q.signature = v,
            "signature_expiration" => q.expiration = Some(v),
            _ => {}
        }
    }
    (!q.signature.is_empty()).then_some((q, op))
}

/// `k=v` pairs of a query, percent-decoded (`+` is a space, as the SDK's `urlencode` and
/// browsers send it); an undecodable pair keeps its raw bytes.
fn form_pairs(query: &str) -> Vec<(String, String)> {
    let dec = |s: &str| -> String {
        let b = s.as_bytes();
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
    };
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (dec(k), dec(v))
        })
        .collect()
}

/// E2B's v1 file-URL signature: `v1_` and the unpadded base64 of
/// sha256(`path:operation:user:token[:expiration]`).
pub(crate) fn signature(q: &SignedQuery, op: &str, token: &str) -> String {
    let raw = match &q.expiration {
        Some(e) => format!("{}:{op}:{}:{token}:{e}", q.path, q.username),
        None => format!("{}:{op}:{}:{token}", q.path, q.username),
    };
    let digest = sha2::Sha256::digest(raw.as_bytes());
    format!(
        "v1_{}",
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest)
    )
}

/// The 401 answer of a signed request that [`route_signed`] refused.
pub(crate) fn unauthorized(message: &str) -> Response {
    (
        StatusCode::UNAUTHORIZED,
        axum::Json(json!({ "code": 401, "message": message })),
    )
        .into_response()
}

/// The sandbox a signed `/files` request is for, or why it is refused (answered as 401 by
/// [`unauthorized`]): a signature no sandbox's token made, or one past its expiry ("signature
/// is already expired", as envd).
pub(crate) fn route_signed(
    manager: &dyn SandboxService,
    q: &SignedQuery,
    op: &str,
) -> Result<Target, &'static str> {
    let hit = manager
        .list()
        .into_iter()
        .filter(|r| matches!(r.state, SandboxState::Running | SandboxState::Paused))
        .find(|r| {
            r.envd_token.as_deref().is_some_and(|t| {
                crate::proxy::constant_time_eq(
                    signature(q, op, t).as_bytes(),
                    q.signature.as_bytes(),
                )
            })
        });
    let Some(r) = hit else {
        return Err(
            "invalid file URL signature: it was not made by a running sandbox's access token \
             for this path, operation and user",
        );
    };
    if let Some(e) = &q.expiration {
        let exp: i64 = e
            .parse()
            .map_err(|_| "signature_expiration is not a number")?;
        if crate::store::now_ms() / 1000 > exp {
            return Err("signature is already expired");
        }
    }
    Ok(Target {
        sandbox_id: r.id,
        port: kiln_proto::envd::ENVD_PORT,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_signed_queries_only() {
        let uri: Uri = "/files?path=%2Fhome%2Fuser%2Fa%20b.txt&username=user&signature=v1_x\
                        &signature_expiration=17"
            .parse()
            .unwrap();
        let (q, op) = signed_files_query(&Method::GET, &uri).unwrap();
        assert_eq!(op, "read");
        assert_eq!(q.path, "/home/user/a b.txt");
        assert_eq!(q.username, "user");
        assert_eq!(q.expiration.as_deref(), Some("17"));
        let (_, op) = signed_files_query(&Method::POST, &uri).unwrap();
        assert_eq!(op, "write");
        assert!(signed_files_query(&Method::DELETE, &uri).is_none());
        let unsigned: Uri = "/files?path=/a".parse().unwrap();
        assert!(signed_files_query(&Method::GET, &unsigned).is_none());
        let other: Uri = "/sandboxes?signature=v1_x".parse().unwrap();
        assert!(signed_files_query(&Method::GET, &other).is_none());
    }

    #[test]
    fn signature_is_e2bs_v1() {
        // sha256("/a:read::tok"), base64 without padding: computed with Python's hashlib and
        // base64 as the SDK's get_signature does.
        let q = SignedQuery {
            path: "/a".into(),
            ..Default::default()
        };
        assert_eq!(
            signature(&q, "read", "tok"),
            "v1_2/gNbgFPxFSqkheS/SD0NHlzA121E/nxkOtc/ovxeoI"
        );
    }
}
