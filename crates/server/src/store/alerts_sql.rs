//! The `alerts` table (migrations 9 and 13): alerts the rule engine raised, one row per
//! incident (its repeats update it: count, last time, rules), stored by the alerts service
//! and read by `GET /alerts`. Plain functions over a `rusqlite::Connection`, plus
//! [`AlertsDb`], the alerts service's own connection.

use std::path::Path;
use std::sync::{Arc, Mutex};

use kiln_rules::Priority;

use crate::audit::cursor::Cursor;
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
    /// The cursors of the audit records that triggered it (the first [`MAX_RECORDS`]).
    #[serde(serialize_with = "ids_str")]
    pub records: Vec<i64>,
    /// How many times the incident's rules fired (1: once).
    pub count: u64,
    /// The first and the newest firing (`firstSeen` is `timestamp`).
    #[serde(rename = "firstSeen", serialize_with = "rfc3339")]
    pub first_ms: i64,
    #[serde(rename = "lastSeen", serialize_with = "rfc3339")]
    pub last_ms: i64,
    /// Every rule that fired in the incident, first `rule`.
    pub rules: Vec<String>,
    /// The incident's name (the rules' `incident`; by default the rule's name).
    pub incident: String,
}

/// Most record ids an alert keeps.
pub const MAX_RECORDS: usize = 64;

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

const COLUMNS: &str = "id, ts, sandbox_id, team, rule, priority, output, tags, actions, \
                       records, count, last_ts, rules, incident";

fn from_row(r: &Row<'_>) -> rusqlite::Result<AlertRecord> {
    let ts: i64 = r.get(1)?;
    let rule: String = r.get(4)?;
    Ok(AlertRecord {
        id: r.get(0)?,
        ts_ms: ts,
        sandbox_id: r.get(2)?,
        team: r.get(3)?,
        priority: r.get(5)?,
        output: r.get(6)?,
        tags: json_list(r.get(7)?),
        actions: json_list(r.get(8)?),
        records: json_list(r.get(9)?),
        count: r.get::<_, i64>(10)?.max(1) as u64,
        first_ms: ts,
        last_ms: r.get::<_, Option<i64>>(11)?.unwrap_or(ts),
        rules: r
            .get::<_, Option<String>>(12)?
            .map(json_list)
            .unwrap_or_else(|| vec![rule.clone()]),
        incident: r
            .get::<_, Option<String>>(13)?
            .unwrap_or_else(|| rule.clone()),
        rule,
    })
}

/// Stores `a` as a new incident (its `id` is ignored); the stored alert.
pub fn insert(c: &Connection, a: &AlertRecord) -> Result<AlertRecord> {
    c.prepare_cached(
        "INSERT INTO alerts (ts, sandbox_id, team, rule, priority, output, tags, actions, records,
                             count, last_ts, rules, incident)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)",
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
        list(&a.records[..a.records.len().min(MAX_RECORDS)]),
        a.count as i64,
        a.last_ms,
        list(&a.rules),
        a.incident,
    ])?;
    Ok(AlertRecord {
        id: c.last_insert_rowid(),
        ..a.clone()
    })
}

/// Adds a repeat `a` (another firing of the same incident) to alert `id`: one more in its
/// count, its newest time, its rule, tags, actions and records added, the most urgent
/// priority kept; the alert as it now is (None: no such alert).
pub fn repeat(c: &Connection, id: i64, a: &AlertRecord) -> Result<Option<AlertRecord>> {
    let sql = format!("SELECT {COLUMNS} FROM alerts WHERE id = ?1");
    let Some(mut cur) = c
        .prepare_cached(&sql)?
        .query_row(params![id], from_row)
        .map(Some)
        .or_else(|e| match e {
            rusqlite::Error::QueryReturnedNoRows => Ok(None),
            e => Err(e),
        })?
    else {
        return Ok(None);
    };
    cur.count += 1;
    cur.last_ms = cur.last_ms.max(a.ts_ms);
    // (An unknown priority ranks below every known one.)
    if Priority::parse(&a.priority) > Priority::parse(&cur.priority) {
        cur.priority = a.priority.clone();
    }
    for (to, from) in [
        (&mut cur.rules, std::slice::from_ref(&a.rule)),
        (&mut cur.tags, &a.tags[..]),
        (&mut cur.actions, &a.actions[..]),
    ] {
        for x in from {
            if !to.contains(x) {
                to.push(x.clone());
            }
        }
    }
    for r in &a.records {
        if cur.records.len() < MAX_RECORDS && !cur.records.contains(r) {
            cur.records.push(*r);
        }
    }
    c.prepare_cached(
        "UPDATE alerts SET count = ?2, last_ts = ?3, priority = ?4, rules = ?5, tags = ?6,
                           actions = ?7, records = ?8
         WHERE id = ?1",
    )?
    .execute(params![
        id,
        cur.count as i64,
        cur.last_ms,
        cur.priority,
        list(&cur.rules),
        list(&cur.tags),
        list(&cur.actions),
        list(&cur.records),
    ])?;
    Ok(Some(cur))
}

/// A list stored as JSON text.
fn list<T: Serialize>(v: &[T]) -> String {
    serde_json::to_string(v).unwrap_or_else(|_| "[]".into())
}

/// What `GET /alerts` asks for.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct AlertFilter {
    pub sandbox_id: Option<String>,
    /// Only the sandboxes of this team.
    pub team: Option<String>,
    pub rule: Option<String>,
    /// Any of these priorities (all when empty).
    pub priorities: Vec<String>,
    pub since_ms: Option<i64>,
    pub until_ms: Option<i64>,
    /// Alerts after this position (one host's: an alert's id).
    pub after: Option<Cursor>,
    pub limit: usize,
}

/// Alerts matching `f`, oldest first, at most `f.limit` (`f.after` one host's position).
pub fn query(c: &Connection, f: &AlertFilter) -> Result<Vec<AlertRecord>> {
    let mut sql = format!("SELECT {COLUMNS} FROM alerts WHERE id > ?1");
    let after = f.after.as_ref().and_then(Cursor::local).unwrap_or(0);
    let mut args: Vec<rusqlite::types::Value> = vec![after.into()];
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
        add(
            &mut sql,
            " AND (rule = # OR EXISTS (SELECT 1 FROM json_each(alerts.rules) WHERE value = #))",
            r.clone().into(),
        );
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
    pub fn open(path: &Path) -> super::Result<Self> {
        let c = super::side_db::connect(path, super::side_db::Synchronous::Default)?;
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
            count: 1,
            first_ms: ts,
            last_ms: ts,
            rules: vec![rule.into()],
            incident: rule.into(),
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
                after: Some(crate::audit::cursor::Cursor::At(2)),
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
        assert_eq!(
            (v["count"].as_u64(), &v["lastSeen"]),
            (Some(1), &v["firstSeen"])
        );

        // A repeat of alert 1 by another rule of its incident: counted, merged, and found by
        // either rule's name.
        let mut again = mk("a", "r3", "emergency", 50);
        again.records = vec![4, 9];
        again.actions = vec!["kill".into()];
        let merged = repeat(&c, 1, &again).unwrap().unwrap();
        assert_eq!((merged.count, merged.first_ms, merged.last_ms), (2, 10, 50));
        assert_eq!(merged.rules, ["r1", "r3"]);
        assert_eq!(merged.records, [3, 4, 9]);
        assert_eq!(merged.actions, ["alert", "kill"]);
        assert_eq!(merged.priority, "emergency");
        assert_eq!(merged.rule, "r1");
        let by_r3 = q(AlertFilter {
            rule: Some("r3".into()),
            ..Default::default()
        });
        assert_eq!(by_r3, 1);
        let stored = &query(
            &c,
            &AlertFilter {
                limit: 1,
                ..Default::default()
            },
        )
        .unwrap()[0];
        assert_eq!(stored, &merged);
        assert!(repeat(&c, 99, &again).unwrap().is_none());
        // A row from before migration 13 reads as an incident of one.
        c.execute(
            "INSERT INTO alerts (ts, sandbox_id, rule, priority, output, tags, actions, records)
             VALUES (5, 'z', 'old', 'notice', 'o', '[]', '[]', '[]')",
            [],
        )
        .unwrap();
        let old = query(
            &c,
            &AlertFilter {
                sandbox_id: Some("z".into()),
                limit: 1,
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(
            (
                old[0].count,
                old[0].last_ms,
                &old[0].rules[..],
                &old[0].incident[..]
            ),
            (1, 5, &["old".to_string()][..], "old")
        );
    }
}
