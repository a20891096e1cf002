//! Console sessions: signing in with an API key makes a server-side session (random id in an
//! `HttpOnly`, `SameSite=Strict` cookie scoped to `/console`), which carries the key's
//! [`Caller`] and a CSRF token. Sessions are kept hashed in a [`SessionStore`] (`kiln serve`'s
//! state database, so they survive a restart; etcd on a cluster, so every control replica
//! knows them). A session ends at sign-out, after [`SESSION_TTL`], or as soon as its key is
//! revoked (each request checks the key again).

use std::sync::Arc;
use std::time::Duration;

use http::{header, HeaderMap};
use sha2::{Digest, Sha256};

use super::store::SessionStore;
use crate::auth::{hash_key, random_hex};
use crate::store::{now_ms, AccessStore, ConsoleDb, SessionRow, StoreError};
use crate::tenancy::Caller;

/// Name of the session cookie.
pub const COOKIE: &str = "kiln_console";
/// Header carrying the CSRF token on state-changing requests.
pub const CSRF_HEADER: &str = "x-csrf-token";
/// How long a session lasts after sign-in.
pub const SESSION_TTL: Duration = Duration::from_secs(8 * 3600);
/// Most sessions kept at once (ended ones are dropped first; past this, sign-in fails).
const MAX_SESSIONS: usize = 10_000;

/// One signed-in browser.
#[derive(Debug, Clone)]
pub struct Session {
    pub caller: Caller,
    /// Sent back with every state-changing request (header or form field).
    pub csrf: String,
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

/// The SHA-256 (hex) of a session id: what the database keeps of it.
fn id_hash(id: &str) -> String {
    hex::encode(Sha256::digest(id.as_bytes()))
}

/// A session's CSRF token, derived from its id (so nothing more is stored, and the token
/// outlives a restart with its session); the token does not give the id away.
fn csrf_of(id: &str) -> String {
    let mut h = Sha256::new();
    h.update(b"kiln-console-csrf\0");
    h.update(id.as_bytes());
    hex::encode(h.finalize())
}

/// The sessions of one server (or of every replica of a cluster).
pub struct Sessions {
    db: Arc<dyn SessionStore>,
}

impl std::fmt::Debug for Sessions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Sessions")
    }
}

impl Sessions {
    /// Sessions kept in `db`.
    pub fn new(db: Arc<dyn SessionStore>) -> Self {
        Self { db }
    }

    /// Sessions kept in memory only (they end with the process).
    pub fn in_memory() -> Result<Self, StoreError> {
        Ok(Self::new(Arc::new(ConsoleDb::open_in_memory()?)))
    }

    /// Checks `key` exactly as the API does and opens a session for it; the session id.
    pub async fn sign_in(
        &self,
        store: &dyn AccessStore,
        key: &str,
    ) -> Result<(String, Session), SignInError> {
        let caller = match crate::auth::verify(store, Some(key)).await? {
            Ok(c) => c,
            Err(e) => return Err(SignInError::Refused(e)),
        };
        let id = random_hex(32);
        let now = now_ms();
        let row = SessionRow {
            id_hash: id_hash(&id),
            key_hash: hash_key(key.trim()),
            created_at_ms: now,
            expires_at_ms: now + SESSION_TTL.as_millis() as i64,
        };
        if !self.db.create(row, now, MAX_SESSIONS).await? {
            return Err(SignInError::Full);
        }
        let csrf = csrf_of(&id);
        Ok((id, Session { caller, csrf }))
    }

    /// The live session named by the request's cookie, if any: not expired, and its key
    /// neither revoked nor deleted (else the session is dropped).
    pub async fn current(&self, store: &dyn AccessStore, headers: &HeaderMap) -> Option<Session> {
        let id = cookie_value(headers, COOKIE)?;
        // An ended session is not found (and swept at the next sign-in).
        let row = match self.db.get(&id_hash(&id), now_ms()).await {
            Ok(r) => r?,
            Err(e) => {
                tracing::warn!(error = %e, "reading a console session");
                return None;
            }
        };
        let key = match store.key_by_hash(&row.key_hash).await {
            Ok(Some(k)) if k.revoked_at_ms.is_none() => Some(k),
            Ok(_) => None,
            Err(e) => {
                // The key could not be checked: no access now, but the session stays.
                tracing::warn!(error = %e, "checking a console session's key");
                return None;
            }
        };
        match key {
            Some(k) => Some(Session {
                caller: Caller {
                    key_id: k.id,
                    team: k.team,
                },
                csrf: csrf_of(&id),
            }),
            None => {
                self.end(headers).await;
                None
            }
        }
    }

    /// Ends the session named by the request's cookie.
    pub async fn end(&self, headers: &HeaderMap) {
        if let Some(id) = cookie_value(headers, COOKIE) {
            if let Err(e) = self.db.delete(&id_hash(&id)).await {
                tracing::warn!(error = %e, "ending a console session");
            }
        }
    }

    /// How many sessions are stored (ended ones included until the next sign-in).
    pub async fn count(&self) -> usize {
        self.db.count().await.unwrap_or(0)
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
        let sessions = Sessions::in_memory().unwrap();
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
        assert_eq!(
            sessions.count().await,
            0,
            "a revoked key's session is dropped"
        );
    }

    #[tokio::test]
    async fn a_session_outlives_the_server_that_opened_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kiln.db");
        let store = crate::store::SqliteStore::open(&path).unwrap();
        let k = crate::auth::create_team_key(&store, "web", "blue")
            .await
            .unwrap();
        let first = Sessions::new(Arc::new(ConsoleDb::open(&path).unwrap()));
        let (id, s) = first.sign_in(&store, &k.secret).await.unwrap();
        drop(first);
        // Only hashes are on disk.
        let mut raw = std::fs::read(&path).unwrap();
        raw.extend(std::fs::read(dir.path().join("kiln.db-wal")).unwrap_or_default());
        let on_disk = |needle: &str| raw.windows(needle.len()).any(|w| w == needle.as_bytes());
        assert!(!on_disk(&id) && !on_disk(&s.csrf) && !on_disk(&k.secret));
        let second = Sessions::new(Arc::new(ConsoleDb::open(&path).unwrap()));
        let h = headers(&[("cookie", &format!("{COOKIE}={id}"))]);
        let again = second
            .current(&store, &h)
            .await
            .expect("the session is found again");
        assert_eq!(
            (again.csrf, again.caller.team),
            (s.csrf, "blue".to_string())
        );
        second.end(&h).await;
        assert!(
            second.current(&store, &h).await.is_none(),
            "sign-out ends it"
        );
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
