//! Tags, aliases and template views of E2B's Template API: `POST`/`DELETE /templates/tags`,
//! `GET /templates/{id}/tags` (+ `count`, `exists`), `GET /templates/aliases/{alias}`,
//! `GET /v2/templates`, `GET /default-templates`, `PATCH /v2/templates/{id}` and
//! `DELETE /templates/{id}` (a built template, else a snapshot) and `POST
//! /template-builds/gc`.

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Deserialize;
use serde_json::{json, Value};

use super::super::wire::{parse_json, template_json, ts};
use super::super::{ApiError, ApiResult, St};
use super::{builds_of, store_err, team_template};
use crate::store::TplRow;
use crate::tenancy::Caller;
use crate::tplbuild::{check_tag, split_tag, Builds};

#[derive(Debug, Deserialize)]
pub struct AssignBody {
    target: String,
    tags: Vec<String>,
}

/// `POST /templates/tags` `{target: "name:tag", tags}` → 201 `{tags, buildID}`.
pub async fn assign(
    State(st): St,
    Extension(c): Extension<Caller>,
    body: Bytes,
) -> ApiResult<Response> {
    let b = builds_of(&st)?;
    let a: AssignBody =
        parse_json(&body, false)?.ok_or_else(|| ApiError::bad_request("empty body"))?;
    for t in &a.tags {
        check_tag(t)?;
    }
    let (name, tag) = split_tag(&a.target);
    let t = b.template_of(&c.team, name).await?;
    let tag = tag.unwrap_or("default");
    let build = b
        .tagged_build(&t, tag)
        .await?
        .ok_or_else(|| ApiError::not_found(format!("template {name:?} has no tag {tag:?}")))?;
    b.db()
        .assign_tags(&t.id, &a.tags, &build, crate::store::now_ms())
        .await
        .map_err(store_err)?;
    Ok((
        StatusCode::CREATED,
        Json(json!({ "tags": a.tags, "buildID": build })),
    )
        .into_response())
}

#[derive(Debug, Deserialize)]
pub struct RemoveBody {
    name: String,
    tags: Vec<String>,
}

/// `DELETE /templates/tags` `{name, tags}` → 204.
pub async fn remove(
    State(st): St,
    Extension(c): Extension<Caller>,
    body: Bytes,
) -> ApiResult<StatusCode> {
    let b = builds_of(&st)?;
    let r: RemoveBody =
        parse_json(&body, false)?.ok_or_else(|| ApiError::bad_request("empty body"))?;
    let t = b.template_of(&c.team, &r.name).await?;
    let n = b
        .db()
        .remove_tags(&t.id, &r.tags)
        .await
        .map_err(store_err)?;
    if n == 0 && !r.tags.is_empty() {
        return Err(ApiError::not_found(format!(
            "template {:?} has none of the tags {:?}",
            r.name, r.tags
        )));
    }
    Ok(StatusCode::NO_CONTENT)
}

/// `GET /templates/{id}/tags` → `[{tag, buildID, createdAt}]`.
pub async fn list(
    State(st): St,
    Extension(c): Extension<Caller>,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    let (b, t) = team_template(&st, &c.team, &id).await?;
    let tags = b.db().tags(&t.id).await.map_err(store_err)?;
    Ok(Json(json!(tags
        .iter()
        .map(|r| json!({ "tag": r.tag, "buildID": r.build_id, "createdAt": ts(r.assigned_at_ms) }))
        .collect::<Vec<_>>())))
}

/// `GET /templates/{id}/tags/count` → `{total}`.
pub async fn count(
    State(st): St,
    Extension(c): Extension<Caller>,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    let (b, t) = team_template(&st, &c.team, &id).await?;
    let n = b.db().tags(&t.id).await.map_err(store_err)?.len();
    Ok(Json(json!({ "total": n })))
}

#[derive(Debug, Deserialize)]
pub struct ExistsQuery {
    tag: Option<String>,
}

/// `GET /templates/{id}/tags/exists?tag=` → `{exists, normalizedTag}`.
pub async fn exists(
    State(st): St,
    Extension(c): Extension<Caller>,
    Path(id): Path<String>,
    Query(q): Query<ExistsQuery>,
) -> ApiResult<Json<Value>> {
    let (b, t) = team_template(&st, &c.team, &id).await?;
    let tag = q.tag.unwrap_or_default().trim().to_string();
    check_tag(&tag)?;
    let exists = b.tagged_build(&t, &tag).await?.is_some();
    Ok(Json(json!({ "exists": exists, "normalizedTag": tag })))
}

/// `GET /templates/aliases/{alias}` → 200 `{templateID, public}`; 403 when another team has
/// it (and it is not public), 404 when nobody has it. kiln's own templates count as public.
pub async fn alias(
    State(st): St,
    Extension(c): Extension<Caller>,
    Path(alias): Path<String>,
) -> ApiResult<Json<Value>> {
    let b = builds_of(&st)?;
    let (name, _) = split_tag(&alias);
    let rows = b.db().templates_named(name).await.map_err(store_err)?;
    if let Some(t) = rows.iter().find(|t| t.team == c.team) {
        return Ok(Json(json!({ "templateID": t.id, "public": t.public })));
    }
    if let Some(t) = rows.iter().find(|t| t.public) {
        return Ok(Json(json!({ "templateID": t.id, "public": true })));
    }
    if !rows.is_empty() {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            format!("template {name:?} belongs to another team"),
        ));
    }
    if crate::templates::check_name(name).is_ok() && st.manager.template(name).await.is_ok() {
        return Ok(Json(json!({ "templateID": name, "public": true })));
    }
    Err(ApiError::not_found(format!("template {name:?} not found")))
}

/// A built template as E2B's `Template`.
async fn built_json(
    b: &Builds,
    t: &TplRow,
    st: &super::super::AppState,
) -> Result<Value, ApiError> {
    let latest = b.db().latest_ready(&t.id).await.map_err(store_err)?;
    let cfg = st.manager.config();
    Ok(json!({
        "templateID": t.id,
        "buildID": latest.as_ref().map(|l| l.id.clone()).unwrap_or_default(),
        "cpuCount": t.cpu_count.unwrap_or(cfg.default_cpu_count as i64),
        "memoryMB": t.memory_mb.unwrap_or(cfg.default_memory_mb as i64),
        "diskSizeMB": cfg.default_disk_mb,
        "public": t.public,
        "aliases": [t.name],
        "names": [t.name],
        "createdAt": ts(t.created_at_ms),
        "updatedAt": ts(t.updated_at_ms),
        "createdBy": null,
        "lastSpawnedAt": null,
        "spawnCount": 0,
        "buildCount": 1,
        "envdVersion": kiln_proto::envd::ENVD_VERSION,
        "buildStatus": if latest.is_some() { "ready" } else { "building" },
    }))
}

/// `GET /v2/templates`: the team's built templates, then kiln's own.
pub async fn list_v2(
    State(st): St,
    Extension(c): Extension<Caller>,
) -> ApiResult<Json<Vec<Value>>> {
    let b = builds_of(&st)?;
    let mut out = Vec::new();
    for t in b.db().list_templates(&c.team).await.map_err(store_err)? {
        out.push(built_json(b, &t, &st).await?);
    }
    out.extend(st.manager.templates().await?.iter().map(template_json));
    Ok(Json(out))
}

/// `GET /default-templates`: kiln's own templates.
pub async fn defaults(State(st): St) -> ApiResult<Json<Vec<Value>>> {
    Ok(Json(
        st.manager
            .templates()
            .await?
            .iter()
            .map(|v| {
                let mut j = template_json(v);
                j["isDefault"] = json!(true);
                j["public"] = json!(true);
                j
            })
            .collect(),
    ))
}

#[derive(Debug, Deserialize)]
pub struct PatchBody {
    public: Option<bool>,
}

/// `PATCH /v2/templates/{id}` `{public}` → `{names}`.
pub async fn patch(
    State(st): St,
    Extension(c): Extension<Caller>,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult<Json<Value>> {
    let p: PatchBody = parse_json(&body, true)?.unwrap_or(PatchBody { public: None });
    let (b, t) = team_template(&st, &c.team, &id).await?;
    if let Some(public) = p.public {
        b.db()
            .set_public(&t.id, public, crate::store::now_ms())
            .await
            .map_err(store_err)?;
    }
    Ok(Json(json!({ "names": [t.name] })))
}

/// `DELETE /templates/{id}`: a template the team built, else one of its snapshots.
pub async fn delete(
    State(st): St,
    Extension(c): Extension<Caller>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    if let Some(b) = &st.builds {
        if b.template_of(&c.team, &id).await.is_ok() {
            b.delete(&c.team, &id).await?;
            return Ok(StatusCode::NO_CONTENT);
        }
    }
    super::super::snapshots::delete_template(State(st), Extension(c), Path(id)).await
}

/// `POST /template-builds/gc` (kiln's own): collects the caller's team's template versions
/// no tag or name points to and the cache entries nothing kept uses → what was removed.
pub async fn collect(State(st): St, Extension(c): Extension<Caller>) -> ApiResult<Json<Value>> {
    let b = builds_of(&st)?;
    let done = b.collect(&c.team).await?;
    Ok(Json(json!(done)))
}
