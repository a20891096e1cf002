//! The audit routes and the middleware that records API calls naming a sandbox.

use axum::extract::{MatchedPath, Path, Query, Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use http::StatusCode;
use serde_json::json;

use super::{ApiError, ApiResult, St};
use crate::audit::api::{follow, page, AuditQuery};
use crate::audit::{AuditError, Kind};
use crate::tenancy::Caller;

/// The id of the API key a request was authenticated with (set by `require_api_key`).
#[derive(Debug, Clone)]
pub struct KeyId(pub String);

fn audit_err(e: AuditError) -> ApiError {
    match e {
        AuditError::Off => ApiError::new(StatusCode::NOT_IMPLEMENTED, e.to_string()),
        other => read_refusal(other, "audit log query"),
    }
}

/// A read of the audit store that failed (`what`: the read, for the log and the 500): what
/// the store cannot do is a 501, a request it cannot read a 400.
pub(super) fn read_refusal(e: AuditError, what: &str) -> ApiError {
    match e {
        AuditError::Store(crate::store::StoreError::Unsupported(m)) => {
            ApiError::new(StatusCode::NOT_IMPLEMENTED, m)
        }
        AuditError::Store(crate::store::StoreError::Invalid(m)) => ApiError::bad_request(m),
        other => {
            tracing::error!(error = %other, "{what}");
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("{what} failed"))
        }
    }
}

async fn query(
    st: St,
    sandbox: Option<&str>,
    team: Option<String>,
    q: AuditQuery,
) -> ApiResult<Response> {
    let log = st.0.audit.clone();
    if !log.enabled() {
        return Err(audit_err(AuditError::Off));
    }
    let mut f = q.filter(sandbox).map_err(ApiError::bad_request)?;
    f.team = team;
    if q.follow.unwrap_or(false) {
        return Ok(follow(log, f));
    }
    Ok(Json(page(&log, f).await.map_err(audit_err)?).into_response())
}

/// `GET /sandboxes/{id}/audit`: one sandbox's records (it may be gone: records outlive it).
pub async fn sandbox_audit(
    st: St,
    Extension(c): Extension<Caller>,
    Path(id): Path<String>,
    Query(q): Query<AuditQuery>,
) -> ApiResult<Response> {
    super::scope::check_owner(&st.0, &id, &c.team).await?;
    query(st, Some(&id), None, q).await
}

/// `GET /audit`: the records of every sandbox of the caller's team (of every sandbox for the
/// operator's team); `sandboxID` narrows.
pub async fn search(
    st: St,
    Extension(c): Extension<Caller>,
    Query(q): Query<AuditQuery>,
) -> ApiResult<Response> {
    let team = super::scope::team_scope(&st.0, &c, q.sandbox_id.as_deref()).await?;
    query(st, None, team, q).await
}

#[derive(Debug, Default, serde::Deserialize)]
pub struct VerifyQuery {
    #[serde(rename = "sandboxID")]
    sandbox_id: Option<String>,
}

/// `GET /audit/verify`: checks one chain, or all of the caller's team (all for the operator's
/// team); `ok` is false when any is broken.
pub async fn verify(
    st: St,
    Extension(c): Extension<Caller>,
    Query(q): Query<VerifyQuery>,
) -> ApiResult<Response> {
    let team = super::scope::team_scope(&st.0, &c, q.sandbox_id.as_deref()).await?;
    let reports =
        st.0.audit
            .verify(q.sandbox_id, team)
            .await
            .map_err(audit_err)?;
    let ok = reports.iter().all(|r| r.ok);
    Ok(Json(json!({ "ok": ok, "chains": reports })).into_response())
}

/// The sandbox a REST path names (`/sandboxes/{id}/…`, `/v2/sandboxes/{id}/…`).
fn sandbox_of(path: &str) -> Option<&str> {
    let rest = path
        .strip_prefix("/v2/sandboxes/")
        .or_else(|| path.strip_prefix("/sandboxes/"))?;
    let id = rest.split('/').next()?;
    (!id.is_empty() && id != "metrics").then_some(id)
}

/// Marks a console read (a page refreshing its view): the API's audit layer does not record
/// it; the console's state-changing calls are recorded like any API call.
#[derive(Debug, Clone, Copy)]
pub struct ViewRead;

/// Records every API call naming a sandbox (key, route, status) on that sandbox's chain, and
/// a create on the new sandbox's chain (its key becomes the sandbox's owner).
pub async fn record_api(State(st): St, req: Request, next: Next) -> Response {
    let log = st.audit.clone();
    // The web console's reads refresh its views every few seconds: not recorded (what it
    // changes is, as the signed-in key).
    let console_read = req.extensions().get::<ViewRead>().is_some()
        && matches!(*req.method(), http::Method::GET | http::Method::HEAD);
    if !log.enabled() || console_read {
        return next.run(req).await;
    }
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|m| m.as_str().to_string())
        .unwrap_or_else(|| path.clone());
    let key = req.extensions().get::<KeyId>().map(|k| k.0.clone());
    let is_create =
        method == http::Method::POST && (path == "/sandboxes" || path == "/v2/sandboxes");
    let named = sandbox_of(&path)
        .filter(|_| !route.ends_with("/audit"))
        .map(str::to_string);
    if named.is_none() && !is_create {
        return next.run(req).await;
    }
    let resp = next.run(req).await;
    let status = resp.status();
    let body = |id: &str| {
        json!({
            "key": key,
            "method": method.as_str(),
            "route": route,
            "status": status.as_u16(),
            "sandbox": id,
        })
    };
    if let Some(id) = named {
        log.record(&id, Kind::Api, body(&id)).await;
        return resp;
    }
    if !status.is_success() {
        return resp;
    }
    // A create: the new id is in the (small JSON) answer.
    let (parts, b) = resp.into_parts();
    let bytes = match http_body_util::BodyExt::collect(b).await {
        Ok(c) => c.to_bytes(),
        Err(_) => return Response::from_parts(parts, axum::body::Body::empty()),
    };
    if let Some(id) = serde_json::from_slice::<serde_json::Value>(&bytes)
        .ok()
        .and_then(|v| v["sandboxID"].as_str().map(str::to_string))
    {
        if let Some(k) = &key {
            log.set_owner(&id, k);
        }
        log.record(&id, Kind::Api, body(&id)).await;
    }
    Response::from_parts(parts, axum::body::Body::from(bytes))
}

#[cfg(test)]
mod tests {
    use super::sandbox_of;

    #[test]
    fn sandbox_paths() {
        assert_eq!(sandbox_of("/sandboxes/abc/pause"), Some("abc"));
        assert_eq!(sandbox_of("/v2/sandboxes/abc/connect"), Some("abc"));
        assert_eq!(sandbox_of("/sandboxes/abc"), Some("abc"));
        assert_eq!(sandbox_of("/sandboxes/metrics"), None);
        assert_eq!(sandbox_of("/sandboxes"), None);
        assert_eq!(sandbox_of("/templates/x"), None);
    }
}
