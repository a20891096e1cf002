//! The JSON shapes of E2B's API that kiln speaks, and their conversions from kiln's records.

use std::collections::BTreeMap;

use axum::body::Bytes;
use chrono::{SecondsFormat, TimeZone, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::{ApiError, ApiResult};
use crate::manager::{MetricSample, TemplateView};
use crate::store::{SandboxRecord, SandboxState, SnapshotRecord};

/// RFC 3339 (milliseconds, UTC) of a Unix time in milliseconds.
pub fn ts(ms: i64) -> String {
    Utc.timestamp_millis_opt(ms)
        .single()
        .unwrap_or_default()
        .to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// Parses a JSON body; an empty body is `None` when `allow_empty`, else a 400.
pub fn parse_json<T: serde::de::DeserializeOwned>(
    body: &Bytes,
    allow_empty: bool,
) -> ApiResult<Option<T>> {
    if body.iter().all(u8::is_ascii_whitespace) {
        if allow_empty {
            return Ok(None);
        }
        return Err(ApiError::bad_request(
            "request body is empty; a JSON object is required",
        ));
    }
    serde_json::from_slice(body)
        .map(Some)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NewSandbox {
    #[serde(rename = "templateID")]
    pub template_id: String,
    pub timeout: Option<i64>,
    pub auto_pause: Option<bool>,
    pub auto_pause_memory: Option<bool>,
    pub auto_resume: Option<AutoResume>,
    pub secure: Option<bool>,
    #[serde(rename = "allow_internet_access")]
    pub allow_internet_access: Option<bool>,
    pub metadata: Option<BTreeMap<String, String>>,
    pub env_vars: Option<BTreeMap<String, String>>,
    pub network: Option<super::network::NetworkJson>,
    pub mcp: Option<Value>,
    pub volume_mounts: Option<Vec<Value>>,
    /// Workload identity tokens (`{tokens: {NAME: {audience, tokenType}}}`).
    pub iam: Option<Value>,
}

/// `autoResume` of a create request.
#[derive(Debug, Deserialize)]
pub struct AutoResume {
    pub enabled: bool,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxJson {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    pub alias: Option<String>,
    #[serde(rename = "clientID")]
    pub client_id: String,
    pub envd_version: String,
    pub envd_access_token: Option<String>,
    pub traffic_access_token: Option<String>,
    pub domain: Option<String>,
}

pub fn sandbox_json(r: &SandboxRecord, domain: &str) -> SandboxJson {
    SandboxJson {
        template_id: r.template_id.clone(),
        sandbox_id: r.id.clone(),
        alias: r.alias.clone(),
        client_id: r.client_id.clone(),
        envd_version: kiln_proto::envd::ENVD_VERSION.into(),
        envd_access_token: r.envd_token.clone(),
        traffic_access_token: None,
        domain: Some(domain.to_string()),
    }
}

fn state_name(s: SandboxState) -> &'static str {
    match s {
        SandboxState::Paused => "paused",
        _ => "running",
    }
}

/// A listed sandbox; `standby_since` (Unix ms) when it is in standby: a running sandbox
/// shows `kilnStandby` (true while its memory is on disk until traffic wakes it) and then
/// `kilnStandbySince`. E2B's clients keep unknown fields aside.
pub fn listed_json(r: &SandboxRecord, standby_since: Option<i64>) -> Value {
    let mut v = json!({
        "templateID": r.template_id,
        "alias": r.alias,
        "sandboxID": r.id,
        "clientID": r.client_id,
        "startedAt": ts(r.started_at_ms),
        "endAt": ts(r.end_at_ms),
        "cpuCount": r.cpu_count,
        "memoryMB": r.memory_mb,
        "diskSizeMB": r.disk_size_mb,
        "metadata": r.metadata,
        "state": state_name(r.state),
        "envdVersion": kiln_proto::envd::ENVD_VERSION,
    });
    if r.state == SandboxState::Running {
        v["kilnStandby"] = json!(standby_since.is_some());
        if let Some(ms) = standby_since {
            v["kilnStandbySince"] = json!(ts(ms));
        }
    }
    v
}

pub fn detail_json(r: &SandboxRecord, domain: &str, standby_since: Option<i64>) -> Value {
    let mut v = listed_json(r, standby_since);
    v["envdAccessToken"] = json!(r.envd_token);
    v["domain"] = json!(domain);
    v["allowInternetAccess"] = json!(false);
    if r.state == SandboxState::Paused {
        if let Some(m) = r.pause_mode {
            v["pauseMode"] = json!(m.as_str());
        }
    }
    v
}

/// `GET /templates` item.
pub fn template_json(v: &TemplateView) -> Value {
    let t = &v.info;
    let rec = v.record.as_ref();
    let built = ts(t.built_at_unix as i64 * 1000);
    json!({
        "templateID": t.name,
        "buildID": t.key,
        "cpuCount": v.cpu_count,
        "memoryMB": v.memory_mb,
        "diskSizeMB": v.disk_mb,
        "public": false,
        "aliases": [t.name],
        "names": [t.name],
        "createdAt": built,
        "updatedAt": built,
        "createdBy": null,
        "lastSpawnedAt": rec.and_then(|r| r.last_spawned_ms).map(ts),
        "spawnCount": rec.map(|r| r.spawn_count).unwrap_or(0),
        "buildCount": 1,
        "envdVersion": kiln_proto::envd::ENVD_VERSION,
        "buildStatus": "ready",
    })
}

/// `GET /sandboxes/{id}/metrics` item.
pub fn metric_json(m: &MetricSample) -> Value {
    json!({
        "timestamp": ts(m.timestamp_ms),
        "timestampUnix": m.timestamp_ms.div_euclid(1000),
        "cpuCount": m.cpu_count,
        "cpuUsedPct": m.cpu_used_pct,
        "memUsed": m.mem_used,
        "memTotal": m.mem_total,
        "memCache": m.mem_cache,
        "diskUsed": m.disk_used,
        "diskTotal": m.disk_total,
    })
}

/// A snapshot (`SnapshotInfo`, plus where it came from and its disk use).
pub fn snapshot_json(s: &SnapshotRecord) -> Value {
    let names: Vec<String> = s.name.iter().map(|n| format!("{n}:default")).collect();
    json!({
        "snapshotID": crate::manager::tagged(&s.id),
        "names": names,
        "sandboxID": s.sandbox_id,
        "templateID": s.template_id,
        "createdAt": ts(s.created_at_ms),
        "sizeBytes": s.size_bytes,
    })
}
