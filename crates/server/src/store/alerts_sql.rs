//! The `alerts` table (migration 9): alerts the rule engine raised, stored by the alerts
//! service and read by `GET /alerts`. Plain functions over a `rusqlite::Connection`, plus
//! [`AlertsDb`], the alerts service's own connection.

use std::path::Path;
use std::sync::{Arc, Mutex};

use rusqlite::{params, Connection, Row};
use serde::Serialize;

type Result<T> = std::result::Result<T, rusqlite::Error>;

/// A stored alert.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct AlertRecord {
    #[serde(serialize_with = "id_str")]
    pub id: i64,
    #[serde(rename = "timestamp", serialize_with = "rfc3339")]
    pub ts_ms: i64,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    pub team: Option<String>,
    pub rule: String,
    pub priority: String,
    pub output: String,
    pub tags: Vec<String>,
    pub actions: Vec<String>,
    /// The cursors of the audit records that triggered it.
    #[serde(serialize_with = "ids_str")]
    pub records: Vec<i64>,
}

fn id_str<S: serde::Serializer>(v: &i64, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(&v.to_string())
}

fn ids_str<S: serde::Serializer>(v: &[i64], s: S) -> std::result::Result<S::Ok, S::Error> {
    s.collect_seq(v.iter().map(|i| i.to_string()))
}

fn rfc3339<S: serde::Serializer>(ms: &i64, s: S) -> std::result::Result<S::Ok, S::Error> {
    let t = chrono::DateTime::from_timestamp_millis(*ms).unwrap_or_default();
    s.serialize_str(&t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
}

fn json_list<T: serde::de::DeserializeOwned>(s: String) -> Vec<T> {
    serde_json::from_str(&s).unwrap_or_default()
}

fn from_row(r: &Row<'_>) -> rusqlite::Result<AlertRecord> {
    Ok(AlertRecord {
        id: r.get(0)?,
        ts_ms: r.get(1)?,
        sandbox_id: r.get(2)?,
        team: r.get(3)?,
        rule: r.get(4)?,
        priority: r.get(5)?,
        output: r.get(6)?,
        tags: json_list(r.get(7)?),
        actions: json_list(r.get(8)?),
        records: json_list(r.get(9)?),
    })
}

/// Stores `a` (its `id` is ignored); the stored alert.
pub fn insert(c: &Connection, a: &AlertRecord) -> Result<AlertRecord> {
    c.prepare_cached(
        "INSERT INTO alerts (ts, sandbox_id, team, rule, priority, output, tags, actions, records)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
    )?
    .execute(params![
        a.ts_ms,
        a.sandbox_id,
        a.team,
        a.rule,
        a.priority,
        a.output,
        list(&a.tags),
        list(&a.actions),
        list(&a.records),
    ])?;
    Ok(AlertRecord {
        id: c.last_insert_rowid(),
        ..a.clone()
    })
}

/// A list stored as JSON text.
fn list<T: Serialize>(v: &[T]) -> String {
    serde_json::to_string(v).unwrap_or_else(|_| "[]".into())
}

/// What `GET /alerts` asks for.
#[derive(Debug, Clone, Default)]
pub struct AlertFilter {
    pub sandbox_id: Option<String>,
    /// Only the sandboxes of this team.
    pub team: Option<String>,
    pub rule: Option<String>,
    /// Any of these priorities (all when empty).
    pub priorities: Vec<String>,
    pub since_ms: Option<i64>,
    pub until_ms: Option<i64>,
    /// Alerts after this id.
    pub after: Option<i64>,
    pub limit: usize,
}

/// Alerts matching `f`, oldest first, at most `f.limit`.
pub fn query(c: &Connection, f: &AlertFilter) -> Result<Vec<AlertRecord>> {
    let mut sql = String::from(
        "SELECT id, ts, sandbox_id, team, rule, priority, output, tags, actions, records
         FROM alerts WHERE id > ?1",
    );
    let mut args: Vec<rusqlite::types::Value> = vec![f.after.unwrap_or(0).into()];
    let mut add = |sql: &mut String, cond: &str, v: rusqlite::types::Value| {
        args.push(v);
        sql.push_str(&cond.replace('#', &format!("?{}", args.len())));
    };
    if let Some(s) = &f.sandbox_id {
        add(&mut sql, " AND sandbox_id = #", s.clone().into());
    }
    if let Some(t) = &f.team {
        add(
            &mut sql,
            " AND sandbox_id IN (SELECT id FROM sandboxes WHERE team = #)",
            t.clone().into(),
        );
    }
    if let Some(r) = &f.rule {
        add(&mut sql, " AND rule = #", r.clone().into());
    }
    if let Some(t) = f.since_ms {
        add(&mut sql, " AND ts >= #", t.into());
    }
    if let Some(t) = f.until_ms {
        add(&mut sql, " AND ts < #", t.into());
    }
    if !f.priorities.is_empty() {
        let mut marks = Vec::new();
        for p in &f.priorities {
            args.push(p.clone().into());
            marks.push(format!("?{}", args.len()));
        }
        sql.push_str(&format!(" AND priority IN ({})", marks.join(",")));
    }
    args.push((f.limit.max(1) as i64).into());
    sql.push_str(&format!(" ORDER BY id LIMIT ?{}", args.len()));
    let mut st = c.prepare_cached(&sql)?;
    let rows = st.query_map(rusqlite::params_from_iter(args), from_row)?;
    rows.collect()
}

/// The alerts service's connection to the state database (already migrated).
#[derive(Clone)]
pub struct AlertsDb(Arc<Mutex<Connection>>);

impl AlertsDb {
    pub fn open(path: &Path) -> Result<Self> {
        let c = Connection::open(path)?;
        c.busy_timeout(std::time::Duration::from_secs(10))?;
        c.pragma_update(None, "journal_mode", "WAL")?;
        Ok(Self(Arc::new(Mutex::new(c))))
    }

    /// Runs `f` on the connection on the blocking pool.
    pub async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection) -> Result<T> + Send + 'static,
    ) -> std::result::Result<T, String> {
        let c = self.0.clone();
        tokio::task::spawn_blocking(move || {
            let c = c.lock().unwrap_or_else(|p| p.into_inner());
            f(&c).map_err(|e| e.to_string())
        })
        .await
        .map_err(|e| e.to_string())?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insert_and_query() {
        let mut c = Connection::open_in_memory().unwrap();
        crate::store::migrations::migrate(&mut c).unwrap();
        let mk = |s: &str, rule: &str, prio: &str, ts| AlertRecord {
            id: 0,
            ts_ms: ts,
            sandbox_id: s.into(),
            team: None,
            rule: rule.into(),
            priority: prio.into(),
            output: "o".into(),
            tags: vec!["t".into()],
            actions: vec!["alert".into()],
            records: vec![3, 4],
        };
        let a = insert(&c, &mk("a", "r1", "critical", 10)).unwrap();
        insert(&c, &mk("b", "r2", "warning", 20)).unwrap();
        insert(&c, &mk("a", "r2", "warning", 30)).unwrap();
        assert_eq!(a.id, 1);
        let all = query(
            &c,
            &AlertFilter {
                limit: 10,
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(all.len(), 3);
        assert_eq!(all[0].records, [3, 4]);
        let q = |f: AlertFilter| query(&c, &AlertFilter { limit: 10, ..f }).unwrap().len();
        assert_eq!(
            q(AlertFilter {
                sandbox_id: Some("a".into()),
                ..Default::default()
            }),
            2
        );
        assert_eq!(
            q(AlertFilter {
                rule: Some("r2".into()),
                ..Default::default()
            }),
            2
        );
        assert_eq!(
            q(AlertFilter {
                priorities: vec!["critical".into()],
                ..Default::default()
            }),
            1
        );
        assert_eq!(
            q(AlertFilter {
                since_ms: Some(20),
                until_ms: Some(30),
                ..Default::default()
            }),
            1
        );
        assert_eq!(
            q(AlertFilter {
                after: Some(2),
                ..Default::default()
            }),
            1
        );
        let page = query(
            &c,
            &AlertFilter {
                limit: 2,
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(page.len(), 2);
        let v = serde_json::to_value(&all[0]).unwrap();
        assert_eq!(v["id"], "1");
        assert_eq!(v["sandboxID"], "a");
        assert_eq!(v["records"], serde_json::json!(["3", "4"]));
        assert_eq!(v["timestamp"], "1970-01-01T00:00:00.010Z");
    }
}
