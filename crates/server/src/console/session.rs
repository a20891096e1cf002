//! Console sessions: signing in with an API key makes a server-side session (random id in an
//! `HttpOnly`, `SameSite=Strict` cookie scoped to `/console`), which carries the key's
//! [`Caller`] and a CSRF token. A session ends at sign-out, after [`SESSION_TTL`], or as soon
//! as its key is revoked (each request checks the key again).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use http::{header, HeaderMap};

use crate::auth::{hash_key, random_hex};
use crate::store::{now_ms, StateStore, StoreError};
use crate::tenancy::Caller;

/// Name of the session cookie.
pub const COOKIE: &str = "kiln_console";
/// Header carrying the CSRF token on state-changing requests.
pub const CSRF_HEADER: &str = "x-csrf-token";
/// How long a session lasts after sign-in.
pub const SESSION_TTL: Duration = Duration::from_secs(8 * 3600);
/// Most sessions kept at once (expired ones are dropped first; past this, sign-in fails).
const MAX_SESSIONS: usize = 10_000;

/// One signed-in browser.
#[derive(Debug, Clone)]
pub struct Session {
    pub caller: Caller,
    /// Sent back with every state-changing request (header or form field).
    pub csrf: String,
    /// The SHA-256 of the key signed in with (to notice a revocation).
    key_hash: String,
    expires_ms: i64,
}

/// Why a sign-in made no session.
#[derive(Debug, thiserror::Error)]
pub enum SignInError {
    #[error("{0}")]
    Refused(crate::auth::AuthError),
    #[error("too many console sessions are open: try again later")]
    Full,
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// The sessions of one server, in memory (a restart signs everyone out).
#[derive(Debug, Default)]
pub struct Sessions {
    map: Mutex<HashMap<String, Session>>,
}

impl Sessions {
    /// Checks `key` exactly as the API does and opens a session for it; the session id.
    pub async fn sign_in(
        &self,
        store: &dyn StateStore,
        key: &str,
    ) -> Result<(String, Session), SignInError> {
        let caller = match crate::auth::verify(store, Some(key)).await? {
            Ok(c) => c,
            Err(e) => return Err(SignInError::Refused(e)),
        };
        let session = Session {
            caller,
            csrf: random_hex(32),
            key_hash: hash_key(key.trim()),
            expires_ms: now_ms() + SESSION_TTL.as_millis() as i64,
        };
        let id = random_hex(32);
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        let now = now_ms();
        map.retain(|_, s| s.expires_ms > now);
        if map.len() >= MAX_SESSIONS {
            return Err(SignInError::Full);
        }
        map.insert(id.clone(), session.clone());
        Ok((id, session))
    }

    /// The live session named by the request's cookie, if any: not expired, and its key
    /// neither revoked nor deleted (else the session is dropped).
    pub async fn current(&self, store: &dyn StateStore, headers: &HeaderMap) -> Option<Session> {
        let id = cookie_value(headers, COOKIE)?;
        let s = {
            let map = self.map.lock().unwrap_or_else(|p| p.into_inner());
            map.get(&id).cloned()?
        };
        let live = s.expires_ms > now_ms()
            && matches!(
                store.key_by_hash(&s.key_hash).await,
                Ok(Some(k)) if k.revoked_at_ms.is_none()
            );
        if live {
            Some(s)
        } else {
            self.end(headers);
            None
        }
    }

    /// Ends the session named by the request's cookie.
    pub fn end(&self, headers: &HeaderMap) {
        if let Some(id) = cookie_value(headers, COOKIE) {
            let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
            map.remove(&id);
        }
    }

    /// How many sessions are open (expired ones included until the next sign-in).
    pub fn len(&self) -> usize {
        self.map.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The `Set-Cookie` value opening session `id`; `Secure` when the page was served over TLS
/// (the sign-in form's `Origin` is `https://…`).
pub fn set_cookie(id: &str, headers: &HeaderMap) -> String {
    let tls = headers
        .get(header::ORIGIN)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|o| o.starts_with("https://"));
    format!(
        "{COOKIE}={id}; Path=/console; HttpOnly; SameSite=Strict; Max-Age={}{}",
        SESSION_TTL.as_secs(),
        if tls { "; Secure" } else { "" }
    )
}

/// The `Set-Cookie` value removing the session cookie.
pub fn clear_cookie() -> String {
    format!("{COOKIE}=; Path=/console; HttpOnly; SameSite=Strict; Max-Age=0")
}

/// The value of cookie `name` in the request's `Cookie` headers.
pub fn cookie_value(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.to_string())
        .filter(|v| !v.is_empty())
}

/// Compares two tokens in time independent of where they differ.
pub fn same_token(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

/// Whether a request comes from a page of this server: a browser's `Sec-Fetch-Site` says
/// `same-origin` (or `none`, typed by the user), and an `Origin` header names the `Host`.
/// Requests without either header (non-browser clients) pass: they carry no ambient cookie
/// a foreign page could ride on.
pub fn same_origin(headers: &HeaderMap) -> bool {
    let site_ok = headers
        .get("sec-fetch-site")
        .and_then(|v| v.to_str().ok())
        .is_none_or(|v| v == "same-origin" || v == "none");
    let origin_ok = match headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()) {
        None => true,
        Some(o) => {
            let host = headers
                .get(header::HOST)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("");
            let authority = o
                .strip_prefix("http://")
                .or_else(|| o.strip_prefix("https://"))
                .unwrap_or("");
            !host.is_empty() && authority.eq_ignore_ascii_case(host)
        }
    };
    site_ok && origin_ok
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[tokio::test]
    async fn sign_in_checks_the_key_and_revocation_ends_the_session() {
        let store = crate::store::SqliteStore::open_in_memory().unwrap();
        let k = crate::auth::create_team_key(&store, "web", "red")
            .await
            .unwrap();
        let sessions = Sessions::default();
        assert!(matches!(
            sessions.sign_in(&store, "e2b_wrong").await,
            Err(SignInError::Refused(_))
        ));
        let (id, s) = sessions.sign_in(&store, &k.secret).await.unwrap();
        assert_eq!(s.caller.team, "red");
        let h = headers(&[("cookie", &format!("a=b; {COOKIE}={id}"))]);
        assert_eq!(
            sessions.current(&store, &h).await.unwrap().csrf,
            s.csrf,
            "the cookie finds the session"
        );
        assert!(sessions
            .current(&store, &headers(&[("cookie", "kiln_console=nope")]))
            .await
            .is_none());
        store.revoke_key(&k.record.id).await.unwrap();
        assert!(sessions.current(&store, &h).await.is_none());
        assert!(sessions.is_empty(), "a revoked key's session is dropped");
    }

    #[test]
    fn origin_checks() {
        assert!(same_origin(&headers(&[])));
        assert!(same_origin(&headers(&[
            ("host", "127.0.0.1:3000"),
            ("origin", "http://127.0.0.1:3000"),
            ("sec-fetch-site", "same-origin"),
        ])));
        assert!(!same_origin(&headers(&[
            ("host", "127.0.0.1:3000"),
            ("origin", "http://evil.test"),
        ])));
        assert!(!same_origin(&headers(&[("sec-fetch-site", "cross-site")])));
        let tls = headers(&[("origin", "https://kiln.example:3000")]);
        assert!(set_cookie("x", &tls).ends_with("; Secure"));
        assert!(!set_cookie("x", &headers(&[])).contains("Secure"));
        assert!(same_token("abc", "abc") && !same_token("abc", "abd") && !same_token("a", "ab"));
    }
}
