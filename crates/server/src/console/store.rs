//! Where console sessions are kept: [`SessionStore`], the seam between the console's sign-in
//! logic ([`super::session`]) and its storage. `kiln serve` keeps them in its state database
//! ([`ConsoleDb`]); a cluster's control replicas keep them in etcd, so a session opened at one
//! replica is known at every other.
//!
//! A stored session is a [`SessionRow`]: the SHA-256 of its id (the cookie's value, never
//! stored), the SHA-256 of the API key it was opened with, and its end. Its CSRF token is
//! derived from the id ([`super::session`]), so every replica computes the same token and
//! nothing more is stored. A session has a fixed end ([`super::session::SESSION_TTL`] after
//! sign-in); nothing renews it.

use async_trait::async_trait;

use crate::store::{ConsoleDb, Result, SessionRow};

/// Storage of console sessions, keyed by the hash of the session id.
#[async_trait]
pub trait SessionStore: Send + Sync {
    /// Drops the sessions ended by `now_ms`, then stores `row` unless `max` sessions are open
    /// already; whether it was stored.
    async fn create(&self, row: SessionRow, now_ms: i64, max: usize) -> Result<bool>;
    /// The session whose id hashes to `id_hash`, if stored and not ended by `now_ms`.
    async fn get(&self, id_hash: &str, now_ms: i64) -> Result<Option<SessionRow>>;
    /// Removes a session; whether there was one.
    async fn delete(&self, id_hash: &str) -> Result<bool>;
    /// Removes the sessions ended by `now_ms`; how many.
    async fn expire(&self, now_ms: i64) -> Result<usize>;
    /// Sessions stored (ended ones included until they are swept).
    async fn count(&self) -> Result<usize>;
}

#[async_trait]
impl SessionStore for ConsoleDb {
    async fn create(&self, row: SessionRow, now_ms: i64, max: usize) -> Result<bool> {
        self.insert_within(row, now_ms, max).await
    }
    async fn get(&self, id_hash: &str, now_ms: i64) -> Result<Option<SessionRow>> {
        Ok(ConsoleDb::get(self, id_hash)
            .await?
            .filter(|r| r.expires_at_ms > now_ms))
    }
    async fn delete(&self, id_hash: &str) -> Result<bool> {
        ConsoleDb::delete(self, id_hash).await
    }
    async fn expire(&self, now_ms: i64) -> Result<usize> {
        self.delete_ended(now_ms).await
    }
    async fn count(&self) -> Result<usize> {
        ConsoleDb::count(self).await
    }
}
