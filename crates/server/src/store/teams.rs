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
        max_volumes: r.get("max_volumes")?,
        created_at_ms: r.get("created_at")?,
    })
}

pub(super) fn upsert(c: &Connection, t: &TeamRecord) -> Result<()> {
    c.execute(
        "INSERT INTO teams (name, max_sandboxes, max_timeout_secs, creates_per_minute, created_at,
           max_volumes)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6)
         ON CONFLICT(name) DO UPDATE SET max_sandboxes = ?2, max_timeout_secs = ?3,
           creates_per_minute = ?4, max_volumes = ?6",
        params![
            t.name,
            t.max_sandboxes,
            t.max_timeout_secs.map(|v| v.min(i64::MAX as u64) as i64),
            t.creates_per_minute,
            t.created_at_ms,
            t.max_volumes,
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

#[cfg(test)]
mod tests {
    use crate::store::{AccessStore, KeyRecord, SqliteStore, TeamRecord};

    #[tokio::test]
    async fn teams_and_team_columns_round_trip() {
        let s = SqliteStore::open_in_memory().unwrap();
        assert!(s.get_team("red").await.unwrap().is_none());
        let mut t = TeamRecord {
            name: "red".into(),
            max_sandboxes: Some(3),
            max_timeout_secs: Some(u64::MAX),
            creates_per_minute: None,
            max_volumes: Some(4),
            created_at_ms: 7,
        };
        s.upsert_team(&t).await.unwrap();
        let got = s.get_team("red").await.unwrap().unwrap();
        assert_eq!(got.max_sandboxes, Some(3));
        assert_eq!(got.max_volumes, Some(4));
        assert_eq!(
            got.max_timeout_secs,
            Some(i64::MAX as u64),
            "clamped, not wrapped"
        );
        t.max_sandboxes = None;
        t.created_at_ms = 99;
        s.upsert_team(&t).await.unwrap();
        let got = s.get_team("red").await.unwrap().unwrap();
        assert_eq!((got.max_sandboxes, got.created_at_ms), (None, 7));
        assert_eq!(s.list_teams().await.unwrap().len(), 1);
        let k = KeyRecord {
            id: "k".into(),
            name: "n".into(),
            prefix: "e2b_".into(),
            hash: "h".into(),
            created_at_ms: 1,
            last_used_ms: None,
            revoked_at_ms: None,
            team: "red".into(),
        };
        s.insert_key(&k).await.unwrap();
        assert_eq!(s.key_by_hash("h").await.unwrap().unwrap().team, "red");
    }

    /// Keys and sandboxes from before teams existed belong to `default`.
    #[tokio::test]
    async fn rows_from_before_teams_are_in_the_default_team() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("kiln.db");
        {
            let c = rusqlite::Connection::open(&db).unwrap();
            for sql in &crate::store::MIGRATIONS[..3] {
                c.execute_batch(sql).unwrap();
            }
            c.pragma_update(None, "user_version", 3).unwrap();
            c.execute(
                "INSERT INTO api_keys (id, name, prefix, hash, created_at) \
                 VALUES ('old', 'old', 'e2b_', 'oldhash', 1)",
                [],
            )
            .unwrap();
        }
        let s = SqliteStore::open(&db).unwrap();
        assert_eq!(
            s.key_by_hash("oldhash").await.unwrap().unwrap().team,
            "default"
        );
    }
}
