//! `GET /alerts`: alerts the rule engine raised, oldest first, with filters and cursor
//! paging; scoped to the caller's team like `GET /events` (the operator's team sees all).

use axum::extract::Query;
use axum::{Extension, Json};
use http::StatusCode;
use kiln_rules::Priority;
use serde_json::{json, Value};

use super::{ApiError, ApiResult, St};
use crate::audit::api::{parse_cursor, parse_time, DEFAULT_LIMIT, MAX_LIMIT};
use crate::audit::AuditError;
use crate::store::alerts_sql::AlertFilter;
use crate::tenancy::Caller;

/// Query parameters of `GET /alerts`.
#[derive(Debug, Default, serde::Deserialize)]
pub struct AlertsQuery {
    #[serde(rename = "sandboxID")]
    pub sandbox_id: Option<String>,
    pub rule: Option<String>,
    /// Comma-separated priorities (`critical,error`).
    pub priority: Option<String>,
    /// RFC 3339 time or Unix milliseconds.
    pub since: Option<String>,
    pub until: Option<String>,
    pub cursor: Option<String>,
    pub limit: Option<usize>,
}

impl AlertsQuery {
    fn filter(&self) -> Result<AlertFilter, String> {
        let mut priorities = Vec::new();
        for p in self
            .priority
            .as_deref()
            .unwrap_or("")
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
        {
            let p = if p == "info" { "informational" } else { p };
            if !Priority::ALL.iter().any(|x| x.as_str() == p) {
                let most_urgent_first: Vec<&str> =
                    Priority::ALL.iter().rev().map(|x| x.as_str()).collect();
                return Err(format!(
                    "unknown priority {p:?} (one of {})",
                    most_urgent_first.join(", ")
                ));
            }
            priorities.push(p.to_string());
        }
        let after = parse_cursor(self.cursor.as_deref())?;
        Ok(AlertFilter {
            sandbox_id: self.sandbox_id.clone().filter(|s| !s.is_empty()),
            team: None,
            rule: self.rule.clone().filter(|s| !s.is_empty()),
            priorities,
            since_ms: self.since.as_deref().map(parse_time).transpose()?,
            until_ms: self.until.as_deref().map(parse_time).transpose()?,
            after,
            limit: self.limit.unwrap_or(DEFAULT_LIMIT).clamp(1, MAX_LIMIT),
        })
    }
}

/// `GET /alerts?sandboxID&rule&priority&since&until&cursor&limit`:
/// `{"alerts": […], "nextCursor": "…"}` (the cursor is present even on the last page, so a
/// poller resumes from it).
pub async fn list(
    st: St,
    Extension(c): Extension<Caller>,
    Query(q): Query<AlertsQuery>,
) -> ApiResult<Json<Value>> {
    let team = super::scope::team_scope(&st.0, &c, q.sandbox_id.as_deref()).await?;
    let mut f = q.filter().map_err(ApiError::bad_request)?;
    f.team = team;
    let page = st.0.audit.alerts(f).await.map_err(|e| match e {
        AuditError::Off => ApiError::new(
            StatusCode::NOT_IMPLEMENTED,
            "alerts need the audit log, which is off on this server (kiln serve --audit off)",
        ),
        other => super::audit::read_refusal(other, "alerts query"),
    })?;
    Ok(Json(
        json!({ "alerts": page.items, "nextCursor": page.next.to_string() }),
    ))
}

#[cfg(test)]
mod tests {
    use super::AlertsQuery;

    #[test]
    fn filters() {
        let q = AlertsQuery {
            priority: Some("critical, info".into()),
            since: Some("1000".into()),
            cursor: Some("5".into()),
            limit: Some(5000),
            ..Default::default()
        };
        let f = q.filter().unwrap();
        assert_eq!(f.priorities, ["critical", "informational"]);
        assert_eq!(
            (f.since_ms, f.after, f.limit),
            (Some(1000), Some(crate::audit::cursor::Cursor::At(5)), 1000)
        );
        let bad = AlertsQuery {
            priority: Some("loud".into()),
            ..Default::default()
        };
        assert!(bad.filter().unwrap_err().contains("unknown priority"));
        let bad = AlertsQuery {
            cursor: Some("-1".into()),
            ..Default::default()
        };
        assert!(bad.filter().is_err());
    }
}
