//! API keys: `e2b_` + 40 hex characters (the shape E2B keys have), stored as SHA-256 only.

use rand::RngCore;
use sha2::{Digest, Sha256};

use crate::store::{now_ms, AccessStore, KeyRecord, StoreError};
use crate::tenancy::{Caller, DEFAULT_TEAM};

/// Header carrying the API key (as E2B).
pub const API_KEY_HEADER: &str = "x-api-key";

/// The API key a request presents: `X-API-Key`, else `Authorization: Bearer <key>`.
pub fn presented_key(headers: &http::HeaderMap) -> Option<String> {
    headers
        .get(API_KEY_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .or_else(|| {
            headers
                .get(http::header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
                .map(str::to_string)
        })
}

/// A freshly generated key: the secret (shown once) and the row stored for it.
#[derive(Debug, Clone)]
pub struct NewKey {
    pub secret: String,
    pub record: KeyRecord,
}

pub fn hash_key(secret: &str) -> String {
    hex::encode(Sha256::digest(secret.as_bytes()))
}

/// Random hex string of `bytes` random bytes.
pub fn random_hex(bytes: usize) -> String {
    let mut buf = vec![0u8; bytes];
    rand::thread_rng().fill_bytes(&mut buf);
    hex::encode(buf)
}

/// Generates a key named `name` for the default team and stores its hash.
pub async fn create_key(store: &dyn AccessStore, name: &str) -> Result<NewKey, StoreError> {
    create_team_key(store, name, DEFAULT_TEAM).await
}

/// Generates a key named `name` acting for `team` and stores its hash (the team name is
/// checked by the caller, see [`crate::tenancy::check_team_name`]).
pub async fn create_team_key(
    store: &dyn AccessStore,
    name: &str,
    team: &str,
) -> Result<NewKey, StoreError> {
    let secret = format!("e2b_{}", random_hex(20));
    let record = KeyRecord {
        id: format!("key_{}", random_hex(6)),
        name: name.to_string(),
        prefix: secret[..10].to_string(),
        hash: hash_key(&secret),
        created_at_ms: now_ms(),
        last_used_ms: None,
        revoked_at_ms: None,
        team: team.to_string(),
    };
    store.insert_key(&record).await?;
    Ok(NewKey { secret, record })
}

/// Creates the first key when the database has none yet (first start).
pub async fn ensure_first_key(store: &dyn AccessStore) -> Result<Option<NewKey>, StoreError> {
    if store.list_keys().await?.is_empty() {
        return create_key(store, "first key").await.map(Some);
    }
    Ok(None)
}

/// Why a request's key was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("missing API key: send it in the X-API-Key header")]
    Missing,
    #[error("invalid API key")]
    Invalid,
    #[error("this API key was revoked")]
    Revoked,
}

/// Checks `presented` against the stored hashes; returns who is calling (the key's id and
/// team).
pub async fn verify(
    store: &dyn AccessStore,
    presented: Option<&str>,
) -> Result<Result<Caller, AuthError>, StoreError> {
    let Some(secret) = presented.map(str::trim).filter(|s| !s.is_empty()) else {
        return Ok(Err(AuthError::Missing));
    };
    match store.key_by_hash(&hash_key(secret)).await? {
        None => Ok(Err(AuthError::Invalid)),
        Some(k) if k.revoked_at_ms.is_some() => Ok(Err(AuthError::Revoked)),
        Some(k) => {
            store.touch_key(&k.id).await?;
            Ok(Ok(Caller {
                key_id: k.id,
                team: k.team,
            }))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn first_key_is_created_once_and_verifies() {
        let s = crate::store::SqliteStore::open_in_memory().unwrap();
        let k = ensure_first_key(&s)
            .await
            .unwrap()
            .expect("first start creates a key");
        assert!(k.secret.starts_with("e2b_") && k.secret.len() == 44);
        assert!(
            ensure_first_key(&s).await.unwrap().is_none(),
            "only on first start"
        );
        // Only the hash is stored.
        let rows = s.list_keys().await.unwrap();
        assert_eq!(rows.len(), 1);
        assert_ne!(rows[0].hash, k.secret);
        assert!(!rows[0].hash.contains(&k.secret[4..]));
        assert_eq!(
            verify(&s, Some(&k.secret)).await.unwrap(),
            Ok(Caller {
                key_id: k.record.id.clone(),
                team: DEFAULT_TEAM.into()
            })
        );
        let t = create_team_key(&s, "ci", "red").await.unwrap();
        assert_eq!(
            verify(&s, Some(&t.secret)).await.unwrap().unwrap().team,
            "red"
        );
    }

    #[tokio::test]
    async fn missing_invalid_and_revoked_keys_are_refused() {
        let s = crate::store::SqliteStore::open_in_memory().unwrap();
        let k = create_key(&s, "ci").await.unwrap();
        assert_eq!(verify(&s, None).await.unwrap(), Err(AuthError::Missing));
        assert_eq!(
            verify(&s, Some("  ")).await.unwrap(),
            Err(AuthError::Missing)
        );
        assert_eq!(
            verify(&s, Some("e2b_nope")).await.unwrap(),
            Err(AuthError::Invalid)
        );
        let other = create_key(&s, "other").await.unwrap();
        assert!(s.revoke_key(&k.record.id).await.unwrap());
        assert_eq!(
            verify(&s, Some(&k.secret)).await.unwrap(),
            Err(AuthError::Revoked)
        );
        assert!(verify(&s, Some(&other.secret)).await.unwrap().is_ok());
    }
}
