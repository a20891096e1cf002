//! Sandbox routes: create, get, kill, timeouts, connect, metrics, logs and the lifecycle
//! operations (pause, resume, snapshots, fork, network) — each one call into the manager.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Extension;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::wire::{detail_json, parse_json, sandbox_json, ts, NewSandbox};
use super::{ApiError, ApiResult, AppState, St};
use crate::manager::CreateParams;
use crate::tenancy::Caller;
use crate::SandboxService;

/// The caller of a request (set by the auth layer).
type Who = Extension<Caller>;

pub async fn create_sandbox(
    State(st): St,
    Extension(c): Who,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> ApiResult<Response> {
    let key = super::idempotency::key_of(&headers)?;
    let Some(key) = key else {
        return create_inner(st, c, body, None).await;
    };
    let scope = format!("{}/create", c.team);
    let keyed = Some(format!("{scope}/{key}"));
    let work = Box::pin(create_inner(st.clone(), c, body.clone(), keyed));
    Ok(st.idempotency.run(scope, key, &body, work).await)
}

async fn create_inner(
    st: std::sync::Arc<super::AppState>,
    c: Caller,
    body: Bytes,
    idempotency: Option<String>,
) -> ApiResult<Response> {
    let req: NewSandbox =
        parse_json(&body, false)?.ok_or_else(|| ApiError::bad_request("request body is empty"))?;
    // A create from a snapshot naming no network settings of its own gets the snapshot's.
    let inherited = match (req.allow_internet_access, &req.network) {
        (None, None) => super::net_inherit::of_snapshot(&st, &c.team, &req.template_id).await?,
        _ => None,
    };
    let (internet, net_raw) = match &inherited {
        Some((i, v)) => (Some(*i), Some(v.clone())),
        None => (
            req.allow_internet_access,
            serde_json::from_slice::<Value>(&body)
                .ok()
                .and_then(|v| v.get("network").cloned()),
        ),
    };
    let net_req = match &inherited {
        Some((_, v)) => Some(
            serde_json::from_value::<super::network::NetworkJson>(v.clone())
                .map_err(|e| ApiError::internal(format!("the snapshot's network settings: {e}")))?,
        ),
        None => req.network,
    };
    let network = super::network::policy_of(internet, net_req.as_ref())?;
    let tokens = crate::identity::parse_iam(req.iam.as_ref()).map_err(ApiError::bad_request)?;
    if !tokens.is_empty() && st.identity.is_none() {
        return Err(ApiError::not_implemented(
            "workload identity tokens on a server without its identity key",
        ));
    }
    let network =
        super::rules::with_rules(&st, &c.team, net_req.as_ref(), &tokens, network).await?;
    let ingress = super::network::ingress_of(net_req.as_ref())?;
    let traffic_token = ingress.traffic_token.clone();
    let keep_network = !tokens.is_empty()
        || network
            .as_ref()
            .is_some_and(|p| p.transforms.is_some() || p.egress_proxy.is_some());
    // A cluster's node attaches them (see `net_forwarded`).
    let network_settings = st
        .manager
        .forwards_network_settings()
        .then(|| {
            let iam = req.iam.as_ref().filter(|_| !tokens.is_empty());
            super::net_persist::settings_of(net_raw.as_ref(), iam)
        })
        .flatten();
    let team = c.team.clone();
    let mcp = req.mcp.clone().filter(|m| !m.is_null());
    if mcp.as_ref().is_some_and(|m| !m.is_object()) {
        return Err(ApiError::bad_request(
            "mcp: expected an object of MCP servers",
        ));
    }
    let mut env_vars = req.env_vars.unwrap_or_default();
    super::host_trust::trust_env(st.manager.extra_cas(), &mut env_vars);
    let asked = super::volumes::mounts_of(req.volume_mounts.as_ref())?;
    let volume_mounts = st.manager.resolve_mounts(&c.team, &asked).await?;
    // Run the creation in its own task: a client that disconnects mid-create must not leave a
    // half-started sandbox behind (hyper drops the handler future on disconnect).
    let manager = st.manager.clone();
    let metadata = req.metadata.unwrap_or_default();
    if crate::tplbuild::is_build_sandbox(&metadata) {
        return Err(ApiError::bad_request(format!(
            "metadata key {:?} is reserved for kiln's template builds",
            crate::tplbuild::BUILD_META
        )));
    }
    // A template the team built through the Template API starts from its last layer.
    let built = super::template_api::resolve_for_create(&st, &c.team, &req.template_id).await?;
    if built.is_none() {
        super::template_api::check_direct_create(&st, &req.template_id).await?;
    }
    let params = CreateParams {
        template_id: built
            .as_ref()
            .map(|b| b.template_id.clone())
            .unwrap_or(req.template_id),
        timeout_secs: req.timeout,
        metadata,
        env_vars,
        secure: req.secure.unwrap_or(true),
        auto_pause: req.auto_pause.unwrap_or(false),
        auto_resume: req.auto_resume.as_ref().is_some_and(|a| a.enabled),
        auto_pause_filesystem_only: req.auto_pause_memory == Some(false),
        allow_internet_access: internet,
        network,
        ingress,
        team: c.team,
        volume_mounts,
        idempotency,
        network_settings,
    };
    let t = std::time::Instant::now();
    let rec = tokio::spawn(async move { manager.create(params).await })
        .await
        .map_err(|e| ApiError::internal(format!("create task: {e}")))??;
    st.telemetry.observe("create", t.elapsed());
    if let Some(b) = &built {
        super::template_api::apply_defaults(&st, &rec, b).await?;
    }
    if let (Some(m), Some((_, db))) = (&mcp, st.settings_db()) {
        db.put_mcp(&rec.id, m).await.map_err(|e| {
            ApiError::internal(format!("storing the sandbox's mcp configuration: {e}"))
        })?;
    }
    if keep_network {
        let iam = req.iam.as_ref().filter(|_| !tokens.is_empty());
        super::net_persist::remember(&st, &rec.id, &team, net_raw.as_ref(), iam).await?;
    }
    let mut created = sandbox_json(&rec, &st.cfg.domain);
    created.traffic_access_token = traffic_token;
    Ok((StatusCode::CREATED, Json(created)).into_response())
}

pub async fn get_sandbox(
    State(st): St,
    Extension(c): Who,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    let r = st.manager.get_for(&id, &c.team)?;
    let mut v = detail_json(&r, &st.cfg.domain, st.manager.standby_since(&id));
    let (policy, shown) = st.manager.network_shown(&id).await?;
    let (internet, mut network) = super::network::info(policy.as_ref(), &r.ingress);
    if let (Some(Value::Object(extra)), Some(n)) = (shown, network.as_object_mut()) {
        n.extend(extra);
    }
    v["allowInternetAccess"] = json!(internet);
    // No network: no `network` key (the e2b SDK cannot parse a null one).
    if !network.is_null() {
        v["network"] = network;
    }
    if let Some(m) = super::volumes::info(&st, &id).await? {
        v["volumeMounts"] = m;
    }
    if let Some((_, db)) = st.settings_db() {
        if let Some(m) = db.get_mcp(&id).await.map_err(|e| {
            ApiError::internal(format!("reading the sandbox's mcp configuration: {e}"))
        })? {
            v["mcp"] = m;
        }
    }
    Ok(Json(v))
}

pub async fn kill_sandbox(
    State(st): St,
    Extension(c): Who,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    st.manager.get_for(&id, &c.team)?;
    let manager = st.manager.clone();
    let sid = id.clone();
    let killed =
        tokio::spawn(async move { manager.kill_detached(&sid, "killed by request").await })
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

pub async fn set_timeout(
    State(st): St,
    Extension(c): Who,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult<StatusCode> {
    let b: TimeoutBody =
        parse_json(&body, false)?.ok_or_else(|| ApiError::bad_request("request body is empty"))?;
    if b.timeout == 0 {
        // E2B: a timeout of 0 applies the timeout action now (kill, or pause with autoPause).
        st.manager.get_for(&id, &c.team)?;
        let manager = st.manager.clone();
        tokio::spawn(async move { manager.expire_now(&id).await })
            .await
            .map_err(|e| ApiError::internal(format!("timeout task: {e}")))??;
        return Ok(StatusCode::NO_CONTENT);
    }
    st.manager.check_timeout(b.timeout)?;
    st.manager.get_for(&id, &c.team)?;
    st.manager.check_team_timeout(&c.team, b.timeout).await?;
    st.manager.set_timeout(&id, b.timeout).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// The body of `connect` and `resume`.
#[derive(Deserialize, Default)]
struct ResumeBody {
    timeout: Option<i64>,
    /// false: resume a paused sandbox by booting it on its saved disk.
    memory: Option<bool>,
}

/// Runs `resume` (given the timeout and whether to restore memory) once the body is valid and
/// the caller's team may see sandbox `id` with that timeout, and returns what it returned. It
/// runs on its own task: a client that gives up mid-resume must not cut a resume in half.
async fn resuming<F, Fut, T>(
    st: &AppState,
    c: &Caller,
    id: &str,
    body: &Bytes,
    resume: F,
) -> ApiResult<T>
where
    F: FnOnce(Arc<dyn SandboxService>, i64, bool) -> Fut,
    Fut: std::future::Future<Output = Result<T, crate::Error>> + Send + 'static,
    T: Send + 'static,
{
    let b: ResumeBody = parse_json(body, true)?.unwrap_or_default();
    // Validate before looking the sandbox up, so bad input is a 400 even for unknown ids.
    let secs = b
        .timeout
        .unwrap_or(st.manager.config().default_timeout_secs as i64);
    st.manager.check_timeout(secs)?;
    st.manager.get_for(id, &c.team)?;
    st.manager.check_team_timeout(&c.team, secs).await?;
    let fut = resume(st.manager.clone(), secs, b.memory.unwrap_or(true));
    Ok(tokio::spawn(fut)
        .await
        .map_err(|e| ApiError::internal(format!("resume task: {e}")))??)
}

/// `POST /v2/sandboxes/{id}/connect`: 201 when it resumed a paused sandbox, 200 when the
/// sandbox was running (its timeout is extended).
pub async fn connect(
    State(st): St,
    Extension(c): Who,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult<Response> {
    let t = std::time::Instant::now();
    let sid = id.clone();
    let (r, resumed) = resuming(&st, &c, &id, &body, |m, secs, memory| async move {
        m.connect(&sid, secs, memory).await
    })
    .await?;
    if resumed {
        st.telemetry.observe("resume", t.elapsed());
    }
    let status = if resumed {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(sandbox_json(&r, &st.cfg.domain))).into_response())
}

#[derive(Deserialize, Default)]
struct RefreshBody {
    duration: Option<i64>,
}

pub async fn refresh(
    State(st): St,
    Extension(c): Who,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult<StatusCode> {
    let b: RefreshBody = parse_json(&body, true)?.unwrap_or_default();
    let secs = b
        .duration
        .unwrap_or(st.manager.config().default_timeout_secs as i64);
    st.manager.check_timeout(secs)?;
    st.manager.get_for(&id, &c.team)?;
    st.manager.check_team_timeout(&c.team, secs).await?;
    st.manager.extend(&id, secs, "refreshed").await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `GET /sandboxes/{id}/logs`: plain lines and structured entries.
pub async fn logs(st: St, c: Who, id: Path<String>) -> ApiResult<Json<Value>> {
    let (logs, entries) = collect_logs(st, c, id).await?;
    Ok(Json(json!({"logs": logs, "logEntries": entries})))
}

/// `GET /v2/sandboxes/{id}/logs`: structured entries only.
pub async fn logs_v2(st: St, c: Who, id: Path<String>) -> ApiResult<Json<Value>> {
    let (_, entries) = collect_logs(st, c, id).await?;
    Ok(Json(json!({ "logs": entries })))
}

async fn collect_logs(
    State(st): St,
    Extension(c): Who,
    Path(id): Path<String>,
) -> ApiResult<(Vec<Value>, Vec<Value>)> {
    let l = st.manager.logs(&id, &c.team).await?;
    let mut logs = Vec::new();
    let mut entries = Vec::new();
    for e in &l.events {
        let line = format!("{}: {}", e.kind, e.detail);
        logs.push(json!({"timestamp": ts(e.ts_ms), "line": line}));
        entries.push(json!({
            "timestamp": ts(e.ts_ms),
            "level": if e.kind == "failed" { "error" } else { "info" },
            "message": line,
            "fields": {"event": e.kind, "sandboxID": id},
        }));
    }
    if let Some(console) = &l.console {
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

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct PauseBody {
    /// false: keep the filesystem only (default: memory and processes too).
    memory: Option<bool>,
    /// true: refuse (409) unless the sandbox's agent answers its health check.
    require_healthy_guest: Option<bool>,
}

/// `POST /sandboxes/{id}/pause`: 204, 409 when already paused (or, with
/// `requireHealthyGuest`, when its guest does not answer).
pub async fn pause(
    State(st): St,
    Extension(c): Who,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult<StatusCode> {
    let b: PauseBody = parse_json(&body, true)?.unwrap_or_default();
    st.manager.get_for(&id, &c.team)?;
    let manager = st.manager.clone();
    let (memory, healthy) = (
        b.memory.unwrap_or(true),
        b.require_healthy_guest.unwrap_or(false),
    );
    let t = std::time::Instant::now();
    tokio::spawn(async move { manager.pause_checked(&id, memory, healthy).await })
        .await
        .map_err(|e| ApiError::internal(format!("pause task: {e}")))??;
    st.telemetry.observe("pause", t.elapsed());
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /sandboxes/{id}/resume` (deprecated; `connect` replaces it): 201, 409 when the
/// sandbox is not paused.
pub async fn resume(
    State(st): St,
    Extension(c): Who,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult<Response> {
    let t = std::time::Instant::now();
    let sid = id.clone();
    let resumed = resuming(&st, &c, &id, &body, |m, secs, memory| async move {
        m.resume(&sid, memory, secs).await
    })
    .await?;
    if resumed {
        st.telemetry.observe("resume", t.elapsed());
    }
    if !resumed {
        return Err(ApiError::conflict(format!(
            "sandbox \"{id}\" is already running"
        )));
    }
    let r = st.manager.get(&id)?;
    Ok((StatusCode::CREATED, Json(sandbox_json(&r, &st.cfg.domain))).into_response())
}

#[derive(Deserialize, Default)]
struct SnapshotBody {
    name: Option<String>,
    /// false (`mode: "filesystem"`): the disk only; sandboxes from it boot fresh.
    memory: Option<bool>,
}

/// `POST /sandboxes/{id}/snapshots`: 201 `{snapshotID, names}`; the sandbox keeps running.
pub async fn snapshot(
    State(st): St,
    Extension(c): Who,
    Path(id): Path<String>,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> ApiResult<Response> {
    let key = super::idempotency::key_of(&headers)?;
    let Some(key) = key else {
        return snapshot_inner(st, c, id, body).await;
    };
    let scope = format!("{}/snapshot/{id}", c.team);
    let work = Box::pin(snapshot_inner(st.clone(), c, id, body.clone()));
    Ok(st.idempotency.run(scope, key, &body, work).await)
}

async fn snapshot_inner(
    st: std::sync::Arc<super::AppState>,
    c: Caller,
    id: String,
    body: Bytes,
) -> ApiResult<Response> {
    let b: SnapshotBody = parse_json(&body, true)?.unwrap_or_default();
    let manager = st.manager.clone();
    let memory = b.memory.unwrap_or(true);
    let (sid, team) = (id.clone(), c.team.clone());
    let snap =
        tokio::spawn(async move { manager.snapshot_with(&sid, &team, b.name, memory).await })
            .await
            .map_err(|e| ApiError::internal(format!("snapshot task: {e}")))??;
    super::net_inherit::snapshot_taken(&st, &id, &snap.id, &c.team).await?;
    Ok((StatusCode::CREATED, Json(super::wire::snapshot_json(&snap))).into_response())
}

#[derive(Deserialize, Default)]
struct ForkBody {
    timeout: Option<i64>,
    count: Option<u32>,
}

/// `POST /sandboxes/{id}/fork`: 201 with one `{sandbox}` or `{error: {code, message}}` per
/// child.
pub async fn fork(
    State(st): St,
    Extension(c): Who,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult<Response> {
    let b: ForkBody = parse_json(&body, true)?.unwrap_or_default();
    st.manager.get_for(&id, &c.team)?;
    if let Some(secs) = b.timeout {
        st.manager.check_team_timeout(&c.team, secs).await?;
    }
    st.manager
        .check_team_room(&c.team, b.count.unwrap_or(1) as usize)
        .await?;
    let manager = st.manager.clone();
    let t = std::time::Instant::now();
    let parent = id.clone();
    let children =
        tokio::spawn(async move { manager.fork(&id, b.count.unwrap_or(1), b.timeout).await })
            .await
            .map_err(|e| ApiError::internal(format!("fork task: {e}")))??;
    st.telemetry.observe("fork", t.elapsed());
    for child in children.iter().flatten() {
        super::net_inherit::fork_child(&st, &parent, &child.id, &c.team).await?;
    }
    let list: Vec<Value> = children
        .into_iter()
        .map(|c| match c {
            Ok(r) => json!({ "sandbox": sandbox_json(&r, &st.cfg.domain) }),
            Err(e) => json!({ "error": ApiError::from(e).body() }),
        })
        .collect();
    Ok((StatusCode::CREATED, Json(list)).into_response())
}
