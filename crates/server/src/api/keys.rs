//! API keys and teams over the API, scoped to the caller's team (the shapes follow E2B's
//! `/api-keys` and `/teams`, with kiln's team and prefix added):
//!
//! - `GET /api-keys`: the team's keys, by prefix only (the operator's team, `default`, sees
//!   every team's, or one team's with `?team=`);
//! - `POST /api-keys` `{name, team?}`: 201 with the new key's secret, shown this once; a key
//!   for another team only for the operator's team;
//! - `DELETE /api-keys/{apiKeyID}`: revokes one of the team's keys (any, for the operator's
//!   team), never the operator team's last active key;
//! - `GET /teams`: the caller's team (every team, for the operator's) with its quotas in
//!   effect and what it uses of them.

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Deserialize;
use serde_json::{json, Value};

use super::wire::{parse_json, ts};
use super::{ApiError, ApiResult, St};
use crate::store::{KeyRecord, SandboxState};
use crate::tenancy::{check_team_name, Caller, DEFAULT_TEAM};

/// Longest key name.
const MAX_NAME: usize = 64;

fn is_operator(c: &Caller) -> bool {
    c.team == DEFAULT_TEAM
}

fn forbidden(what: &str) -> ApiError {
    ApiError::new(
        StatusCode::FORBIDDEN,
        format!("{what} needs a key of the operator's team ({DEFAULT_TEAM:?})"),
    )
}

fn store_err(e: crate::store::StoreError) -> ApiError {
    crate::Error::from(e).into()
}

/// A key as the API shows it: never its hash or secret.
fn key_json(k: &KeyRecord) -> Value {
    json!({
        "id": k.id,
        "name": k.name,
        "team": k.team,
        "prefix": k.prefix,
        "mask": {
            "prefix": "e2b_",
            "valueLength": 40,
            "maskedValuePrefix": k.prefix.strip_prefix("e2b_").unwrap_or(""),
            "maskedValueSuffix": "",
        },
        "createdAt": ts(k.created_at_ms),
        "createdBy": null,
        "lastUsed": k.last_used_ms.map(ts),
        "revokedAt": k.revoked_at_ms.map(ts),
    })
}

#[derive(Debug, Deserialize)]
pub struct ListQuery {
    team: Option<String>,
}

/// `GET /api-keys[?team=]`.
pub async fn list(
    State(st): St,
    Extension(c): Extension<Caller>,
    Query(q): Query<ListQuery>,
) -> ApiResult<Json<Vec<Value>>> {
    let team = match q.team {
        Some(t) if t != c.team && !is_operator(&c) => {
            return Err(forbidden("listing another team's keys"))
        }
        Some(t) => Some(t),
        None if is_operator(&c) => None,
        None => Some(c.team.clone()),
    };
    let keys = st.access.list_keys().await.map_err(store_err)?;
    Ok(Json(
        keys.iter()
            .filter(|k| team.as_ref().is_none_or(|t| &k.team == t))
            .map(key_json)
            .collect(),
    ))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewKey {
    name: String,
    team: Option<String>,
}

/// `POST /api-keys` `{name, team?}` → 201 with `key`, the secret (shown this once).
pub async fn create(
    State(st): St,
    Extension(c): Extension<Caller>,
    body: Bytes,
) -> ApiResult<Response> {
    let b: NewKey =
        parse_json(&body, false)?.ok_or_else(|| ApiError::bad_request("request body is empty"))?;
    let name = b.name.trim();
    if name.is_empty() || name.chars().count() > MAX_NAME || name.chars().any(char::is_control) {
        return Err(ApiError::bad_request(format!(
            "invalid key name {:?}: use 1-{MAX_NAME} printable characters",
            b.name
        )));
    }
    let team = b.team.unwrap_or_else(|| c.team.clone());
    check_team_name(&team)?;
    if team != c.team && !is_operator(&c) {
        return Err(forbidden("creating a key for another team"));
    }
    let k = crate::auth::create_team_key(st.access.as_ref(), name, &team)
        .await
        .map_err(store_err)?;
    tracing::info!(key = %k.record.id, team = %team, by = %c.key_id, "API key created");
    let mut v = key_json(&k.record);
    v["key"] = json!(k.secret);
    Ok((StatusCode::CREATED, Json(v)).into_response())
}

/// `DELETE /api-keys/{apiKeyID}` → 204.
pub async fn revoke(
    State(st): St,
    Extension(c): Extension<Caller>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    let store = &st.access;
    let keys = store.list_keys().await.map_err(store_err)?;
    let not_found = || ApiError::not_found(format!("API key {id:?} not found"));
    let k = keys
        .iter()
        .find(|k| k.id == id && (k.team == c.team || is_operator(&c)))
        .ok_or_else(not_found)?;
    if k.revoked_at_ms.is_some() {
        return Err(ApiError::conflict(format!(
            "API key {id:?} is already revoked"
        )));
    }
    let live = |k: &&KeyRecord| k.team == DEFAULT_TEAM && k.revoked_at_ms.is_none();
    if k.team == DEFAULT_TEAM && keys.iter().filter(live).count() <= 1 {
        return Err(ApiError::conflict(format!(
            "API key {id:?} is the last active key of the operator's team: create another \
             one first"
        )));
    }
    if !store.revoke_key(&id).await.map_err(store_err)? {
        return Err(not_found());
    }
    tracing::info!(key = %id, by = %c.key_id, "API key revoked");
    Ok(StatusCode::NO_CONTENT)
}

/// `GET /teams`: the caller's team, or every team for the operator's, with quotas and use.
pub async fn teams(State(st): St, Extension(c): Extension<Caller>) -> ApiResult<Json<Vec<Value>>> {
    let store = &st.access;
    let keys = store.list_keys().await.map_err(store_err)?;
    let mut names = vec![c.team.clone()];
    if is_operator(&c) {
        let rows = store.list_teams().await.map_err(store_err)?;
        names.extend(rows.into_iter().map(|t| t.name));
        names.extend(keys.iter().map(|k| k.team.clone()));
        names.sort();
        names.dedup();
    }
    let mut out = Vec::with_capacity(names.len());
    for n in names {
        let q = st.manager.team_quota(&n).await?;
        let sandboxes = st.manager.list_for(&n);
        let count = |s: SandboxState| sandboxes.iter().filter(|r| r.state == s).count();
        out.push(json!({
            "teamID": n,
            "name": n,
            "isDefault": n == c.team,
            "activeKeys": keys.iter().filter(|k| k.team == n && k.revoked_at_ms.is_none()).count(),
            "quota": {
                "maxSandboxes": q.max_sandboxes,
                "maxTimeoutSecs": q.max_timeout_secs,
                "createsPerMinute": q.creates_per_minute,
                "maxVolumes": q.max_volumes,
            },
            "usage": {
                "sandboxes": sandboxes.len(),
                "running": count(SandboxState::Running),
                "paused": count(SandboxState::Paused),
            },
        }));
    }
    Ok(Json(out))
}
