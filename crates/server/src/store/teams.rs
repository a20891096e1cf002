//! SQL of the `teams` table (per-team quotas), used by [`super::SqliteStore`].

use rusqlite::{params, Connection, OptionalExtension, Row};

use super::{Result, TeamRecord};

fn from_row(r: &Row<'_>) -> rusqlite::Result<TeamRecord> {
    Ok(TeamRecord {
        name: r.get("name")?,
        max_sandboxes: r.get("max_sandboxes")?,
        max_timeout_secs: r
            .get::<_, Option<i64>>("max_timeout_secs")?
            .map(|v| v.max(0) as u64),
        creates_per_minute: r.get("creates_per_minute")?,
        created_at_ms: r.get("created_at")?,
    })
}

pub(super) fn upsert(c: &Connection, t: &TeamRecord) -> Result<()> {
    c.execute(
        "INSERT INTO teams (name, max_sandboxes, max_timeout_secs, creates_per_minute, created_at)
         VALUES (?1, ?2, ?3, ?4, ?5)
         ON CONFLICT(name) DO UPDATE SET max_sandboxes = ?2, max_timeout_secs = ?3,
           creates_per_minute = ?4",
        params![
            t.name,
            t.max_sandboxes,
            t.max_timeout_secs.map(|v| v.min(i64::MAX as u64) as i64),
            t.creates_per_minute,
            t.created_at_ms,
        ],
    )?;
    Ok(())
}

pub(super) fn get(c: &Connection, name: &str) -> Result<Option<TeamRecord>> {
    Ok(
        c.query_row("SELECT * FROM teams WHERE name = ?1", [name], from_row)
            .optional()?,
    )
}

pub(super) fn list(c: &Connection) -> Result<Vec<TeamRecord>> {
    let mut stmt = c.prepare("SELECT * FROM teams ORDER BY name")?;
    let rows = stmt.query_map([], from_row)?;
    Ok(rows.collect::<rusqlite::Result<Vec<_>>>()?)
}
