//! E2B's `/secrets` routes as the `e2b` 2.63 SDK sends them: create, list (`limit`,
//! `nextToken`; the next page's token in the `x-next-token` answer header), get, new version,
//! delete — per team (another team's secret is a 404). Values are write-only: no answer
//! carries one, and every answer says `Cache-Control: no-store`. Limits are E2B's: bodies
//! ≤ 512 KiB and values ≤ 64 KiB (413), metadata ≤ 32 entries with keys ≤ 128 B, values
//! ≤ 1024 B and ≤ 8192 B in all (400).

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, Query, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};

use super::wire::{parse_json, ts};
use super::{ApiError, ApiResult, AppState, St};
use crate::store::{now_ms, SecretRecord};
use crate::tenancy::Caller;
use crate::vault::Vault;

pub const MAX_BODY: usize = 512 * 1024;
pub const MAX_VALUE: usize = 64 * 1024;
const MAX_NAME: usize = 255;
const MAX_META_ENTRIES: usize = 32;
const MAX_META_KEY: usize = 128;
const MAX_META_VALUE: usize = 1024;
const MAX_META_TOTAL: usize = 8192;
const DEFAULT_LIMIT: u32 = 100;
const MAX_LIMIT: u32 = 1000;
/// Prefix of secret ids (names may not start with it).
const ID_PREFIX: &str = "sec_";

/// The `/secrets` routes, every answer marked `Cache-Control: no-store`.
pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/secrets", post(create).get(list))
        .route(
            "/secrets/{secretID}",
            get(get_one).post(new_version).delete(delete),
        )
        .layer(middleware::from_fn(no_store))
}

async fn no_store(req: Request, next: Next) -> Response {
    let mut r = next.run(req).await;
    r.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

fn vault(st: &AppState) -> ApiResult<&Arc<Vault>> {
    st.vault
        .as_ref()
        .ok_or_else(|| ApiError::not_implemented("secrets on a server without a state directory"))
}

fn store_err(e: impl std::fmt::Display) -> ApiError {
    tracing::error!(error = %e, "secrets store");
    ApiError::internal("the secrets store failed; the server log says why")
}

/// A secret name as stored (lower-cased), or why it is not usable.
pub fn check_name(name: &str) -> ApiResult<String> {
    let bad = |why: &str| {
        Err(ApiError::bad_request(format!(
            "secret name {name:?} is not usable: {why}"
        )))
    };
    if name.is_empty() {
        return bad("it is empty");
    }
    if name.len() > MAX_NAME {
        return bad("it is longer than 255 bytes");
    }
    if name
        .chars()
        .any(|c| matches!(c, '{' | '}' | '/') || c.is_control())
    {
        return bad("it may not contain '{', '}', '/' or control characters");
    }
    let lower = name.to_lowercase();
    if lower.starts_with(ID_PREFIX) {
        return bad("the prefix \"sec_\" is reserved for secret ids");
    }
    Ok(lower)
}

fn check_value(v: &str) -> ApiResult<()> {
    if v.is_empty() {
        return Err(ApiError::bad_request("the secret value is empty"));
    }
    if v.len() > MAX_VALUE {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "the secret value is {} bytes; at most {MAX_VALUE} are allowed",
                v.len()
            ),
        ));
    }
    Ok(())
}

fn check_metadata(m: &BTreeMap<String, String>) -> ApiResult<()> {
    let bad = |m: String| Err(ApiError::bad_request(format!("metadata: {m}")));
    if m.len() > MAX_META_ENTRIES {
        return bad(format!("{} entries; at most {MAX_META_ENTRIES}", m.len()));
    }
    let mut total = 0;
    for (k, v) in m {
        if k.is_empty() || k.len() > MAX_META_KEY {
            return bad(format!("key {k:?} must be 1 to {MAX_META_KEY} bytes"));
        }
        if v.len() > MAX_META_VALUE {
            return bad(format!(
                "the value of {k:?} is {} bytes; at most {MAX_META_VALUE}",
                v.len()
            ));
        }
        total += k.len() + v.len();
    }
    if total > MAX_META_TOTAL {
        return bad(format!("{total} bytes in all; at most {MAX_META_TOTAL}"));
    }
    Ok(())
}

fn body_size(body: &Bytes) -> ApiResult<()> {
    if body.len() > MAX_BODY {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "the request body is {} bytes; at most {MAX_BODY} are allowed",
                body.len()
            ),
        ));
    }
    Ok(())
}

/// The API's view of a secret: never its value.
fn secret_json(s: &SecretRecord) -> Value {
    json!({
        "secretID": s.id,
        "name": s.name,
        "currentVersion": s.version,
        "metadata": s.metadata,
        "createdAt": ts(s.created_at_ms),
        "updatedAt": ts(s.updated_at_ms),
    })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NewSecret {
    name: String,
    value: String,
    metadata: Option<BTreeMap<String, String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SecretUpdate {
    value: String,
    metadata: Option<BTreeMap<String, String>>,
}

/// `POST /secrets` → 201.
async fn create(
    State(st): St,
    Extension(c): Extension<Caller>,
    body: Bytes,
) -> ApiResult<Response> {
    body_size(&body)?;
    let v = vault(&st)?;
    let n: NewSecret =
        parse_json(&body, false)?.ok_or_else(|| ApiError::bad_request("empty body"))?;
    let name = check_name(&n.name)?;
    check_value(&n.value)?;
    let metadata = n.metadata.unwrap_or_default();
    check_metadata(&metadata)?;
    let id = format!("{ID_PREFIX}{}", crate::auth::random_hex(12));
    let now = now_ms();
    let rec = SecretRecord {
        sealed: v.seal(&c.team, &id, n.value.as_bytes()),
        id,
        team: c.team.clone(),
        name,
        version: 1,
        metadata,
        created_at_ms: now,
        updated_at_ms: now,
    };
    if !v.insert(&rec).await.map_err(store_err)? {
        return Err(ApiError::conflict(format!(
            "a secret named {:?} exists; update it with POST /secrets/{0} or delete it first",
            rec.name
        )));
    }
    tracing::info!(team = %c.team, secret = %rec.id, name = %rec.name, "secret created");
    Ok((StatusCode::CREATED, Json(secret_json(&rec))).into_response())
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ListQuery {
    limit: Option<i64>,
    next_token: Option<String>,
}

fn cursor_of(token: &str) -> ApiResult<(i64, String)> {
    let bad = || {
        ApiError::bad_request(format!(
            "nextToken {token:?} is not a token this server gave"
        ))
    };
    let raw = hex::decode(token).map_err(|_| bad())?;
    let text = String::from_utf8(raw).map_err(|_| bad())?;
    let (at, id) = text.split_once(':').ok_or_else(bad)?;
    Ok((at.parse().map_err(|_| bad())?, id.to_string()))
}

/// `GET /secrets`: a page in creation order; `x-next-token` names the next one.
async fn list(
    State(st): St,
    Extension(c): Extension<Caller>,
    Query(q): Query<ListQuery>,
) -> ApiResult<Response> {
    let v = vault(&st)?;
    let limit = match q.limit {
        None => DEFAULT_LIMIT,
        Some(l) if (1..=MAX_LIMIT as i64).contains(&l) => l as u32,
        Some(l) => {
            return Err(ApiError::bad_request(format!(
                "limit {l} is out of range: 1 to {MAX_LIMIT}"
            )))
        }
    };
    let after = q.next_token.as_deref().map(cursor_of).transpose()?;
    // One more than asked says whether another page exists.
    let mut page = v
        .records()
        .list(&c.team, after, limit + 1)
        .await
        .map_err(store_err)?;
    let more = page.len() > limit as usize;
    page.truncate(limit as usize);
    let items: Vec<Value> = page.iter().map(secret_json).collect();
    let mut r = Json(items).into_response();
    if let (true, Some(last)) = (more, page.last()) {
        let token = hex::encode(format!("{}:{}", last.created_at_ms, last.id));
        r.headers_mut().insert(
            "x-next-token",
            HeaderValue::from_str(&token).expect("hex is a header value"),
        );
    }
    Ok(r)
}

fn not_found(key: &str) -> ApiError {
    ApiError::not_found(format!("secret {key:?} not found"))
}

/// `GET /secrets/{idOrName}`.
async fn get_one(
    State(st): St,
    Extension(c): Extension<Caller>,
    Path(key): Path<String>,
) -> ApiResult<Json<Value>> {
    let s = vault(&st)?
        .records()
        .get(&c.team, &key)
        .await
        .map_err(store_err)?
        .ok_or_else(|| not_found(&key))?;
    Ok(Json(secret_json(&s)))
}

/// `POST /secrets/{idOrName}`: the value becomes the next version (metadata, when given,
/// replaces the old).
async fn new_version(
    State(st): St,
    Extension(c): Extension<Caller>,
    Path(key): Path<String>,
    body: Bytes,
) -> ApiResult<Json<Value>> {
    body_size(&body)?;
    let v = vault(&st)?.clone();
    let u: SecretUpdate =
        parse_json(&body, false)?.ok_or_else(|| ApiError::bad_request("empty body"))?;
    check_value(&u.value)?;
    if let Some(m) = &u.metadata {
        check_metadata(m)?;
    }
    let (team, value) = (c.team.clone(), u.value);
    let v2 = v.clone();
    let seal = move |id: &str| v2.seal(&team, id, value.as_bytes());
    let s = v
        .new_version(&c.team, &key, seal, u.metadata, now_ms())
        .await
        .map_err(store_err)?
        .ok_or_else(|| not_found(&key))?;
    tracing::info!(team = %c.team, secret = %s.id, version = s.version, "secret updated");
    Ok(Json(secret_json(&s)))
}

/// `DELETE /secrets/{idOrName}` → 204.
async fn delete(
    State(st): St,
    Extension(c): Extension<Caller>,
    Path(key): Path<String>,
) -> ApiResult<StatusCode> {
    if vault(&st)?.delete(&c.team, &key).await.map_err(store_err)? {
        tracing::info!(team = %c.team, secret = %key, "secret deleted");
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(not_found(&key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_values_and_metadata_are_checked() {
        assert_eq!(check_name("Svc-Key.1").unwrap(), "svc-key.1");
        for bad in [
            "", "a{b", "a}b", "a/b", "a\u{7f}", "a\u{85}b", "sec_x", "SEC_x",
        ] {
            assert_eq!(check_name(bad).unwrap_err().status, 400, "{bad:?}");
        }
        assert_eq!(check_name(&"a".repeat(256)).unwrap_err().status, 400);
        assert!(check_value(&"v".repeat(MAX_VALUE)).is_ok());
        assert_eq!(
            check_value(&"v".repeat(MAX_VALUE + 1)).unwrap_err().status,
            413
        );
        assert_eq!(check_value("").unwrap_err().status, 400);
        let many: BTreeMap<_, _> = (0..33).map(|i| (i.to_string(), String::new())).collect();
        assert!(check_metadata(&many).is_err());
        let big: BTreeMap<_, _> = (0..9).map(|i| (i.to_string(), "x".repeat(1000))).collect();
        assert!(check_metadata(&big).is_err());
        let long = BTreeMap::from([("k".to_string(), "x".repeat(1025))]);
        assert!(check_metadata(&long).is_err());
        assert!(check_metadata(&BTreeMap::from([("k".into(), "v".into())])).is_ok());
        let t = hex::encode("12:sec_ab");
        assert_eq!(cursor_of(&t).unwrap(), (12, "sec_ab".to_string()));
        assert!(cursor_of("zz").is_err());
    }
}
