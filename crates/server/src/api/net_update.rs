//! `PUT /sandboxes/{id}/network`: a running sandbox's egress policy replaced, remembered
//! (sealed) for a restart, and its trust store checked to hold the interception CA when the
//! rules need it.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use serde_json::Value;

use super::network::{policy_of, NetworkJson};
use super::wire::parse_json;
use super::{ApiError, ApiResult, St};

/// `PUT /sandboxes/{id}/network`: replaces `allowOut`, `denyOut`, `dnsServers` and `rules`
/// (omitted ones are cleared); internet access and `httpsPorts` stay as created, and so do the
/// ingress settings (the sandbox record's).
pub async fn update(
    State(st): St,
    axum::Extension(c): axum::Extension<crate::tenancy::Caller>,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult<StatusCode> {
    let n: NetworkJson = parse_json(&body, true)?.unwrap_or_default();
    st.manager.get_for(&id, &c.team)?;
    let current = st.manager.network(&id).await?;
    let internet = current.as_ref().map(|p| p.allow_internet_access);
    let policy = policy_of(Some(internet.unwrap_or(false)), Some(&n))?;
    // The update carries no `iam`: the sandbox keeps the tokens it was created with.
    let iam = super::net_persist::stored_iam(&st, &id, &c.team).await?;
    let tokens = crate::identity::parse_iam(iam.as_ref())
        .map_err(|e| ApiError::internal(format!("the sandbox's stored iam: {e}")))?;
    let mut policy = super::rules::with_rules(&st, &c.team, Some(&n), &tokens, policy)
        .await?
        .ok_or_else(|| ApiError::internal("no policy for a network update"))?;
    if n.https_ports.is_none() {
        policy.https_ports = current
            .as_ref()
            .map(|p| p.https_ports.clone())
            .unwrap_or_default();
    }
    let rules = policy.transforms.is_some();
    let raw = serde_json::from_slice::<Value>(&body).ok();
    // A cluster's node attaches the rules and egress proxy (see `net_forwarded`).
    let settings = st
        .manager
        .forwards_network_settings()
        .then(|| super::net_persist::settings_of(raw.as_ref(), None))
        .flatten();
    st.manager
        .set_network_settings(&id, policy, settings)
        .await?;
    super::net_persist::remember(&st, &id, &c.team, raw.as_ref(), iam.as_ref()).await?;
    if rules {
        // Trusted since create; a sandbox from an older snapshot may lack it.
        let token = st.manager.get_for(&id, &c.team)?.envd_token;
        super::host_trust::install(st.manager.as_ref(), &id, token).await?;
    }
    Ok(StatusCode::NO_CONTENT)
}
