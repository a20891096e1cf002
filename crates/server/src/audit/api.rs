//! The audit routes: `GET /sandboxes/{id}/audit` and `GET /audit` (filters, cursor paging, or
//! `follow=true` for JSON lines as records are written) and `GET /audit/verify`.

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde_json::json;

use super::cursor::Cursor;
use super::filter::Filter;
use super::record::{AuditRecord, Kind};
use super::{AuditError, AuditLog};

/// Most records one page returns.
pub const MAX_LIMIT: usize = 1000;
pub const DEFAULT_LIMIT: usize = 100;

/// Query parameters of the audit routes.
#[derive(Debug, Default, serde::Deserialize)]
pub struct AuditQuery {
    /// Comma-separated kinds (`process,file,…`).
    pub kind: Option<String>,
    /// RFC 3339 time or Unix milliseconds.
    pub since: Option<String>,
    pub until: Option<String>,
    pub limit: Option<usize>,
    pub cursor: Option<String>,
    pub follow: Option<bool>,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: Option<String>,
}

/// A `cursor` parameter (none when absent or empty).
pub fn parse_cursor(c: Option<&str>) -> Result<Option<Cursor>, String> {
    c.filter(|c| !c.is_empty()).map(str::parse).transpose()
}

/// A time parameter: RFC 3339 or Unix milliseconds.
pub fn parse_time(s: &str) -> Result<i64, String> {
    if let Ok(ms) = s.trim().parse::<i64>() {
        return Ok(ms);
    }
    chrono::DateTime::parse_from_rfc3339(s.trim())
        .map(|t| t.timestamp_millis())
        .map_err(|_| format!("{s:?} is neither an RFC 3339 time nor Unix milliseconds"))
}

impl AuditQuery {
    /// The filter this query asks for (`sandbox` from the path wins).
    pub fn filter(&self, sandbox: Option<&str>) -> Result<Filter, String> {
        let mut kinds = Vec::new();
        for k in self
            .kind
            .as_deref()
            .unwrap_or("")
            .split(',')
            .map(str::trim)
            .filter(|k| !k.is_empty())
        {
            kinds.push(Kind::parse(k).ok_or_else(|| {
                format!(
                    "unknown audit kind {k:?} (one of {})",
                    Kind::ALL.map(|k| k.as_str()).join(", ")
                )
            })?);
        }
        let after = parse_cursor(self.cursor.as_deref())?;
        Ok(Filter {
            sandbox_id: sandbox
                .map(str::to_string)
                .or_else(|| self.sandbox_id.clone()),
            team: None,
            kinds,
            since_ms: self.since.as_deref().map(parse_time).transpose()?,
            until_ms: self.until.as_deref().map(parse_time).transpose()?,
            after,
            limit: self.limit.unwrap_or(DEFAULT_LIMIT).clamp(1, MAX_LIMIT),
        })
    }
}

fn matches(f: &Filter, r: &AuditRecord) -> bool {
    f.sandbox_id.as_ref().is_none_or(|s| s == &r.sandbox_id)
        && (f.kinds.is_empty() || f.kinds.iter().any(|k| k.as_str() == r.kind))
        && f.since_ms.is_none_or(|t| r.ts_ms >= t)
        && f.until_ms.is_none_or(|t| r.ts_ms < t)
}

/// One page: `{"records": […], "nextCursor": "…"}` (the cursor to pass for what follows; it
/// is present even on the last page, so a poller can resume from it).
pub async fn page(log: &AuditLog, f: Filter) -> Result<serde_json::Value, AuditError> {
    let p = log.page(f).await?;
    Ok(json!({ "records": p.items, "nextCursor": p.next.to_string() }))
}

fn line(r: &AuditRecord) -> Bytes {
    let mut v = serde_json::to_vec(r).unwrap_or_default();
    v.push(b'\n');
    Bytes::from(v)
}

/// How often a follower of a log kept elsewhere (a cluster's) reads what was stored since.
const POLL_EVERY: std::time::Duration = std::time::Duration::from_millis(500);

type Lines = tokio::sync::mpsc::Sender<Result<Bytes, std::io::Error>>;

/// Sends the stored records matching `f` after `f.after`, page by page, moving `f.after`;
/// false when the client went away or the store failed.
async fn catch_up(log: &AuditLog, f: &mut Filter, tx: &Lines) -> bool {
    f.limit = MAX_LIMIT;
    loop {
        let Ok(p) = log.page(f.clone()).await else {
            return false;
        };
        for r in &p.items {
            if tx.send(Ok(line(r))).await.is_err() {
                return false;
            }
        }
        f.after = Some(p.next);
        if p.items.len() < MAX_LIMIT {
            return true;
        }
    }
}

/// `follow=true`: the stored records matching `f`, then each new one as it is written, as JSON
/// lines, until the client goes away. Nothing is skipped: a follower that falls behind the
/// live feed reads the gap back from the store. A log kept elsewhere has no live feed here:
/// its followers read the store again every [`POLL_EVERY`].
pub fn follow(log: AuditLog, mut f: Filter) -> Response {
    if !log.enabled() {
        return (
            http::StatusCode::NOT_IMPLEMENTED,
            AuditError::Off.to_string(),
        )
            .into_response();
    }
    // Subscribed before the backlog is read, so nothing written meanwhile is missed.
    let live = log.subscribe();
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(64);
    tokio::spawn(async move {
        if !catch_up(&log, &mut f, &tx).await {
            return;
        }
        let Some(mut live) = live else {
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(POLL_EVERY) => {}
                    _ = tx.closed() => return,
                }
                if !catch_up(&log, &mut f, &tx).await {
                    return;
                }
            }
        };
        // A log published live is one host's: its positions are its records' cursors.
        let mut last = f.after.as_ref().and_then(Cursor::local).unwrap_or(0);
        // Whether each sandbox seen live is the team's (when the follower is scoped to one).
        let mut of_team: std::collections::HashMap<String, bool> = Default::default();
        loop {
            // Ends as soon as the client goes away, even while nothing matching is written.
            let next = tokio::select! {
                r = live.recv() => r,
                _ = tx.closed() => return,
            };
            match next {
                Ok(r) => {
                    if r.cursor <= last || !matches(&f, &r) {
                        continue;
                    }
                    if let Some(team) = &f.team {
                        let known = of_team.get(&r.sandbox_id).copied();
                        let ours = match known {
                            Some(v) => v,
                            // (Not cached while unknown: the sandbox's row may be on its way.)
                            None => match log.team_of(&r.sandbox_id).await.ok().flatten() {
                                Some(t) => {
                                    *of_team.entry(r.sandbox_id.clone()).or_insert(&t == team)
                                }
                                None => false,
                            },
                        };
                        if !ours {
                            continue;
                        }
                    }
                    last = r.cursor;
                    if tx.send(Ok(line(&r))).await.is_err() {
                        return;
                    }
                }
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {
                    f.after = Some(Cursor::At(last));
                    if !catch_up(&log, &mut f, &tx).await {
                        return;
                    }
                    last = f.after.as_ref().and_then(Cursor::local).unwrap_or(last);
                }
                Err(_) => return,
            }
        }
    });
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    });
    Response::builder()
        .header(http::header::CONTENT_TYPE, "application/x-ndjson")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| http::StatusCode::INTERNAL_SERVER_ERROR.into_response())
}
