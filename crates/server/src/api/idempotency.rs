//! `Idempotency-Key` on creates (sandboxes, snapshots): a request that repeats the key of an
//! earlier one from the same team (and for the same route) within [`WINDOW`] gets the earlier
//! answer instead of doing the work again — also while the first is still running (the e2b
//! SDK retries a create on 429/502/503/504 and on its own timeouts, so the retry often arrives
//! before the first attempt is done).
//!
//! - Only successful answers are kept: after a refusal or a failure the key is free again, so
//!   a retry really retries. Requests that waited on a failed attempt get its answer.
//! - The same key with a different body is a client bug: 422.
//! - The work runs in a task of its own, so a client that disconnects does not cut it short.
//! - Kept in memory, at most [`MAX_KEYS`] at once, and (with a store) in the state database,
//!   so a create retried after a server restart still gets the first answer (the same
//!   sandbox) within [`WINDOW`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::future::BoxFuture;
use sha2::{Digest, Sha256};
use tokio::sync::watch;

use super::{ApiError, ApiResult};
use crate::store::{now_ms, IdempotencyStore, IdempotentAnswer};

/// Header naming a request's idempotency key.
pub const HEADER: &str = "idempotency-key";
/// Header set on an answer replayed from an earlier request.
pub const REPLAYED: &str = "idempotent-replayed";
/// How long a key is remembered.
pub const WINDOW: Duration = Duration::from_secs(3600);
/// Most keys remembered at once (the oldest finished ones go first).
pub const MAX_KEYS: usize = 10_000;
/// Largest answer body kept (a create's answer is well under 1 KiB).
const MAX_ANSWER: usize = 256 * 1024;

/// A finished request's answer, replayable.
#[derive(Clone)]
struct Answer {
    status: StatusCode,
    content_type: Option<HeaderValue>,
    retry_after: Option<HeaderValue>,
    body: Bytes,
}

impl Answer {
    fn response(&self, replayed: bool) -> Response {
        let mut r = Response::new(Body::from(self.body.clone()));
        *r.status_mut() = self.status;
        let h = r.headers_mut();
        if let Some(v) = &self.content_type {
            h.insert(axum::http::header::CONTENT_TYPE, v.clone());
        }
        if let Some(v) = &self.retry_after {
            h.insert(axum::http::header::RETRY_AFTER, v.clone());
        }
        if replayed {
            h.insert(REPLAYED, HeaderValue::from_static("true"));
        }
        r
    }
}

struct Entry {
    fingerprint: [u8; 32],
    at: Instant,
    generation: u64,
    answer: watch::Receiver<Option<Answer>>,
}

/// The keys the server remembers.
#[derive(Clone, Default)]
pub struct Idempotency {
    inner: Arc<Mutex<State>>,
    store: Option<Arc<dyn IdempotencyStore>>,
}

#[derive(Default)]
struct State {
    entries: HashMap<(String, String), Entry>,
    generation: u64,
}

/// The `Idempotency-Key` of a request, if it has one; 400 when it is not 1-255 visible ASCII
/// characters.
pub fn key_of(headers: &HeaderMap) -> ApiResult<Option<String>> {
    let Some(v) = headers.get(HEADER) else {
        return Ok(None);
    };
    let ok = !v.is_empty() && v.len() <= 255 && v.as_bytes().iter().all(|b| b.is_ascii_graphic());
    if !ok {
        return Err(ApiError::bad_request(
            "Idempotency-Key must be 1-255 visible ASCII characters",
        ));
    }
    Ok(Some(String::from_utf8_lossy(v.as_bytes()).into_owned()))
}

impl Idempotency {
    /// Keys kept in memory and in `store` (answers survive a restart).
    pub fn with_store(store: Arc<dyn IdempotencyStore>) -> Self {
        Self {
            inner: Default::default(),
            store: Some(store),
        }
    }

    /// The answer persisted for `scope` and `key` within the window, if any.
    async fn persisted(&self, scope: &str, key: &str) -> Option<IdempotentAnswer> {
        let since = now_ms() - WINDOW.as_millis() as i64;
        match self.store.as_ref()?.get_idempotent(scope, key, since).await {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "reading an idempotency key");
                None
            }
        }
    }

    async fn persist(&self, scope: &str, key: &str, fingerprint: &[u8; 32], a: &Answer) {
        let Some(store) = &self.store else {
            return;
        };
        let rec = IdempotentAnswer {
            scope: scope.to_string(),
            key: key.to_string(),
            fingerprint: hex::encode(fingerprint),
            status: a.status.as_u16(),
            content_type: a
                .content_type
                .as_ref()
                .and_then(|v| v.to_str().ok())
                .map(str::to_string),
            body: a.body.to_vec(),
            created_at_ms: now_ms(),
        };
        if let Err(e) = store.put_idempotent(&rec).await {
            tracing::warn!(error = %e, "recording an idempotency key");
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Number of keys remembered.
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Runs `work` for the request with idempotency key `key` in `scope` (team and route),
    /// or answers as the earlier request with that key did (or will).
    pub async fn run(
        &self,
        scope: String,
        key: String,
        body: &[u8],
        work: BoxFuture<'static, ApiResult<Response>>,
    ) -> Response {
        let fingerprint: [u8; 32] = Sha256::digest(body).into();
        if let Some(p) = self.persisted(&scope, &key).await {
            if p.fingerprint != hex::encode(fingerprint) {
                return different_body();
            }
            let answer = Answer {
                status: StatusCode::from_u16(p.status).unwrap_or(StatusCode::OK),
                content_type: p.content_type.and_then(|v| HeaderValue::from_str(&v).ok()),
                retry_after: None,
                body: Bytes::from(p.body),
            };
            return answer.response(true);
        }
        let (mut rx, leader) = {
            let mut st = self.lock();
            let now = Instant::now();
            st.entries.retain(|_, e| now.duration_since(e.at) < WINDOW);
            match st.entries.get(&(scope.clone(), key.clone())) {
                Some(e) if e.fingerprint != fingerprint => return different_body(),
                Some(e) => (e.answer.clone(), false),
                None => {
                    if st.entries.len() >= MAX_KEYS {
                        evict_oldest(&mut st.entries);
                    }
                    st.generation += 1;
                    let generation = st.generation;
                    let (tx, rx) = watch::channel(None);
                    st.entries.insert(
                        (scope.clone(), key.clone()),
                        Entry {
                            fingerprint,
                            at: now,
                            generation,
                            answer: rx.clone(),
                        },
                    );
                    let me = self.clone();
                    tokio::spawn(async move {
                        let answer = capture(work.await).await;
                        if answer.status.is_success() {
                            me.persist(&scope, &key, &fingerprint, &answer).await;
                        } else {
                            // Not kept: a later retry runs again.
                            let mut st = me.lock();
                            let k = (scope, key);
                            if st
                                .entries
                                .get(&k)
                                .is_some_and(|e| e.generation == generation)
                            {
                                st.entries.remove(&k);
                            }
                        }
                        let _ = tx.send(Some(answer));
                    });
                    (rx, true)
                }
            }
        };
        let answer = match rx.wait_for(|a| a.is_some()).await {
            Ok(a) => a.clone(),
            Err(_) => None,
        };
        answer.map(|a| a.response(!leader)).unwrap_or_else(lost)
    }
}

fn different_body() -> Response {
    ApiError::new(
        StatusCode::UNPROCESSABLE_ENTITY,
        "this Idempotency-Key was already used with a different request body",
    )
    .into_response()
}

fn lost() -> Response {
    ApiError::internal("the request with this Idempotency-Key did not finish").into_response()
}

fn evict_oldest(entries: &mut HashMap<(String, String), Entry>) {
    let oldest = entries
        .iter()
        .filter(|(_, e)| e.answer.borrow().is_some())
        .min_by_key(|(_, e)| e.at)
        .map(|(k, _)| k.clone());
    if let Some(k) = oldest {
        entries.remove(&k);
    }
}

async fn capture(r: ApiResult<Response>) -> Answer {
    let resp = r.unwrap_or_else(|e| e.into_response());
    let (parts, body) = resp.into_parts();
    let body = match axum::body::to_bytes(body, MAX_ANSWER).await {
        Ok(b) => b,
        Err(e) => {
            return capture_err(ApiError::internal(format!("reading the answer: {e}"))).await;
        }
    };
    Answer {
        status: parts.status,
        content_type: parts.headers.get(axum::http::header::CONTENT_TYPE).cloned(),
        retry_after: parts.headers.get(axum::http::header::RETRY_AFTER).cloned(),
        body,
    }
}

async fn capture_err(e: ApiError) -> Answer {
    let resp = e.into_response();
    let (parts, body) = resp.into_parts();
    Answer {
        status: parts.status,
        content_type: parts.headers.get(axum::http::header::CONTENT_TYPE).cloned(),
        retry_after: None,
        body: axum::body::to_bytes(body, MAX_ANSWER)
            .await
            .unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn ok_work(n: Arc<AtomicUsize>, status: StatusCode) -> BoxFuture<'static, ApiResult<Response>> {
        Box::pin(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let i = n.fetch_add(1, Ordering::SeqCst);
            Ok((status, format!("{{\"n\":{i}}}")).into_response())
        })
    }

    /// A run of key `k` in `scope` with `req`, whose work answers `status` (counted in `n`).
    async fn call(
        idem: &Idempotency,
        scope: &str,
        req: &[u8],
        n: &Arc<AtomicUsize>,
        status: StatusCode,
    ) -> Response {
        idem.run(scope.into(), "k".into(), req, ok_work(n.clone(), status))
            .await
    }

    async fn body(r: Response) -> (StatusCode, bool, String) {
        let replayed = r.headers().contains_key(REPLAYED);
        let s = r.status();
        let b = axum::body::to_bytes(r.into_body(), 1024).await.unwrap();
        (s, replayed, String::from_utf8_lossy(&b).into())
    }

    #[tokio::test]
    async fn concurrent_and_later_repeats_get_the_first_answer() {
        let idem = Idempotency::default();
        let n = Arc::new(AtomicUsize::new(0));
        let calls = (0..5).map(|_| {
            let (idem, n) = (idem.clone(), n.clone());
            async move {
                idem.run(
                    "t/create".into(),
                    "k".into(),
                    b"{}",
                    ok_work(n, StatusCode::CREATED),
                )
                .await
            }
        });
        let out = futures::future::join_all(calls).await;
        assert_eq!(n.load(Ordering::SeqCst), 1, "the work ran once");
        let mut replays = 0;
        for r in out {
            let (s, replayed, b) = body(r).await;
            assert_eq!((s, b.as_str()), (StatusCode::CREATED, "{\"n\":0}"));
            replays += usize::from(replayed);
        }
        assert_eq!(replays, 4);
        let later = call(&idem, "t/create", b"{}", &n, StatusCode::CREATED).await;
        assert_eq!(body(later).await.2, "{\"n\":0}");
        // Another team, or another key: runs.
        let other = call(&idem, "u/create", b"{}", &n, StatusCode::CREATED).await;
        assert_eq!(body(other).await.2, "{\"n\":1}");
        // Same key, other body: 422.
        let bad = call(&idem, "t/create", b"{\"x\":1}", &n, StatusCode::CREATED).await;
        assert_eq!(bad.status(), StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(n.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn failures_are_not_kept() {
        let idem = Idempotency::default();
        let n = Arc::new(AtomicUsize::new(0));
        let first = call(&idem, "t", b"", &n, StatusCode::TOO_MANY_REQUESTS).await;
        assert_eq!(first.status(), StatusCode::TOO_MANY_REQUESTS);
        assert!(idem.is_empty());
        let second = call(&idem, "t", b"", &n, StatusCode::CREATED).await;
        assert_eq!(body(second).await.2, "{\"n\":1}");
    }

    #[tokio::test]
    async fn answers_survive_a_restart_through_the_store() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("kiln.db");
        let n = Arc::new(AtomicUsize::new(0));
        {
            let store: Arc<dyn IdempotencyStore> =
                Arc::new(crate::store::SqliteStore::open(&db).unwrap());
            let idem = Idempotency::with_store(store);
            let first = call(&idem, "t/c", b"{}", &n, StatusCode::CREATED).await;
            assert_eq!(
                body(first).await,
                (StatusCode::CREATED, false, "{\"n\":0}".into())
            );
        }
        // A new server process: nothing in memory, the same database.
        let store: Arc<dyn IdempotencyStore> =
            Arc::new(crate::store::SqliteStore::open(&db).unwrap());
        let idem = Idempotency::with_store(store);
        let again = call(&idem, "t/c", b"{}", &n, StatusCode::CREATED).await;
        assert_eq!(
            body(again).await,
            (StatusCode::CREATED, true, "{\"n\":0}".into())
        );
        assert_eq!(n.load(Ordering::SeqCst), 1, "the work ran once");
        let other_body = call(&idem, "t/c", b"{\"x\":1}", &n, StatusCode::CREATED).await;
        assert_eq!(other_body.status(), StatusCode::UNPROCESSABLE_ENTITY);
        // Failures are not persisted.
        let fail = idem
            .run(
                "t/c".into(),
                "f".into(),
                b"",
                ok_work(n.clone(), StatusCode::TOO_MANY_REQUESTS),
            )
            .await;
        assert_eq!(fail.status(), StatusCode::TOO_MANY_REQUESTS);
        assert!(idem.persisted("t/c", "f").await.is_none());
    }

    #[test]
    fn keys_are_checked() {
        let mut h = HeaderMap::new();
        assert_eq!(key_of(&h).unwrap(), None);
        h.insert(HEADER, HeaderValue::from_static("abc-123"));
        assert_eq!(key_of(&h).unwrap().as_deref(), Some("abc-123"));
        h.insert(HEADER, HeaderValue::from_static("a b"));
        assert!(key_of(&h).is_err());
        h.insert(HEADER, HeaderValue::from_str(&"x".repeat(256)).unwrap());
        assert!(key_of(&h).is_err());
    }
}
