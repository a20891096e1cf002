//! What a caller's team may see of the logs that outlive sandboxes (metrics history, events,
//! audit records): one sandbox's only when it belongs (or belonged) to the team; the whole
//! server's only for keys of the operator's team (`default`); audit searches cover the
//! caller's team's sandboxes.

use super::{ApiError, ApiResult, AppState};
use crate::tenancy::{Caller, DEFAULT_TEAM};

/// 404 unless sandbox `id` (running, paused or ended) belongs to `team`.
pub(super) async fn check_owner(st: &AppState, id: &str, team: &str) -> ApiResult<()> {
    let rec = st
        .manager
        .store()
        .get_sandbox(id)
        .await
        .map_err(crate::Error::from)?;
    match rec {
        Some(r) if r.team == team => Ok(()),
        _ => Err(ApiError::sandbox_not_found(id)),
    }
}

/// A server-wide log read: the operator's team reads anything; other teams must name one of
/// their sandboxes (`named`), which is checked.
pub(super) async fn check_wide(st: &AppState, c: &Caller, named: Option<&str>) -> ApiResult<()> {
    match named {
        _ if c.team == DEFAULT_TEAM => Ok(()),
        Some(id) => check_owner(st, id, &c.team).await,
        None => Err(ApiError::new(
            axum::http::StatusCode::FORBIDDEN,
            format!(
                "team {:?} may read the log of its own sandboxes only: name one with sandboxID",
                c.team
            ),
        )),
    }
}

/// A search over the logs of a team's sandboxes: the operator's team reads everything (None);
/// another team reads its own sandboxes (`Some(team)`), and a sandbox it names must be its own.
pub(super) async fn team_scope(
    st: &AppState,
    c: &Caller,
    named: Option<&str>,
) -> ApiResult<Option<String>> {
    if c.team == DEFAULT_TEAM {
        return Ok(None);
    }
    if let Some(id) = named {
        check_owner(st, id, &c.team).await?;
    }
    Ok(Some(c.team.clone()))
}
