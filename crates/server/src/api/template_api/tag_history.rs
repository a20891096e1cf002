//! E2B's tag history views (`e2b` 2.63.0's generated client; the high-level SDK does not call
//! them): `GET /templates/{id}/tags/groups` (the tags with a ready build, each with its latest
//! assignments, paged over tags) and `GET /templates/{id}/tags/{tag}/assignments` (one tag's
//! ready assignments, newest first). Both page with a keyset cursor (`nextCursor`).

use std::collections::BTreeMap;

use axum::extract::{Path, Query, State};
use axum::{Extension, Json};
use base64::Engine;
use serde::Deserialize;
use serde_json::{json, Value};

use super::super::wire::ts;
use super::super::{ApiError, ApiResult, St};
use super::{store_err, team_template};
use crate::store::AssignmentRow;
use crate::tenancy::Caller;
use crate::tplbuild::check_tag;

/// Largest page of tags or assignments.
const MAX_LIMIT: u32 = 100;

fn assignment_json(a: &AssignmentRow) -> Value {
    json!({
        "assignmentId": a.id,
        "buildId": a.build_id,
        "assignedAt": ts(a.assigned_at_ms),
        "buildCreatedAt": ts(a.build_created_at_ms),
        "buildFinishedAt": a.build_finished_at_ms.map(ts),
    })
}

fn limit(name: &str, v: Option<u32>, default: u32) -> ApiResult<u32> {
    match v.unwrap_or(default) {
        n @ 1..=MAX_LIMIT => Ok(n),
        n => Err(ApiError::bad_request(format!(
            "{name} must be 1-{MAX_LIMIT}, got {n}"
        ))),
    }
}

fn encode(s: &str) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s)
}

fn decode(name: &str, s: &str) -> ApiResult<String> {
    base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(s)
        .ok()
        .and_then(|b| String::from_utf8(b).ok())
        .ok_or_else(|| {
            ApiError::bad_request(format!(
                "invalid {name} {s:?}: pass the nextCursor of the previous page as it was"
            ))
        })
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AssignmentsQuery {
    cursor: Option<String>,
    limit: Option<u32>,
}

/// `GET /templates/{id}/tags/{tag}/assignments?cursor&limit` → `{data, nextCursor}`.
pub async fn assignments(
    State(st): St,
    Extension(c): Extension<Caller>,
    Path((id, tag)): Path<(String, String)>,
    Query(q): Query<AssignmentsQuery>,
) -> ApiResult<Json<Value>> {
    let n = limit("limit", q.limit, 50)?;
    check_tag(&tag)?;
    let before = match q.cursor.as_deref().filter(|c| !c.is_empty()) {
        Some(c) => Some(decode("cursor", c)?.parse::<i64>().map_err(|_| {
            ApiError::bad_request(format!("invalid cursor {c:?}: not one this server made"))
        })?),
        None => None,
    };
    let (b, t) = team_template(&st, &c.team, &id).await?;
    let mut rows = b
        .db()
        .assignments(&t.id, Some(&tag), before, n + 1)
        .await
        .map_err(store_err)?;
    let more = rows.len() > n as usize;
    rows.truncate(n as usize);
    let next = more
        .then(|| rows.last().map(|r| encode(&r.seq.to_string())))
        .flatten();
    Ok(Json(json!({
        "data": rows.iter().map(assignment_json).collect::<Vec<_>>(),
        "nextCursor": next,
    })))
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GroupsQuery {
    assignment_limit: Option<u32>,
    tags_limit: Option<u32>,
    tags_cursor: Option<String>,
    search: Option<String>,
    sort: Option<String>,
}

/// The order of tag groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sort {
    LatestDesc,
    LatestAsc,
    NameAsc,
    NameDesc,
}

impl Sort {
    fn parse(s: Option<&str>) -> ApiResult<Self> {
        Ok(match s.unwrap_or("latest_desc") {
            "latest_desc" => Self::LatestDesc,
            "latest_asc" => Self::LatestAsc,
            "name_asc" => Self::NameAsc,
            "name_desc" => Self::NameDesc,
            other => {
                return Err(ApiError::bad_request(format!(
                    "sort {other:?}: use latest_desc, latest_asc, name_asc or name_desc"
                )))
            }
        })
    }

    /// Whether a group (its latest assignment's `seq`, its tag) comes after the cursor's.
    fn after(self, (seq, tag): (i64, &str), (cseq, ctag): (i64, &str)) -> bool {
        match self {
            Self::LatestDesc => seq < cseq,
            Self::LatestAsc => seq > cseq,
            Self::NameAsc => tag > ctag,
            Self::NameDesc => tag < ctag,
        }
    }
}

/// `GET /templates/{id}/tags/groups?assignmentLimit&tagsLimit&tagsCursor&search&sort` →
/// `{tags: [{tag, assignments, hasMore}], nextCursor}`; `search` matches part of a tag's
/// name, whatever the case.
pub async fn groups(
    State(st): St,
    Extension(c): Extension<Caller>,
    Path(id): Path<String>,
    Query(q): Query<GroupsQuery>,
) -> ApiResult<Json<Value>> {
    let per_tag = limit("assignmentLimit", q.assignment_limit, 6)? as usize;
    let tags_limit = limit("tagsLimit", q.tags_limit, 25)? as usize;
    let sort = Sort::parse(q.sort.as_deref())?;
    let cursor = match q.tags_cursor.as_deref().filter(|c| !c.is_empty()) {
        Some(c) => {
            let raw = decode("tagsCursor", c)?;
            let parsed = raw
                .split_once(':')
                .and_then(|(s, t)| Some((s.parse::<i64>().ok()?, t.to_string())));
            Some(parsed.ok_or_else(|| {
                ApiError::bad_request(format!(
                    "invalid tagsCursor {c:?}: not one this server made"
                ))
            })?)
        }
        None => None,
    };
    let search = q
        .search
        .as_deref()
        .map(str::to_lowercase)
        .unwrap_or_default();
    let (b, t) = team_template(&st, &c.team, &id).await?;
    let all = b
        .db()
        .assignments(&t.id, None, None, u32::MAX)
        .await
        .map_err(store_err)?;
    // Newest first: each tag's first row is its latest assignment.
    let mut by_tag: BTreeMap<&str, Vec<&AssignmentRow>> = BTreeMap::new();
    for a in &all {
        by_tag.entry(a.tag.as_str()).or_default().push(a);
    }
    let mut groups: Vec<(i64, &str, Vec<&AssignmentRow>)> = by_tag
        .into_iter()
        .filter(|(tag, _)| tag.to_lowercase().contains(&search))
        .map(|(tag, rows)| (rows[0].seq, tag, rows))
        .collect();
    match sort {
        Sort::LatestDesc => groups.sort_by_key(|g| std::cmp::Reverse(g.0)),
        Sort::LatestAsc => groups.sort_by_key(|g| g.0),
        Sort::NameAsc => groups.sort_by(|a, b| a.1.cmp(b.1)),
        Sort::NameDesc => groups.sort_by(|a, b| b.1.cmp(a.1)),
    }
    if let Some((cseq, ctag)) = &cursor {
        groups.retain(|(seq, tag, _)| sort.after((*seq, tag), (*cseq, ctag.as_str())));
    }
    let more = groups.len() > tags_limit;
    groups.truncate(tags_limit);
    let next = more
        .then(|| {
            groups
                .last()
                .map(|(seq, tag, _)| encode(&format!("{seq}:{tag}")))
        })
        .flatten();
    let tags: Vec<Value> = groups
        .iter()
        .map(|(_, tag, rows)| {
            json!({
                "tag": tag,
                "assignments": rows.iter().take(per_tag).map(|a| assignment_json(a))
                    .collect::<Vec<_>>(),
                "hasMore": rows.len() > per_tag,
            })
        })
        .collect();
    Ok(Json(json!({ "tags": tags, "nextCursor": next })))
}
