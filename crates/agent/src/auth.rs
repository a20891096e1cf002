//! Request authentication: the `/init` access token and the HTTP Basic user name.

use http::{header, Request};
use hyper::body::Incoming;
use kiln_proto::connect::Code;

use crate::rpc::RpcError;
use crate::state::Agent;
use crate::users::User;

impl Agent {
    /// The request carries the access token set by `/init` (or none was set).
    pub(crate) fn token_ok(&self, req: &Request<Incoming>) -> bool {
        match &self.init_state().access_token {
            None => true,
            Some(t) => req
                .headers()
                .get("x-access-token")
                .is_some_and(|v| ct_eq(v.as_bytes(), t.as_bytes())),
        }
    }
}

/// Compares two secrets in time that depends only on their lengths (not on where they differ),
/// so a client cannot learn a token or signature byte by byte from response times.
pub fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

/// User named in `Authorization: Basic base64(user:)`.
pub fn basic_user(req: &Request<Incoming>) -> Result<Option<String>, RpcError> {
    let Some(v) = req.headers().get(header::AUTHORIZATION) else {
        return Ok(None);
    };
    let v = v
        .to_str()
        .map_err(|_| RpcError::new(Code::Unauthenticated, "Authorization header is not ASCII"))?;
    let Some(b64) = v
        .strip_prefix("Basic ")
        .or_else(|| v.strip_prefix("basic "))
    else {
        return Err(RpcError::new(
            Code::Unauthenticated,
            "Authorization must be HTTP Basic with the user name (user:)",
        ));
    };
    use base64::Engine;
    let raw = base64::engine::general_purpose::STANDARD
        .decode(b64.trim())
        .map_err(|_| {
            RpcError::new(
                Code::Unauthenticated,
                "Authorization Basic value is not valid base64",
            )
        })?;
    let s = String::from_utf8(raw)
        .map_err(|_| RpcError::new(Code::Unauthenticated, "Authorization user is not UTF-8"))?;
    let user = s.split(':').next().unwrap_or("").to_string();
    Ok(if user.is_empty() { None } else { Some(user) })
}

/// The user a request acts as: its Basic user, else the default user.
pub fn caller(agent: &Agent, req: &Request<Incoming>) -> Result<User, RpcError> {
    let name = basic_user(req)?;
    agent.resolve_user(name.as_deref())
}

#[cfg(test)]
mod tests {
    use super::ct_eq;

    #[test]
    fn ct_eq_is_equality() {
        assert!(ct_eq(b"s3cret", b"s3cret"));
        assert!(ct_eq(b"", b""));
        assert!(!ct_eq(b"s3cret", b"s3creT"));
        assert!(!ct_eq(b"s3cret", b"s3cre"));
        assert!(!ct_eq(b"", b"x"));
        assert!(!ct_eq(b"x3cret", b"s3cret"));
    }
}
