//! Listing sandboxes: `GET /sandboxes` (v1) and `GET /v2/sandboxes` with state, metadata and
//! template filters and `nextToken` pagination.

use std::collections::BTreeMap;

use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use axum::Json;
use base64::Engine;
use serde::Deserialize;
use serde_json::Value;

use super::wire::listed_json;
use super::{ApiError, ApiResult, St};
use crate::store::{SandboxRecord, SandboxState};
use crate::tenancy::Caller;

#[derive(Debug, Deserialize)]
pub struct ListQuery {
    metadata: Option<String>,
    state: Option<String>,
    #[serde(rename = "nextToken")]
    next_token: Option<String>,
    limit: Option<String>,
    order: Option<String>,
    template: Option<String>,
    #[serde(rename = "startedAfter")]
    started_after: Option<String>,
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

pub async fn list_v1(
    State(st): St,
    Extension(c): Extension<Caller>,
    Query(q): Query<ListQuery>,
) -> ApiResult<Response> {
    let filter = q
        .metadata
        .as_deref()
        .map(parse_metadata_filter)
        .transpose()?
        .unwrap_or_default();
    // v1 lists every running sandbox unless the caller pages (the same `limit`/`nextToken`
    // as v2, validated the same way).
    let paging = Paging::parse(&q, None)?;
    let all: Vec<SandboxRecord> = st
        .manager
        .list_for(&c.team)
        .into_iter()
        .filter(|r| r.state == SandboxState::Running)
        .filter(|r| matches_metadata(r, &filter))
        .collect();
    Ok(paging.respond(all, st.manager.as_ref()))
}

/// How a list is paged: newest first (by start time, then id) unless `order=asc`, at most
/// `limit` items after the `nextToken` cursor.
struct Paging {
    limit: Option<usize>,
    desc: bool,
    cursor: Option<(i64, String)>,
}

impl Paging {
    /// Parses `limit` (1-1000; `default` when absent), `order` and `nextToken`; 400 naming
    /// the parameter when one is malformed.
    fn parse(q: &ListQuery, default: Option<usize>) -> ApiResult<Self> {
        let limit = match q.limit.as_deref() {
            None => default,
            Some(l) => Some(
                l.trim()
                    .parse()
                    .ok()
                    .filter(|n| (1..=1000).contains(n))
                    .ok_or_else(|| {
                        ApiError::bad_request(format!(
                            "limit must be a whole number from 1 to 1000, got {l:?}"
                        ))
                    })?,
            ),
        };
        let desc = match q.order.as_deref() {
            None | Some("desc") => true,
            Some("asc") => false,
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
        Ok(Paging {
            limit,
            desc,
            cursor,
        })
    }

    /// Sorts `all`, keeps the page after the cursor and answers it as JSON, with
    /// `x-next-token` when more follow. The cursor is the (start time, id) key of the last
    /// item, so sandboxes that start or end between pages never make a page repeat or skip
    /// one that was listed before.
    fn respond(
        &self,
        mut all: Vec<SandboxRecord>,
        m: &dyn crate::manager::SandboxService,
    ) -> Response {
        all.sort_by(|a, b| (a.started_at_ms, &a.id).cmp(&(b.started_at_ms, &b.id)));
        if self.desc {
            all.reverse();
        }
        if let Some((ms, id)) = &self.cursor {
            let key = (*ms, id.as_str());
            all.retain(|r| {
                let k = (r.started_at_ms, r.id.as_str());
                if self.desc {
                    k < key
                } else {
                    k > key
                }
            });
        }
        let more = self.limit.is_some_and(|l| all.len() > l);
        if let Some(l) = self.limit {
            all.truncate(l);
        }
        let items: Vec<Value> = all
            .iter()
            .map(|r| listed_json(r, m.standby_since(&r.id)))
            .collect();
        let mut resp = Json(items).into_response();
        if more {
            if let Some(last) = all.last() {
                if let Ok(v) = encode_cursor(last).parse() {
                    resp.headers_mut().insert("x-next-token", v);
                }
            }
        }
        resp
    }
}

/// A `nextToken`: the (time, id) of the last item of a page, in the order pages are sorted.
pub(super) fn cursor(ms: i64, id: &str) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(format!("{ms}:{id}"))
}

fn encode_cursor(r: &SandboxRecord) -> String {
    cursor(r.started_at_ms, &r.id)
}

/// Parses `startedAfter` (sandboxes started at or after it; RFC 3339, as the SDK sends `datetime.isoformat()`; a time without
/// an offset is UTC) into Unix milliseconds.
pub(super) fn parse_started_after(s: &str) -> ApiResult<i64> {
    // A raw `+` of an offset arrives as a space when the client did not percent-encode it.
    let s = s.trim().replace(' ', "+");
    let s = s.as_str();
    if let Ok(t) = chrono::DateTime::parse_from_rfc3339(s) {
        return Ok(t.timestamp_millis());
    }
    chrono::NaiveDateTime::parse_from_str(s, "%Y-%m-%dT%H:%M:%S%.f")
        .map(|t| t.and_utc().timestamp_millis())
        .map_err(|_| {
            ApiError::bad_request(format!(
                "startedAfter {s:?} is not a date-time: use RFC 3339, e.g. 2026-01-31T12:00:00Z"
            ))
        })
}

/// Parses a `nextToken` made by [`cursor`]; 400 when it is not one.
pub(super) fn decode_cursor(s: &str) -> ApiResult<(i64, String)> {
    let bad = || {
        ApiError::bad_request(format!(
            "invalid nextToken {s:?}: pass the x-next-token header of the previous page as it was"
        ))
    };
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(s)
        .map_err(|_| bad())?;
    let raw = String::from_utf8(raw).map_err(|_| bad())?;
    let (ms, id) = raw.split_once(':').ok_or_else(bad)?;
    Ok((ms.parse().map_err(|_| bad())?, id.to_string()))
}

pub async fn list_v2(
    State(st): St,
    Extension(c): Extension<Caller>,
    Query(q): Query<ListQuery>,
) -> ApiResult<Response> {
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
    let paging = Paging::parse(&q, Some(100))?;
    let started_after = q
        .started_after
        .as_deref()
        .filter(|s| !s.trim().is_empty())
        .map(parse_started_after)
        .transpose()?;
    let all: Vec<SandboxRecord> = st
        .manager
        .list_for(&c.team)
        .into_iter()
        .filter(|r| states.is_empty() || states.contains(&r.state))
        .filter(|r| matches_metadata(r, &filter))
        .filter(|r| q.template.as_deref().is_none_or(|t| r.template_id == t))
        .filter(|r| started_after.is_none_or(|ms| r.started_at_ms >= ms))
        .collect();
    Ok(paging.respond(all, st.manager.as_ref()))
}

#[cfg(test)]
mod tests {
    use super::parse_started_after;

    #[test]
    fn started_after_accepts_what_the_sdk_sends() {
        let utc = parse_started_after("2026-11-30T12:00:00.250000+00:00").unwrap();
        assert_eq!(utc, 1_796_040_000_250);
        assert_eq!(parse_started_after("2026-11-30T12:00:00.25Z").unwrap(), utc);
        // An unencoded `+` arrives as a space.
        assert_eq!(
            parse_started_after("2026-11-30T13:00:00.25 01:00").unwrap(),
            utc
        );
        assert_eq!(parse_started_after("2026-11-30T12:00:00.25").unwrap(), utc);
        let e = parse_started_after("yesterday").unwrap_err();
        assert!(format!("{e:?}").contains("RFC 3339"), "{e:?}");
    }
}
