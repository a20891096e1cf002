//! SQL of the observability tables (event log pages, webhooks, their delivery queue), as
//! functions on a connection that [`super::SqliteStore`] runs on its blocking pool.

use rusqlite::{params, Connection, OptionalExtension, Row};

use super::{
    Attempt, DeliveryRecord, DeliveryStatus, Event, EventQuery, Result, StoredEvent, WebhookRecord,
    LIFECYCLE_KINDS,
};

fn event_from_row(r: &Row<'_>) -> rusqlite::Result<StoredEvent> {
    Ok(StoredEvent {
        seq: r.get("seq")?,
        event: Event {
            ts_ms: r.get("ts")?,
            sandbox_id: r.get("sandbox_id")?,
            kind: r.get("kind")?,
            detail: r.get("detail")?,
        },
    })
}

pub fn events_page(c: &Connection, q: &EventQuery) -> Result<Vec<StoredEvent>> {
    let mut sql = String::from("SELECT seq, ts, sandbox_id, kind, detail FROM events WHERE 1=1");
    let mut args: Vec<rusqlite::types::Value> = Vec::new();
    if let Some(after) = q.after_seq {
        sql.push_str(" AND seq > ?");
        args.push(after.into());
    } else if let Some(since) = q.since_ms {
        sql.push_str(" AND ts >= ?");
        args.push(since.into());
    }
    if let Some(id) = &q.sandbox_id {
        sql.push_str(" AND sandbox_id = ?");
        args.push(id.clone().into());
    }
    if let Some(team) = &q.team {
        sql.push_str(" AND sandbox_id IN (SELECT id FROM sandboxes WHERE team = ?)");
        args.push(team.clone().into());
    }
    if !q.kinds.is_empty() {
        sql.push_str(" AND kind IN (");
        sql.push_str(&vec!["?"; q.kinds.len()].join(","));
        sql.push(')');
        args.extend(q.kinds.iter().map(|k| k.clone().into()));
    }
    sql.push_str(" ORDER BY seq LIMIT ?");
    args.push(i64::from(q.limit).into());
    let mut stmt = c.prepare(&sql)?;
    let rows = stmt.query_map(rusqlite::params_from_iter(args), event_from_row)?;
    Ok(rows.collect::<rusqlite::Result<Vec<_>>>()?)
}

fn webhook_from_row(r: &Row<'_>) -> rusqlite::Result<(WebhookRecord, String)> {
    Ok((
        WebhookRecord {
            id: r.get("id")?,
            team: r.get("team")?,
            url: r.get("url")?,
            secret: r.get("secret")?,
            events: Vec::new(),
            created_at_ms: r.get("created_at")?,
        },
        r.get("events")?,
    ))
}

fn finish_webhook(row: (WebhookRecord, String)) -> Result<WebhookRecord> {
    let (mut w, events) = row;
    w.events = serde_json::from_str(&events)?;
    Ok(w)
}

pub fn insert_webhook(c: &Connection, w: &WebhookRecord) -> Result<()> {
    c.execute(
        "INSERT INTO webhooks (id, team, url, secret, events, created_at)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        params![
            w.id,
            w.team,
            w.url,
            w.secret,
            serde_json::to_string(&w.events)?,
            w.created_at_ms
        ],
    )?;
    Ok(())
}

fn all_webhooks(c: &Connection, team: Option<&str>) -> Result<Vec<WebhookRecord>> {
    let mut stmt =
        c.prepare("SELECT * FROM webhooks WHERE ?1 IS NULL OR team = ?1 ORDER BY created_at, id")?;
    let rows = stmt.query_map([team], webhook_from_row)?;
    let mut out = Vec::new();
    for r in rows {
        out.push(finish_webhook(r?)?);
    }
    Ok(out)
}

pub fn list_webhooks(c: &Connection, team: &str) -> Result<Vec<WebhookRecord>> {
    all_webhooks(c, Some(team))
}

pub fn get_webhook(c: &Connection, team: &str, id: &str) -> Result<Option<WebhookRecord>> {
    c.query_row(
        "SELECT * FROM webhooks WHERE id = ?1 AND team = ?2",
        [id, team],
        webhook_from_row,
    )
    .optional()?
    .map(finish_webhook)
    .transpose()
}

pub fn delete_webhook(c: &mut Connection, team: &str, id: &str) -> Result<bool> {
    let tx = c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    let n = tx.execute(
        "DELETE FROM webhooks WHERE id = ?1 AND team = ?2",
        [id, team],
    )?;
    if n > 0 {
        tx.execute("DELETE FROM webhook_deliveries WHERE webhook_id = ?1", [id])?;
    }
    tx.commit()?;
    Ok(n > 0)
}

/// The JSON body a webhook receives for event `e`.
pub fn event_payload(w: &WebhookRecord, e: &StoredEvent) -> String {
    serde_json::json!({
        "type": format!("sandbox.{}", e.event.kind),
        "webhookID": w.id,
        "team": w.team,
        "event": {
            "id": e.seq.to_string(),
            "timestamp": chrono::DateTime::from_timestamp_millis(e.event.ts_ms)
                .unwrap_or_default()
                .to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            "sandboxID": e.event.sandbox_id,
            "type": e.event.kind,
            "detail": e.event.detail,
        },
    })
    .to_string()
}

/// Whether webhook `w` receives events of `kind`.
pub fn wants(w: &WebhookRecord, kind: &str) -> bool {
    if w.events.is_empty() {
        LIFECYCLE_KINDS.contains(&kind)
    } else {
        w.events.iter().any(|k| k == kind || k == "*")
    }
}

pub fn queue_deliveries(c: &mut Connection, now_ms: i64, max_events: u32) -> Result<usize> {
    let tx = c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    let cursor: i64 = tx.query_row("SELECT seq FROM webhook_cursor WHERE id = 1", [], |r| {
        r.get(0)
    })?;
    let events = events_page(
        &tx,
        &EventQuery {
            after_seq: Some(cursor),
            limit: max_events,
            ..EventQuery::default()
        },
    )?;
    let Some(last) = events.last().map(|e| e.seq) else {
        return Ok(0);
    };
    let hooks = all_webhooks(&tx, None)?;
    let mut queued = 0;
    // A webhook hears only of its own team's sandboxes.
    let mut teams: std::collections::HashMap<String, Option<String>> = Default::default();
    for e in &events {
        let sid = &e.event.sandbox_id;
        if !teams.contains_key(sid) {
            let team = tx
                .query_row("SELECT team FROM sandboxes WHERE id = ?1", [sid], |r| {
                    r.get(0)
                })
                .optional()?;
            teams.insert(sid.clone(), team);
        }
        let team = teams[sid].as_deref().unwrap_or(super::DEFAULT_TEAM);
        for w in hooks
            .iter()
            .filter(|w| w.team == team && wants(w, &e.event.kind))
        {
            tx.execute(
                "INSERT INTO webhook_deliveries (webhook_id, event_seq, kind, payload, status,
                   next_attempt_at, created_at) VALUES (?1, ?2, ?3, ?4, 'pending', ?5, ?5)",
                params![w.id, e.seq, e.event.kind, event_payload(w, e), now_ms],
            )?;
            queued += 1;
        }
    }
    tx.execute("UPDATE webhook_cursor SET seq = ?1 WHERE id = 1", [last])?;
    tx.commit()?;
    Ok(queued)
}

pub fn enqueue_delivery(
    c: &Connection,
    webhook_id: &str,
    kind: &str,
    payload: &str,
    now_ms: i64,
) -> Result<i64> {
    c.execute(
        "INSERT INTO webhook_deliveries (webhook_id, kind, payload, status, next_attempt_at,
           created_at) VALUES (?1, ?2, ?3, 'pending', ?4, ?4)",
        params![webhook_id, kind, payload, now_ms],
    )?;
    Ok(c.last_insert_rowid())
}

fn delivery_from_row(r: &Row<'_>) -> rusqlite::Result<DeliveryRecord> {
    Ok(DeliveryRecord {
        id: r.get("id")?,
        webhook_id: r.get("webhook_id")?,
        event_seq: r.get("event_seq")?,
        kind: r.get("kind")?,
        payload: r.get("payload")?,
        status: DeliveryStatus::parse(&r.get::<_, String>("status")?),
        attempts: r.get("attempts")?,
        next_attempt_ms: r.get("next_attempt_at")?,
        created_at_ms: r.get("created_at")?,
        last_attempt_ms: r.get("last_attempt_at")?,
        last_status_code: r.get("last_status")?,
        last_error: r.get("last_error")?,
    })
}

pub fn due_deliveries(
    c: &Connection,
    now_ms: i64,
    limit: u32,
) -> Result<Vec<(DeliveryRecord, WebhookRecord)>> {
    let mut stmt = c.prepare(
        "SELECT * FROM webhook_deliveries WHERE status = 'pending' AND next_attempt_at <= ?1
         ORDER BY next_attempt_at, id LIMIT ?2",
    )?;
    let due = stmt
        .query_map(params![now_ms, limit], delivery_from_row)?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    let mut out = Vec::with_capacity(due.len());
    for d in due {
        let w = c
            .query_row(
                "SELECT * FROM webhooks WHERE id = ?1",
                [&d.webhook_id],
                webhook_from_row,
            )
            .optional()?;
        if let Some(w) = w {
            out.push((d, finish_webhook(w)?));
        }
    }
    Ok(out)
}

pub fn record_attempt(c: &Connection, id: i64, a: &Attempt) -> Result<()> {
    let status = match (a.delivered, a.retry_at_ms) {
        (true, _) => DeliveryStatus::Delivered,
        (false, Some(_)) => DeliveryStatus::Pending,
        (false, None) => DeliveryStatus::Failed,
    };
    c.execute(
        "UPDATE webhook_deliveries SET attempts = attempts + 1, last_attempt_at = ?2,
           last_status = ?3, last_error = ?4, status = ?5,
           next_attempt_at = COALESCE(?6, next_attempt_at) WHERE id = ?1",
        params![
            id,
            a.at_ms,
            a.status_code,
            a.error,
            status.as_str(),
            a.retry_at_ms
        ],
    )?;
    Ok(())
}

pub fn deliveries(
    c: &Connection,
    webhook_id: &str,
    before: Option<i64>,
    limit: u32,
) -> Result<Vec<DeliveryRecord>> {
    let mut stmt = c.prepare(
        "SELECT * FROM webhook_deliveries WHERE webhook_id = ?1 AND (?2 IS NULL OR id < ?2)
         ORDER BY id DESC LIMIT ?3",
    )?;
    let rows = stmt.query_map(params![webhook_id, before, limit], delivery_from_row)?;
    Ok(rows.collect::<rusqlite::Result<Vec<_>>>()?)
}

#[cfg(test)]
#[path = "obs_sql_tests.rs"]
mod tests;
