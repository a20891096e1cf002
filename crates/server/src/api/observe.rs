//! Observability routes: a sandbox's metrics history (`?start&end`), the newest metrics of
//! several sandboxes, the events API with its cursors, and the Prometheus `/metrics` text.

use std::collections::{BTreeMap, HashMap};

use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde_json::{json, Value};

use super::wire::{metric_json, ts};
use super::{ApiError, ApiResult, St};
use crate::obs::prom::Text;
use crate::store::{EventQuery, StoredEvent};
use crate::tenancy::Caller;

type Params = Query<HashMap<String, String>>;

fn int_param(q: &HashMap<String, String>, name: &str) -> ApiResult<Option<i64>> {
    q.get(name)
        .filter(|v| !v.is_empty())
        .map(|v| {
            v.parse::<i64>()
                .map_err(|_| ApiError::bad_request(format!("{name} must be an integer, got {v:?}")))
        })
        .transpose()
}

/// `GET /sandboxes/{id}/metrics?start&end` (Unix seconds, both inclusive): the samples taken
/// in that window, oldest first (default: the sandbox's whole life).
pub async fn sandbox_metrics(
    State(st): St,
    Extension(c): Extension<Caller>,
    Path(id): Path<String>,
    Query(q): Params,
) -> ApiResult<Json<Vec<Value>>> {
    super::scope::check_owner(&st, &id, &c.team).await?;
    let start = int_param(&q, "start")?;
    let end = int_param(&q, "end")?;
    if let (Some(s), Some(e)) = (start, end) {
        if s > e {
            return Err(ApiError::bad_request("start must not be after end"));
        }
    }
    let samples = st
        .manager
        .metrics_window(
            &id,
            start.map(|s| s.saturating_mul(1000)),
            end.map(|e| e.saturating_mul(1000).saturating_add(999)),
        )
        .await?;
    Ok(Json(samples.iter().map(metric_json).collect()))
}

/// Most sandboxes one bulk metrics request may name.
const MAX_BULK_IDS: usize = 100;

/// `GET /sandboxes/metrics?sandbox_ids=a,b`: `{"sandboxes": {id: newest sample}}` for those
/// running or paused.
pub async fn bulk_metrics(
    State(st): St,
    Extension(c): Extension<Caller>,
    Query(q): Params,
) -> ApiResult<Json<Value>> {
    let ids: Vec<String> = q
        .get("sandbox_ids")
        .map(|v| {
            v.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default();
    if ids.is_empty() {
        return Err(ApiError::bad_request("sandbox_ids is required"));
    }
    if ids.len() > MAX_BULK_IDS {
        return Err(ApiError::bad_request(format!(
            "at most {MAX_BULK_IDS} sandbox_ids per request"
        )));
    }
    // Another team's sandboxes are left out, as unknown ones are.
    let ids: Vec<String> = ids
        .into_iter()
        .filter(|id| st.manager.get_for(id, &c.team).is_ok())
        .collect();
    let latest = st.manager.latest_metrics(&ids).await;
    let map: BTreeMap<String, Value> = latest
        .iter()
        .map(|(id, s)| (id.clone(), metric_json(s)))
        .collect();
    Ok(Json(json!({ "sandboxes": map })))
}

/// Default and largest page of the events API.
const EVENTS_DEFAULT_LIMIT: u32 = 100;
const EVENTS_MAX_LIMIT: u32 = 1000;

fn event_json(e: &StoredEvent) -> Value {
    json!({
        "id": e.seq.to_string(),
        "timestamp": ts(e.event.ts_ms),
        "sandboxID": e.event.sandbox_id,
        "type": e.event.kind,
        "detail": e.event.detail,
    })
}

/// A time given as Unix milliseconds or RFC 3339.
fn parse_since(v: &str) -> ApiResult<i64> {
    if let Ok(ms) = v.parse::<i64>() {
        return Ok(ms);
    }
    chrono::DateTime::parse_from_rfc3339(v)
        .map(|t| t.timestamp_millis())
        .map_err(|_| {
            ApiError::bad_request(format!(
                "since must be Unix milliseconds or an RFC 3339 time, got {v:?}"
            ))
        })
}

async fn events_page(
    st: &super::AppState,
    q: &HashMap<String, String>,
    sandbox_id: Option<String>,
    team: Option<String>,
) -> ApiResult<Json<Value>> {
    let cursor = q
        .get("cursor")
        .filter(|c| !c.is_empty())
        .map(|c| {
            c.parse::<i64>()
                .ok()
                .filter(|n| *n >= 0)
                .ok_or_else(|| ApiError::bad_request(format!("invalid cursor {c:?}")))
        })
        .transpose()?;
    let since = q
        .get("since")
        .filter(|s| !s.is_empty())
        .map(|s| parse_since(s))
        .transpose()?;
    let limit = match int_param(q, "limit")? {
        None => EVENTS_DEFAULT_LIMIT,
        Some(n) if (1..=i64::from(EVENTS_MAX_LIMIT)).contains(&n) => n as u32,
        Some(n) => {
            return Err(ApiError::bad_request(format!(
                "limit must be 1-{EVENTS_MAX_LIMIT}, got {n}"
            )))
        }
    };
    let kinds = q
        .get("type")
        .map(|t| {
            t.split(',')
                .filter(|k| !k.is_empty())
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default();
    let sandbox_id = sandbox_id.or_else(|| q.get("sandboxId").or(q.get("sandboxID")).cloned());
    let page = st
        .events
        .events_page(&EventQuery {
            after_seq: cursor,
            since_ms: since,
            sandbox_id,
            team,
            kinds,
            limit,
        })
        .await
        .map_err(crate::Error::from)?;
    // The next cursor is the last event returned, or the one given when nothing is new, so
    // polling with it never skips nor repeats an event.
    let next = page.last().map(|e| e.seq).or(cursor);
    Ok(Json(json!({
        "events": page.iter().map(event_json).collect::<Vec<_>>(),
        "nextCursor": next.map(|n| n.to_string()),
        "hasMore": page.len() as u32 == limit,
    })))
}

/// `GET /events?since&cursor&limit&sandboxId&type`: the lifecycle event log of the caller's
/// team's sandboxes (every sandbox's for the operator's team), oldest first.
pub async fn events(
    State(st): St,
    Extension(c): Extension<Caller>,
    Query(q): Params,
) -> ApiResult<Json<Value>> {
    let named = q
        .get("sandboxId")
        .or(q.get("sandboxID"))
        .map(String::as_str);
    let team = super::scope::team_scope(&st, &c, named).await?;
    events_page(&st, &q, None, team).await
}

/// `GET /sandboxes/{id}/events`: the same, for one sandbox (also after it ended).
pub async fn sandbox_events(
    State(st): St,
    Extension(c): Extension<Caller>,
    Path(id): Path<String>,
    Query(q): Params,
) -> ApiResult<Json<Value>> {
    super::scope::check_owner(&st, &id, &c.team).await?;
    events_page(&st, &q, Some(id), None).await
}

/// Constant-time comparison of two tokens.
fn same_token(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// `GET /metrics`: Prometheus text, behind its own bearer token (`--metrics-token`).
pub async fn prometheus(State(st): St, headers: HeaderMap) -> Response {
    let Some(want) = st.cfg.metrics_token.as_deref() else {
        return ApiError::not_found("the metrics endpoint is off: start kiln with --metrics-token")
            .into_response();
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if !given.is_some_and(|g| same_token(g.as_bytes(), want.as_bytes())) {
        let mut r = ApiError::unauthorized("a valid metrics token is required").into_response();
        r.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            header::HeaderValue::from_static("Bearer"),
        );
        return r;
    }
    let m = &st.manager;
    let mut w = Text::default();
    w.family(
        "kiln_sandboxes",
        "Sandboxes held by this server, by state and template.",
        "gauge",
    );
    let mut by: BTreeMap<(&'static str, String), u64> = BTreeMap::new();
    for r in m.list() {
        *by.entry((r.state.as_str(), r.template_id.clone()))
            .or_default() += 1;
    }
    for state in ["running", "paused"] {
        if !by.keys().any(|(s, _)| *s == state) {
            by.insert((state, String::new()), 0);
        }
    }
    for ((state, tpl), n) in &by {
        w.sample(
            "kiln_sandboxes",
            &[("state", state), ("template", tpl)],
            *n as f64,
        );
    }
    w.family(
        "kiln_sandboxes_standby",
        "Running sandboxes in standby (checkpointed to disk, woken by traffic).",
        "gauge",
    );
    w.sample("kiln_sandboxes_standby", &[], m.standby_count() as f64);
    w.family(
        "kiln_sandboxes_idle_hinted",
        "Awake sandboxes hinted idle to their driver (which may make their runtime cheaper).",
        "gauge",
    );
    w.sample(
        "kiln_sandboxes_idle_hinted",
        &[],
        m.idle_hinted_count() as f64,
    );
    let samples = m.latest_samples();
    let sum = |f: fn(&crate::manager::MetricSample) -> u64| -> f64 {
        samples.iter().map(|(_, s)| f(s)).sum::<u64>() as f64
    };
    let gauges: [(&str, &str, f64); 3] = [
        (
            "kiln_sandbox_disk_used_bytes",
            "Disk used inside sandboxes (newest samples, summed).",
            sum(|s| s.disk_used),
        ),
        (
            "kiln_sandbox_memory_used_bytes",
            "Memory used by sandboxes (newest samples, summed).",
            sum(|s| s.mem_used),
        ),
        (
            "kiln_state_disk_free_bytes",
            "Free space on the file system of kiln's state directory.",
            m.state_disk_free().map_or(f64::NAN, |b| b as f64),
        ),
    ];
    for (name, help, v) in gauges {
        w.family(name, help, "gauge");
        w.sample(name, &[], v);
    }
    let (allowed, denied) = kiln_net::egress::counts();
    w.family(
        "kiln_egress_connections_total",
        "Outbound sandbox connections seen by the egress proxy, by verdict.",
        "counter",
    );
    w.sample(
        "kiln_egress_connections_total",
        &[("verdict", "allowed")],
        allowed as f64,
    );
    w.sample(
        "kiln_egress_connections_total",
        &[("verdict", "denied")],
        denied as f64,
    );
    if let Some(tap) = st.audit.rules_tap() {
        w.family(
            "kiln_rules_records_dropped_total",
            "Audit records the rule engine could not take (its queue was full), so not \
             evaluated by any rule.",
            "counter",
        );
        w.sample(
            "kiln_rules_records_dropped_total",
            &[],
            tap.dropped() as f64,
        );
    }
    st.telemetry.write(&mut w);
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        w.finish(),
    )
        .into_response()
}
