//! The node-internal API: what control replicas ask of the sandboxes this node runs. Every
//! request carries the cluster secret; once the node's lease is gone every request is
//! refused (503), so a node cut off from the cluster stops serving its sandboxes.

use std::sync::Arc;

use axum::extract::{Path, Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kiln_server::api::{host_trust, net_forwarded, template_api};
use kiln_server::ApiError;

use super::{audit, builds, moves, snapshots, templates, tunnel, volumes, NodeApi};
use crate::docs::{SandboxDoc, SnapshotDoc};
use crate::wire::{
    Child, CreateDoc, MetricDoc, MountDoc, NetworkDoc, Op, OpAnswer, API_PREFIX, AUTH_HEADER,
};

type St = State<Arc<NodeApi>>;

/// The node's router (its listener answers nothing else).
pub fn router(api: NodeApi) -> Router {
    let api = Arc::new(api);
    Router::new()
        .route(&format!("{API_PREFIX}/health"), get(|| async { "ok" }))
        .route(&format!("{API_PREFIX}/sandboxes"), post(create))
        .route(&format!("{API_PREFIX}/sandboxes/{{id}}"), post(op))
        .route(
            &format!("{API_PREFIX}/sandboxes/{{id}}/ports/{{port}}/tunnel"),
            get(tunnel::open),
        )
        .route(
            &format!("{API_PREFIX}{}", crate::audit::AUDIT_PATH),
            post(audit::call),
        )
        .route(
            &format!("{API_PREFIX}/snapshots/{{id}}/delete"),
            post(snapshots::delete),
        )
        .route(
            &format!("{API_PREFIX}/templates/{{name}}/share"),
            post(templates::share_route),
        )
        .route(&format!("{API_PREFIX}/volumes/{{id}}"), post(volumes::call))
        .route(
            &format!("{}/{{*rest}}", crate::wire::BUILDS_PREFIX),
            axum::routing::any(builds::api),
        )
        .route(
            &format!("{API_PREFIX}/builds/resolve"),
            post(builds::resolve),
        )
        .route(
            &format!("{API_PREFIX}/volumecontent/{{*rest}}"),
            axum::routing::any(volumes::content),
        )
        .layer(middleware::from_fn_with_state(api.clone(), guard))
        .with_state(api)
}

/// The cluster secret, then the fence.
async fn guard(State(n): St, req: Request, next: Next) -> Response {
    let auth = req.headers().get(AUTH_HEADER).map(|v| v.as_bytes());
    if !n.secret.admits(auth) {
        return ApiError::unauthorized("the cluster secret is missing or wrong").into_response();
    }
    if !*n.alive.borrow() {
        return ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "this node lost its cluster lease and serves nothing",
        )
        .into_response();
    }
    next.run(req).await
}

async fn create(State(n): St, Json(doc): Json<CreateDoc>) -> Result<Response, ApiError> {
    let token = doc.idempotency.clone();
    let (snapshot, team, built) = (doc.snapshot.clone(), doc.team.clone(), doc.built);
    let mut params = doc.into_params()?;
    // A template the team built here starts from its last layer.
    let resolved = if built {
        let r = template_api::resolve_for_create(&n.app, &team, &params.template_id).await?;
        let r = r.ok_or_else(|| {
            ApiError::not_found(format!(
                "template {:?} was not built on this node",
                params.template_id
            ))
        })?;
        params.template_id = r.template_id.clone();
        Some(r)
    } else {
        None
    };
    // What the public API's create does on one host: the extra CAs named in the environment,
    // the rules and egress proxy attached with this node's vault and interception CA.
    host_trust::trust_env(n.service.extra_cas(), &mut params.env_vars);
    // The volumes it mounts are this node's (made here now if a replica stopped half-way).
    for m in &params.volume_mounts {
        volumes::keep_local(&n, &m.volume_id).await?;
    }
    let settings = params.network_settings.take();
    if let Some(given) = &settings {
        let team = params.team().to_string();
        let lists = params.network.take();
        params.network = Some(net_forwarded::create_policy(&n.app, &team, lists, given).await?);
    }
    let borrowed = match &snapshot {
        Some(id) => snapshots::borrow(&n, id, &team).await?,
        None if resolved.is_some() => None,
        None => {
            templates::ensure(&n, &params.template_id).await?;
            None
        }
    };
    let made = n.creates.run(n.service.clone(), params, token).await;
    if let Some(b) = borrowed {
        b.give_back(&n).await;
    }
    let rec = made?;
    if let Some(r) = &resolved {
        template_api::apply_defaults(&n.app, &rec, r).await?;
    }
    if let Some(given) = &settings {
        net_forwarded::created(&n.app, &rec.id, &rec.team, given).await?;
    }
    let revision = n.publisher.sandbox(&rec.id).await;
    let answer = OpAnswer {
        sandbox: Some(SandboxDoc::from(&rec)),
        revision,
        ..Default::default()
    };
    Ok((StatusCode::CREATED, Json(answer)).into_response())
}

async fn op(
    State(n): St,
    Path(id): Path<String>,
    Json(op): Json<Op>,
) -> Result<Json<OpAnswer>, ApiError> {
    let s = &n.service;
    let mut a = OpAnswer::default();
    // Reads of the node's own metrics: nothing changes, nothing is published.
    match &op {
        Op::Metrics { start_ms, end_ms } => {
            s.get(&id)?;
            let samples = s.metrics_window(&id, *start_ms, *end_ms).await?;
            a.metrics = samples.iter().map(MetricDoc::from).collect();
            return Ok(Json(a));
        }
        Op::LatestMetric => {
            s.get(&id)?;
            let latest = s.latest_metrics(std::slice::from_ref(&id)).await;
            a.metrics = latest.get(&id).map(MetricDoc::from).into_iter().collect();
            return Ok(Json(a));
        }
        Op::Mounts => {
            s.get(&id)?;
            a.mounts = s.mounts_of(&id).await?.iter().map(MountDoc::from).collect();
            return Ok(Json(a));
        }
        Op::Network => {
            let policy = s.network(&id).await?;
            a.network = policy.as_ref().map(NetworkDoc::lists);
            a.shown = policy.as_ref().and_then(NetworkDoc::shown);
            return Ok(Json(a));
        }
        Op::Console { team } => {
            a.console = s.logs(&id, team).await?.console;
            return Ok(Json(a));
        }
        _ => {}
    }
    match op {
        Op::Get => {
            s.get(&id)?;
        }
        Op::Kill { reason } => a.flag = s.kill(&id, &reason).await?,
        Op::KillDetached { reason } => a.flag = s.clone().kill_detached(&id, &reason).await?,
        Op::SetTimeout { secs } => a.end_at_ms = s.set_timeout(&id, secs).await?,
        Op::Extend { secs, why } => {
            s.extend(&id, secs, &why).await?;
        }
        Op::ExpireNow => s.expire_now(&id).await?,
        Op::Pause {
            memory,
            require_healthy_guest,
        } => moves::pause(&n, &id, memory, require_healthy_guest).await?,
        Op::Resume { memory, secs } => {
            moves::held(&n, &id).await?;
            a.flag = s.resume(&id, memory, secs).await?;
        }
        Op::Connect { secs, memory } => {
            moves::held(&n, &id).await?;
            a.flag = s.connect(&id, secs, memory).await?.1;
        }
        Op::TakeOver {
            from,
            memory,
            secs,
            connect,
        } => {
            moves::take_over(&n, &id, &from).await?;
            a.flag = if connect {
                s.connect(&id, secs, memory).await?.1
            } else {
                s.resume(&id, memory, secs).await?
            };
        }
        Op::Adopt { from } => moves::take_over(&n, &id, &from).await?,
        Op::Metrics { .. } | Op::LatestMetric | Op::Network | Op::Mounts | Op::Console { .. } => {}
        Op::SetNetwork { network, settings } => {
            let team = s.get(&id)?.team;
            let lists = network.into_policy()?;
            net_forwarded::update(&n.app, &id, &team, lists, settings.as_ref()).await?
        }
        Op::Release => a.flag = moves::release(&n, &id).await?,
        Op::Snapshot { team, name, memory } => {
            let snap = snapshots::take(&n, &id, &team, name, memory, false).await?;
            snapshots::store_files(&n, &snap).await;
            a.snapshot = Some(SnapshotDoc::from(&snap));
        }
        Op::ForkOut { timeout_secs } => {
            let (snap, child) = snapshots::fork_out(&n, &id, timeout_secs).await?;
            a.snapshot = Some(SnapshotDoc::from(&snap));
            a.create = Some(child);
        }
        Op::Fork {
            count,
            timeout_secs,
        } => {
            for r in s.fork(&id, count, timeout_secs).await? {
                a.children.push(match r {
                    Ok(child) => {
                        if let Err(e) =
                            net_forwarded::forked(&n.app, &id, &child.id, &child.team).await
                        {
                            tracing::warn!(sandbox = %child.id, error = %e.message,
                                "recording a fork child's network settings");
                        }
                        a.revision = a.revision.max(n.publisher.sandbox(&child.id).await);
                        Child {
                            sandbox: Some(SandboxDoc::from(&child)),
                            status: 201,
                            message: String::new(),
                        }
                    }
                    Err(e) => {
                        let e = ApiError::from(e);
                        Child {
                            sandbox: None,
                            status: e.status.as_u16(),
                            message: e.message,
                        }
                    }
                });
            }
        }
    }
    a.revision = a.revision.max(n.publisher.sandbox(&id).await);
    a.sandbox = s.get(&id).ok().map(|r| SandboxDoc::from(&r));
    Ok(Json(a))
}
