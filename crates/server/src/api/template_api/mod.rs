//! E2B's Template API (`e2b` 2.63.0's `Template.build`, tags, aliases, template views) over
//! [`crate::tplbuild`]: [`builds`] (request, upload link, start, status, logs), [`tags`]
//! (tags, aliases, lists, delete), [`tag_history`] (tag groups and assignments) and
//! [`upload`] (the unauthenticated upload URL); `POST /template-builds/gc` collects.

mod builds;
mod tag_history;
mod tags;
mod upload;

use std::sync::Arc;

use axum::routing::{get, post, put};
use axum::Router;

use super::{ApiError, AppState};
use crate::store::{BuildRow, StoreError, TplRow};
use crate::tplbuild::{Builds, Resolved};

/// Path prefix of upload URLs (outside the API-key check).
pub const UPLOAD_PREFIX: &str = "/template-files";

/// The template-build service, or 501 when the server has none.
pub(super) fn builds_of(st: &AppState) -> Result<&Arc<Builds>, ApiError> {
    st.builds
        .as_ref()
        .ok_or_else(|| ApiError::not_implemented("template builds"))
}

pub(super) fn store_err(e: StoreError) -> ApiError {
    crate::Error::from(e).into()
}

/// The build service and the template of `team` whose id or name is `key` (404 when the team
/// has none).
pub(super) async fn team_template<'a>(
    st: &'a AppState,
    team: &str,
    key: &str,
) -> Result<(&'a Arc<Builds>, TplRow), ApiError> {
    let b = builds_of(st)?;
    let t = b.template_of(team, key).await?;
    Ok((b, t))
}

/// Build `id` of template `t` (404 when it is not one of its builds).
pub(super) async fn build_of(b: &Builds, t: &TplRow, id: &str) -> Result<BuildRow, ApiError> {
    b.db()
        .get_build(id)
        .await
        .map_err(store_err)?
        .filter(|r| r.template_id == t.id)
        .ok_or_else(|| {
            ApiError::not_found(format!("build {id:?} of template {:?} not found", t.name))
        })
}

/// The authenticated routes (merged into the API router).
pub fn routes() -> Router<Arc<AppState>> {
    let b = "/templates/{templateID}/builds/{buildID}";
    Router::new()
        .route("/v3/templates", post(builds::request))
        .route(
            "/templates/{templateID}/files/{hash}",
            get(builds::files_link),
        )
        .route(
            "/v2/templates/{templateID}/builds/{buildID}",
            post(builds::start),
        )
        .route(&format!("{b}/status"), get(builds::status))
        .route(&format!("{b}/logs"), get(builds::logs))
        .route("/templates/tags", post(tags::assign).delete(tags::remove))
        .route("/templates/{templateID}/tags", get(tags::list))
        .route("/templates/{templateID}/tags/count", get(tags::count))
        .route("/templates/{templateID}/tags/exists", get(tags::exists))
        .route(
            "/templates/{templateID}/tags/groups",
            get(tag_history::groups),
        )
        .route(
            "/templates/{templateID}/tags/{tag}/assignments",
            get(tag_history::assignments),
        )
        .route("/template-builds/gc", post(tags::collect))
        .route("/templates/aliases/{alias}", get(tags::alias))
        .route("/v2/templates", get(tags::list_v2))
        .route(
            "/v2/templates/{templateID}",
            axum::routing::patch(tags::patch),
        )
        .route("/default-templates", get(tags::defaults))
}

/// The upload route (no API key: the URL's token authorises it; no API body limit: the
/// upload cap applies).
pub fn upload_routes() -> Router<Arc<AppState>> {
    Router::new().route(&format!("{UPLOAD_PREFIX}/{{token}}"), put(upload::put))
}

/// `DELETE /templates/{templateID}`: a built template of the caller's team, else a snapshot.
pub use tags::delete;

/// Deletes `team`'s built template `id` (id or name); false when the team built none of
/// that name here (a cluster's build node: the replica deletes snapshots itself).
pub async fn delete_built(st: &AppState, team: &str, id: &str) -> Result<bool, ApiError> {
    let Some(b) = &st.builds else {
        return Ok(false);
    };
    if b.template_of(team, id).await.is_err() {
        return Ok(false);
    }
    b.delete(team, id).await?;
    Ok(true)
}

/// What a create's `templateID` names when it is a template the caller's team built.
pub async fn resolve_for_create(
    st: &AppState,
    team: &str,
    template_id: &str,
) -> Result<Option<Resolved>, ApiError> {
    match &st.builds {
        Some(b) => Ok(b.resolve(team, template_id).await?),
        None => Ok(None),
    }
}

/// A create naming a kiln template itself: refused when it is a private image's template
/// the registry does not give anonymously (see [`crate::tplbuild::Builds::check_direct_create`]).
pub async fn check_direct_create(st: &AppState, template_id: &str) -> Result<(), ApiError> {
    match &st.builds {
        Some(b) => Ok(b.check_direct_create(template_id).await?),
        None => Ok(()),
    }
}

/// Gives a sandbox created from a built template the build's last USER and WORKDIR as its
/// defaults.
pub async fn apply_defaults(
    st: &AppState,
    rec: &crate::store::SandboxRecord,
    b: &Resolved,
) -> Result<(), ApiError> {
    if b.user.is_none() && b.workdir.is_none() {
        return Ok(());
    }
    let init = kiln_proto::envd::InitRequest {
        access_token: Some(rec.envd_token.clone().unwrap_or_default()),
        default_user: b.user.clone(),
        default_workdir: b.workdir.clone(),
        ..Default::default()
    };
    st.manager
        .agent(&rec.id, rec.envd_token.clone())
        .init(&init)
        .await
        .map_err(|e| ApiError::from(crate::Error::from(e)))
}
