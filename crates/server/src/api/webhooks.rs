//! Webhook routes: register, list, show and delete a team's webhooks, read a webhook's
//! delivery log, and send it a test delivery.
//!
//! A webhook belongs to the team of the key that registered it; other teams get 404.

use std::collections::HashMap;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Deserialize;
use serde_json::{json, Value};

use super::wire::{parse_json, ts};
use super::{ApiError, ApiResult, St};
use crate::store::{DeliveryRecord, WebhookRecord, LIFECYCLE_KINDS};
use crate::tenancy::Caller;

type Who = Extension<Caller>;

/// Most webhooks one team may register.
const MAX_WEBHOOKS: usize = 50;
/// How long a test delivery call waits for the first attempt.
const TEST_WAIT: Duration = Duration::from_secs(15);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NewWebhook {
    url: String,
    /// Event types to receive (default: every lifecycle type; `*` for every event).
    events: Option<Vec<String>>,
    /// Signing secret (default: a random one, returned once).
    secret: Option<String>,
}

fn webhook_json(w: &WebhookRecord) -> Value {
    let events: Vec<&str> = if w.events.is_empty() {
        LIFECYCLE_KINDS.to_vec()
    } else {
        w.events.iter().map(String::as_str).collect()
    };
    json!({
        "id": w.id,
        "team": w.team,
        "url": w.url,
        "events": events,
        "createdAt": ts(w.created_at_ms),
    })
}

fn delivery_json(d: &DeliveryRecord) -> Value {
    json!({
        "id": d.id.to_string(),
        "webhookID": d.webhook_id,
        "eventID": d.event_seq.map(|s| s.to_string()),
        "type": d.kind,
        "status": d.status,
        "attempts": d.attempts,
        "createdAt": ts(d.created_at_ms),
        "lastAttemptAt": d.last_attempt_ms.map(ts),
        "nextAttemptAt": (d.status == crate::store::DeliveryStatus::Pending)
            .then(|| ts(d.next_attempt_ms)),
        "lastStatusCode": d.last_status_code,
        "lastError": d.last_error,
        "payload": serde_json::from_str::<Value>(&d.payload).unwrap_or(Value::Null),
    })
}

async fn check_url(st: &super::AppState, url: &str) -> ApiResult<()> {
    let u = reqwest::Url::parse(url)
        .map_err(|e| ApiError::bad_request(format!("invalid webhook url: {e}")))?;
    if !matches!(u.scheme(), "http" | "https") || u.host_str().is_none() {
        return Err(ApiError::bad_request(
            "the webhook url must be an http:// or https:// URL with a host",
        ));
    }
    st.webhooks
        .check_destination(&u)
        .await
        .map_err(ApiError::bad_request)
}

fn random_secret() -> String {
    use rand::RngCore;
    let mut b = [0u8; 24];
    rand::thread_rng().fill_bytes(&mut b);
    format!("whsec_{}", hex::encode(b))
}

async fn find(st: &super::AppState, team: &str, id: &str) -> ApiResult<WebhookRecord> {
    st.events
        .get_webhook(team, id)
        .await
        .map_err(crate::Error::from)?
        .ok_or_else(|| ApiError::not_found(format!("webhook {id:?} not found")))
}

/// `POST /webhooks`: 201 with the webhook and its secret (shown this once).
pub async fn create(State(st): St, Extension(c): Who, body: Bytes) -> ApiResult<Response> {
    let b: NewWebhook =
        parse_json(&body, false)?.ok_or_else(|| ApiError::bad_request("request body is empty"))?;
    check_url(&st, &b.url).await?;
    let events = b.events.unwrap_or_default();
    if let Some(bad) = events
        .iter()
        .find(|e| e.is_empty() || e.len() > 64 || e.contains(char::is_whitespace))
    {
        return Err(ApiError::bad_request(format!("invalid event type {bad:?}")));
    }
    let secret = match b.secret {
        Some(s) if s.len() < 16 => {
            return Err(ApiError::bad_request(
                "secret must be at least 16 characters",
            ))
        }
        Some(s) => s,
        None => random_secret(),
    };
    let store = &st.events;
    let team = c.team.as_str();
    if store
        .list_webhooks(team)
        .await
        .map_err(crate::Error::from)?
        .len()
        >= MAX_WEBHOOKS
    {
        return Err(ApiError::conflict(format!(
            "a team may register at most {MAX_WEBHOOKS} webhooks"
        )));
    }
    let w = WebhookRecord {
        id: format!("wh_{}", crate::manager::new_sandbox_id()),
        team: team.to_string(),
        url: b.url,
        secret,
        events,
        created_at_ms: crate::store::now_ms(),
    };
    store.insert_webhook(&w).await.map_err(crate::Error::from)?;
    let mut v = webhook_json(&w);
    v["secret"] = json!(w.secret);
    Ok((StatusCode::CREATED, Json(v)).into_response())
}

/// `GET /webhooks`: the caller's team's webhooks (without secrets).
pub async fn list(State(st): St, Extension(c): Who) -> ApiResult<Json<Vec<Value>>> {
    let list = st
        .events
        .list_webhooks(&c.team)
        .await
        .map_err(crate::Error::from)?;
    Ok(Json(list.iter().map(webhook_json).collect()))
}

/// `GET /webhooks/{id}`.
pub async fn get(
    State(st): St,
    Extension(c): Who,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    Ok(Json(webhook_json(&find(&st, &c.team, &id).await?)))
}

/// `DELETE /webhooks/{id}`: 204; its pending deliveries are dropped.
pub async fn delete(
    State(st): St,
    Extension(c): Who,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    let gone = st
        .events
        .delete_webhook(&c.team, &id)
        .await
        .map_err(crate::Error::from)?;
    if gone {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::not_found(format!("webhook {id:?} not found")))
    }
}

/// `GET /webhooks/{id}/deliveries?limit&cursor`: the delivery log, newest first.
pub async fn deliveries(
    State(st): St,
    Extension(c): Who,
    Path(id): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Json<Value>> {
    find(&st, &c.team, &id).await?;
    let limit = match q.get("limit").map(|l| l.parse::<u32>()) {
        None => 50,
        Some(Ok(n)) if (1..=500).contains(&n) => n,
        Some(_) => return Err(ApiError::bad_request("limit must be 1-500")),
    };
    let before = match q.get("cursor").filter(|c| !c.is_empty()) {
        None => None,
        Some(c) => Some(
            c.parse::<i64>()
                .map_err(|_| ApiError::bad_request(format!("invalid cursor {c:?}")))?,
        ),
    };
    let list = st
        .events
        .deliveries(&id, before, limit)
        .await
        .map_err(crate::Error::from)?;
    let next = (list.len() as u32 == limit)
        .then(|| list.last().map(|d| d.id.to_string()))
        .flatten();
    Ok(Json(json!({
        "deliveries": list.iter().map(delivery_json).collect::<Vec<_>>(),
        "nextCursor": next,
    })))
}

/// `POST /webhooks/{id}/test`: queues a `webhook.test` delivery and answers with it after its
/// first attempt (200), or 202 when that attempt has not finished within 15 s. A failed test
/// delivery is retried like any other.
pub async fn test(State(st): St, Extension(c): Who, Path(id): Path<String>) -> ApiResult<Response> {
    let w = find(&st, &c.team, &id).await?;
    let payload = json!({
        "type": "webhook.test",
        "webhookID": w.id,
        "team": w.team,
        "event": {"timestamp": ts(crate::store::now_ms())},
    })
    .to_string();
    let store = &st.events;
    let did = store
        .enqueue_delivery(&w.id, "test", &payload)
        .await
        .map_err(crate::Error::from)?;
    st.webhooks.nudge();
    let deadline = tokio::time::Instant::now() + TEST_WAIT;
    loop {
        let d = store
            .deliveries(&w.id, Some(did + 1), 1)
            .await
            .map_err(crate::Error::from)?
            .into_iter()
            .find(|d| d.id == did);
        match d {
            Some(d) if d.attempts > 0 => return Ok(Json(delivery_json(&d)).into_response()),
            Some(d) if tokio::time::Instant::now() >= deadline => {
                return Ok((StatusCode::ACCEPTED, Json(delivery_json(&d))).into_response())
            }
            Some(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            None => return Err(ApiError::not_found(format!("webhook {id:?} not found"))),
        }
    }
}
