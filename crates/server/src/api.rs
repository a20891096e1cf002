//! The REST API (the routes and JSON shapes of E2B's API that the `e2b` SDK uses), the auth
//! layer, and the entry point that sends sandbox-addressed traffic to the envd proxy.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use axum::{Json, Router};
use base64::Engine;
use chrono::{SecondsFormat, TimeZone, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::auth;
use crate::error::ApiError;
use crate::manager::{CreateParams, Manager};
use crate::routing;
use crate::store::{SandboxRecord, SandboxState};

/// The OpenAPI document of kiln's API (also served at `/openapi.json`).
pub const OPENAPI: &str = include_str!("../openapi.json");

/// Every (method, path) the router serves, in axum path syntax. Kept in sync with the router
/// and with `openapi.json` by tests.
pub const ROUTES: &[(&str, &str)] = &[
    ("GET", "/health"),
    ("GET", "/openapi.json"),
    ("POST", "/sandboxes"),
    ("GET", "/sandboxes"),
    ("POST", "/v2/sandboxes"),
    ("GET", "/v2/sandboxes"),
    ("GET", "/sandboxes/metrics"),
    ("GET", "/sandboxes/{sandboxID}"),
    ("DELETE", "/sandboxes/{sandboxID}"),
    ("POST", "/sandboxes/{sandboxID}/timeout"),
    ("POST", "/sandboxes/{sandboxID}/connect"),
    ("POST", "/v2/sandboxes/{sandboxID}/connect"),
    ("POST", "/sandboxes/{sandboxID}/refreshes"),
    ("GET", "/sandboxes/{sandboxID}/metrics"),
    ("GET", "/sandboxes/{sandboxID}/logs"),
    ("GET", "/v2/sandboxes/{sandboxID}/logs"),
    ("POST", "/sandboxes/{sandboxID}/pause"),
    ("POST", "/sandboxes/{sandboxID}/resume"),
    ("POST", "/sandboxes/{sandboxID}/fork"),
    ("POST", "/sandboxes/{sandboxID}/snapshots"),
    ("PUT", "/sandboxes/{sandboxID}/network"),
    ("GET", "/templates"),
    ("GET", "/templates/{templateID}"),
];

/// Server-wide settings the API needs.
#[derive(Debug, Clone)]
pub struct ApiConfig {
    /// Domain of sandbox host names (`{port}-{id}.{domain}`).
    pub domain: String,
}

pub struct AppState {
    pub manager: Arc<Manager>,
    pub cfg: ApiConfig,
}

type St = State<Arc<AppState>>;
type ApiResult<T> = Result<T, ApiError>;

fn ts(ms: i64) -> String {
    Utc.timestamp_millis_opt(ms)
        .single()
        .unwrap_or_default()
        .to_rfc3339_opts(SecondsFormat::Millis, true)
}

fn parse_json<T: serde::de::DeserializeOwned>(
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

// ---------- wire shapes ----------

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct NewSandbox {
    #[serde(rename = "templateID")]
    template_id: String,
    timeout: Option<i64>,
    auto_pause: Option<bool>,
    secure: Option<bool>,
    #[serde(rename = "allow_internet_access")]
    allow_internet_access: Option<bool>,
    metadata: Option<BTreeMap<String, String>>,
    env_vars: Option<BTreeMap<String, String>>,
    mcp: Option<Value>,
    volume_mounts: Option<Vec<Value>>,
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

fn sandbox_json(r: &SandboxRecord, domain: &str) -> SandboxJson {
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

fn listed_json(r: &SandboxRecord) -> Value {
    json!({
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
    })
}

fn detail_json(r: &SandboxRecord, domain: &str) -> Value {
    let mut v = listed_json(r);
    v["envdAccessToken"] = json!(r.envd_token);
    v["domain"] = json!(domain);
    v["allowInternetAccess"] = json!(false);
    v
}

// ---------- handlers ----------

async fn health() -> StatusCode {
    StatusCode::OK
}

async fn openapi() -> Response {
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        OPENAPI,
    )
        .into_response()
}

async fn create_sandbox(State(st): St, body: Bytes) -> ApiResult<Response> {
    let req: NewSandbox = parse_json(&body, false)?.expect("not empty");
    if req.allow_internet_access == Some(true) {
        return Err(ApiError::not_implemented(
            "sandbox internet access (allow_internet_access=true; sandboxes have no network yet)",
        ));
    }
    if req.mcp.as_ref().is_some_and(|m| !m.is_null()) {
        return Err(ApiError::not_implemented("MCP gateway (mcp)"));
    }
    if req.volume_mounts.as_ref().is_some_and(|v| !v.is_empty()) {
        return Err(ApiError::not_implemented("volume mounts (volumeMounts)"));
    }
    // Run the creation in its own task: a client that disconnects mid-create must not leave a
    // half-started sandbox behind (hyper drops the handler future on disconnect).
    let manager = st.manager.clone();
    let params = CreateParams {
        template_id: req.template_id,
        timeout_secs: req.timeout,
        metadata: req.metadata.unwrap_or_default(),
        env_vars: req.env_vars.unwrap_or_default(),
        secure: req.secure.unwrap_or(true),
        auto_pause: req.auto_pause.unwrap_or(false),
        allow_internet_access: req.allow_internet_access,
    };
    let rec = tokio::spawn(async move { manager.create(params).await })
        .await
        .map_err(|e| ApiError::internal(format!("create task: {e}")))??;
    Ok((
        StatusCode::CREATED,
        Json(sandbox_json(&rec, &st.cfg.domain)),
    )
        .into_response())
}

#[derive(Debug, Deserialize)]
struct ListQuery {
    metadata: Option<String>,
    state: Option<String>,
    #[serde(rename = "nextToken")]
    next_token: Option<String>,
    limit: Option<String>,
    order: Option<String>,
    template: Option<String>,
}

fn percent_decode(s: &str) -> ApiResult<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' => {
                let hex = b
                    .get(i + 1..i + 3)
                    .and_then(|h| std::str::from_utf8(h).ok())
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                    .ok_or_else(|| {
                        ApiError::bad_request(format!("bad percent-encoding in {s:?}"))
                    })?;
                out.push(hex);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).map_err(|_| ApiError::bad_request(format!("{s:?} is not UTF-8")))
}

/// Parses the `metadata` filter: a URL-encoded `k=v&k2=v2` string.
pub fn parse_metadata_filter(s: &str) -> ApiResult<BTreeMap<String, String>> {
    let mut m = BTreeMap::new();
    for kv in s.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = kv.split_once('=').ok_or_else(|| {
            ApiError::bad_request(format!("metadata filter {kv:?} must be key=value"))
        })?;
        m.insert(percent_decode(k)?, percent_decode(v)?);
    }
    Ok(m)
}

fn matches_metadata(r: &SandboxRecord, filter: &BTreeMap<String, String>) -> bool {
    filter.iter().all(|(k, v)| r.metadata.get(k) == Some(v))
}

async fn list_v1(State(st): St, Query(q): Query<ListQuery>) -> ApiResult<Json<Vec<Value>>> {
    let filter = q
        .metadata
        .as_deref()
        .map(parse_metadata_filter)
        .transpose()?
        .unwrap_or_default();
    Ok(Json(
        st.manager
            .list_live()
            .iter()
            .filter(|r| matches_metadata(r, &filter))
            .map(listed_json)
            .collect(),
    ))
}

fn encode_cursor(r: &SandboxRecord) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(format!("{}:{}", r.started_at_ms, r.id))
}

fn decode_cursor(s: &str) -> ApiResult<(i64, String)> {
    let bad = || ApiError::bad_request(format!("invalid nextToken {s:?}"));
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(s)
        .map_err(|_| bad())?;
    let raw = String::from_utf8(raw).map_err(|_| bad())?;
    let (ms, id) = raw.split_once(':').ok_or_else(bad)?;
    Ok((ms.parse().map_err(|_| bad())?, id.to_string()))
}

async fn list_v2(State(st): St, Query(q): Query<ListQuery>) -> ApiResult<Response> {
    let filter = q
        .metadata
        .as_deref()
        .map(parse_metadata_filter)
        .transpose()?
        .unwrap_or_default();
    let mut states = Vec::new();
    if let Some(s) = q.state.as_deref() {
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            match part {
                "running" => states.push(SandboxState::Running),
                "paused" => states.push(SandboxState::Paused),
                other => {
                    return Err(ApiError::bad_request(format!(
                        "unknown sandbox state {other:?}: use running or paused"
                    )))
                }
            }
        }
    }
    let limit: usize = match q.limit.as_deref() {
        None => 100,
        Some(l) => l
            .parse()
            .ok()
            .filter(|n| (1..=1000).contains(n))
            .ok_or_else(|| ApiError::bad_request(format!("limit must be 1-1000, got {l:?}")))?,
    };
    let desc = match q.order.as_deref() {
        None | Some("asc") => false,
        Some("desc") => true,
        Some(o) => {
            return Err(ApiError::bad_request(format!(
                "order must be asc or desc, got {o:?}"
            )))
        }
    };
    let cursor = q
        .next_token
        .as_deref()
        .filter(|t| !t.is_empty())
        .map(decode_cursor)
        .transpose()?;
    let mut all: Vec<SandboxRecord> = st
        .manager
        .list_live()
        .into_iter()
        .filter(|r| states.is_empty() || states.contains(&r.state))
        .filter(|r| matches_metadata(r, &filter))
        .filter(|r| q.template.as_deref().is_none_or(|t| r.template_id == t))
        .collect();
    if desc {
        all.reverse();
    }
    if let Some((ms, id)) = cursor {
        let key = (ms, id);
        all.retain(|r| {
            let k = (r.started_at_ms, r.id.clone());
            if desc {
                k < key
            } else {
                k > key
            }
        });
    }
    let more = all.len() > limit;
    all.truncate(limit);
    let mut resp = Json(all.iter().map(listed_json).collect::<Vec<_>>()).into_response();
    if more {
        if let Some(last) = all.last() {
            if let Ok(v) = encode_cursor(last).parse() {
                resp.headers_mut().insert("x-next-token", v);
            }
        }
    }
    Ok(resp)
}

async fn get_sandbox(State(st): St, Path(id): Path<String>) -> ApiResult<Json<Value>> {
    let r = st.manager.get_live(&id)?;
    Ok(Json(detail_json(&r, &st.cfg.domain)))
}

async fn kill_sandbox(State(st): St, Path(id): Path<String>) -> ApiResult<StatusCode> {
    let manager = st.manager.clone();
    let sid = id.clone();
    let killed = tokio::spawn(async move { manager.kill(&sid, "killed by request").await })
        .await
        .map_err(|e| ApiError::internal(format!("kill task: {e}")))??;
    if killed {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::sandbox_not_found(&id))
    }
}

#[derive(Deserialize)]
struct TimeoutBody {
    timeout: i64,
}

async fn set_timeout(State(st): St, Path(id): Path<String>, body: Bytes) -> ApiResult<StatusCode> {
    let b: TimeoutBody = parse_json(&body, false)?.expect("not empty");
    st.manager.set_timeout(&id, b.timeout)?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize, Default)]
struct ConnectBody {
    timeout: Option<i64>,
}

async fn connect(
    State(st): St,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult<Json<SandboxJson>> {
    let b: ConnectBody = parse_json(&body, true)?.unwrap_or_default();
    // Validate before looking the sandbox up, so bad input is a 400 even for unknown ids.
    let secs = b
        .timeout
        .unwrap_or(st.manager.config().default_timeout_secs as i64);
    st.manager.check_timeout(secs)?;
    let r = st.manager.extend(&id, secs, "connected")?;
    Ok(Json(sandbox_json(&r, &st.cfg.domain)))
}

#[derive(Deserialize, Default)]
struct RefreshBody {
    duration: Option<i64>,
}

async fn refresh(State(st): St, Path(id): Path<String>, body: Bytes) -> ApiResult<StatusCode> {
    let b: RefreshBody = parse_json(&body, true)?.unwrap_or_default();
    let secs = b
        .duration
        .unwrap_or(st.manager.config().default_timeout_secs as i64);
    st.manager.extend(&id, secs, "refreshed")?;
    Ok(StatusCode::NO_CONTENT)
}

async fn metrics(State(st): St, Path(id): Path<String>) -> ApiResult<Json<Vec<Value>>> {
    let r = st.manager.get_live(&id)?;
    let stats = st.manager.driver().stats(&id).await?;
    let pct = st.manager.cpu_pct(&id, stats.cpu_ns, r.cpu_count);
    let (disk_used, disk_total) = match st.manager.route(&id) {
        Some(route) => {
            match crate::agent_http::metrics(&route.socket, route.envd_token.as_deref()).await {
                Ok(m) => (m.disk_used, m.disk_total),
                Err(_) => (0, u64::from(r.disk_size_mb) << 20),
            }
        }
        None => (0, 0),
    };
    let now = Utc::now();
    let mem_total = if stats.mem_limit_bytes > 0 && stats.mem_limit_bytes < u64::MAX / 2 {
        stats.mem_limit_bytes
    } else {
        u64::from(r.memory_mb) << 20
    };
    Ok(Json(vec![json!({
        "timestamp": now.to_rfc3339_opts(SecondsFormat::Millis, true),
        "timestampUnix": now.timestamp(),
        "cpuCount": r.cpu_count,
        "cpuUsedPct": pct,
        "memUsed": stats.mem_used_bytes,
        "memTotal": mem_total,
        "memCache": 0,
        "diskUsed": disk_used,
        "diskTotal": disk_total,
    })]))
}

async fn logs(st: St, id: Path<String>) -> ApiResult<Json<Value>> {
    let (logs, entries) = collect_logs(st, id).await?;
    Ok(Json(json!({"logs": logs, "logEntries": entries})))
}

/// `GET /v2/sandboxes/{id}/logs`: structured entries only.
async fn logs_v2(st: St, id: Path<String>) -> ApiResult<Json<Value>> {
    let (_, entries) = collect_logs(st, id).await?;
    Ok(Json(json!({ "logs": entries })))
}

async fn collect_logs(
    State(st): St,
    Path(id): Path<String>,
) -> ApiResult<(Vec<Value>, Vec<Value>)> {
    let rec = st
        .manager
        .store()
        .get_sandbox(&id)?
        .ok_or_else(|| ApiError::sandbox_not_found(&id))?;
    let mut logs = Vec::new();
    let mut entries = Vec::new();
    for e in st.manager.store().events(&id)? {
        let line = format!("{}: {}", e.kind, e.detail);
        logs.push(json!({"timestamp": ts(e.ts_ms), "line": line}));
        entries.push(json!({
            "timestamp": ts(e.ts_ms),
            "level": if e.kind == "failed" { "error" } else { "info" },
            "message": line,
            "fields": {"event": e.kind, "sandboxID": id},
        }));
    }
    if rec.state.is_live() {
        let console = st
            .manager
            .driver()
            .console_log(&id, 64 * 1024)
            .await
            .unwrap_or_default();
        let now = ts(crate::store::now_ms());
        for line in console.lines().filter(|l| !l.trim().is_empty()) {
            logs.push(json!({"timestamp": now, "line": line}));
            entries.push(json!({
                "timestamp": now, "level": "info", "message": line,
                "fields": {"source": "agent", "sandboxID": id},
            }));
        }
    }
    Ok((logs, entries))
}

async fn not_impl_for_sandbox(
    State(st): St,
    Path(id): Path<String>,
    method: Method,
    uri: axum::http::Uri,
) -> ApiResult<StatusCode> {
    st.manager.get_live(&id)?;
    let feature = match uri.path().rsplit('/').next().unwrap_or("") {
        "pause" => "pausing sandboxes",
        "resume" => "resuming sandboxes",
        "fork" => "forking sandboxes",
        "snapshots" => "sandbox snapshots",
        "network" => "sandbox network configuration",
        _ => "this operation",
    };
    Err(ApiError::not_implemented(&format!(
        "{feature} ({method} {})",
        uri.path()
    )))
}

async fn bulk_metrics() -> ApiResult<StatusCode> {
    Err(ApiError::not_implemented(
        "bulk sandbox metrics (GET /sandboxes/metrics)",
    ))
}

fn template_json(t: &crate::templates::TemplateInfo, st: &AppState) -> Value {
    let rec = st.manager.store().get_template(&t.name).ok().flatten();
    let built = ts(t.built_at_unix as i64 * 1000);
    let cfg = st.manager.config();
    json!({
        "templateID": t.name,
        "buildID": t.key,
        "cpuCount": cfg.default_cpu_count,
        "memoryMB": cfg.default_memory_mb,
        "diskSizeMB": (t.size_bytes >> 20).max(u64::from(cfg.default_disk_mb)),
        "public": false,
        "aliases": [t.name],
        "names": [t.name],
        "createdAt": built,
        "updatedAt": built,
        "createdBy": null,
        "lastSpawnedAt": rec.as_ref().and_then(|r| r.last_spawned_ms).map(ts),
        "spawnCount": rec.as_ref().map(|r| r.spawn_count).unwrap_or(0),
        "buildCount": 1,
        "envdVersion": kiln_proto::envd::ENVD_VERSION,
        "buildStatus": "ready",
    })
}

async fn list_templates(State(st): St) -> ApiResult<Json<Vec<Value>>> {
    let t = st.manager.templates().clone();
    let list = tokio::task::spawn_blocking(move || t.list())
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?
        .map_err(|e| ApiError::internal(format!("listing templates: {e}")))?;
    Ok(Json(list.iter().map(|t| template_json(t, &st)).collect()))
}

async fn get_template(State(st): St, Path(name): Path<String>) -> ApiResult<Json<Value>> {
    let t = st.manager.templates().clone();
    let n = name.clone();
    let found = tokio::task::spawn_blocking(move || t.lookup(&n))
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?
        .map_err(|e| ApiError::internal(format!("looking up template: {e}")))?
        .ok_or_else(|| ApiError::not_found(format!("template \"{name}\" not found")))?;
    Ok(Json(template_json(&found, &st)))
}

/// Paths of E2B's API that kiln knows but does not implement.
const E2B_PREFIXES: &[&str] = &[
    "/sandboxes",
    "/v2/sandboxes",
    "/templates",
    "/v2/templates",
    "/v3/templates",
    "/snapshots",
    "/secrets",
    "/volumes",
    "/teams",
    "/access-tokens",
    "/api-keys",
    "/nodes",
    "/admin",
];

async fn fallback(method: Method, uri: axum::http::Uri) -> ApiError {
    let path = uri.path();
    if E2B_PREFIXES
        .iter()
        .any(|p| path == *p || path.starts_with(&format!("{p}/")))
    {
        ApiError::not_implemented(&format!("{method} {path}"))
    } else {
        ApiError::not_found(format!("unknown route {method} {path}"))
    }
}

async fn method_not_allowed(method: Method, uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("{method} is not allowed on {}", uri.path()),
    )
}

// ---------- layers ----------

async fn require_api_key(State(st): St, req: Request, next: Next) -> Response {
    let path = req.uri().path();
    if path == "/health" || path == "/openapi.json" {
        return next.run(req).await;
    }
    let headers: &HeaderMap = req.headers();
    let key = headers
        .get(auth::API_KEY_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .or_else(|| {
            headers
                .get(axum::http::header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
                .map(str::to_string)
        });
    let store = st.manager.store().clone();
    let verdict = tokio::task::spawn_blocking(move || auth::verify(&store, key.as_deref())).await;
    match verdict {
        Ok(Ok(Ok(_))) => next.run(req).await,
        Ok(Ok(Err(e))) => ApiError::unauthorized(e.to_string()).into_response(),
        Ok(Err(e)) => ApiError::from(e).into_response(),
        Err(e) => ApiError::internal(format!("auth task: {e}")).into_response(),
    }
}

async fn route_sandbox_traffic(State(st): St, req: Request, next: Next) -> Response {
    match routing::target_of(req.headers(), &st.cfg.domain) {
        Ok(Some(target)) => crate::proxy::forward(&st.manager, target, req).await,
        Ok(None) => next.run(req).await,
        Err(e) => ApiError::bad_request(e.to_string()).into_response(),
    }
}

/// The whole HTTP service: envd proxy in front, then auth, then the API routes.
pub fn router(state: Arc<AppState>) -> Router {
    let sbx = "/sandboxes/{sandboxID}";
    let api = Router::new()
        .route("/health", get(health))
        .route("/openapi.json", get(openapi))
        .route("/sandboxes", post(create_sandbox).get(list_v1))
        .route("/v2/sandboxes", post(create_sandbox).get(list_v2))
        .route("/sandboxes/metrics", get(bulk_metrics))
        .route(sbx, get(get_sandbox).delete(kill_sandbox))
        .route(&format!("{sbx}/timeout"), post(set_timeout))
        .route(&format!("{sbx}/connect"), post(connect))
        .route("/v2/sandboxes/{sandboxID}/connect", post(connect))
        .route(&format!("{sbx}/refreshes"), post(refresh))
        .route(&format!("{sbx}/metrics"), get(metrics))
        .route(&format!("{sbx}/logs"), get(logs))
        .route("/v2/sandboxes/{sandboxID}/logs", get(logs_v2))
        .route(&format!("{sbx}/pause"), post(not_impl_for_sandbox))
        .route(&format!("{sbx}/resume"), post(not_impl_for_sandbox))
        .route(&format!("{sbx}/fork"), post(not_impl_for_sandbox))
        .route(&format!("{sbx}/snapshots"), post(not_impl_for_sandbox))
        .route(
            &format!("{sbx}/network"),
            axum::routing::put(not_impl_for_sandbox),
        )
        .route("/templates", get(list_templates))
        .route("/templates/{templateID}", get(get_template))
        .fallback(any(fallback))
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ));
    api.layer(middleware::from_fn_with_state(
        state.clone(),
        route_sandbox_traffic,
    ))
    .with_state(state)
}
