//! What a caller's team may see of the logs that outlive sandboxes (metrics history, events,
//! audit records): one sandbox's only when it belongs (or belonged) to the team; a search over
//! many covers the caller's team's sandboxes, or every sandbox for the operator's team
//! (`default`).

use super::{ApiError, ApiResult, AppState};
use crate::tenancy::{Caller, DEFAULT_TEAM};

/// 404 unless sandbox `id` (running, paused or ended) belongs to `team`.
pub(super) async fn check_owner(st: &AppState, id: &str, team: &str) -> ApiResult<()> {
    let rec = st
        .sandboxes
        .get_sandbox(id)
        .await
        .map_err(crate::Error::from)?;
    match rec {
        Some(r) if r.team == team => Ok(()),
        _ => Err(ApiError::sandbox_not_found(id)),
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
