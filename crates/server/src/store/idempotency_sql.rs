//! SQL of the `idempotency` table (the answers of creates made with an `Idempotency-Key`, so a
//! retry after a server restart gets the same sandbox), used by [`super::SqliteStore`].

use rusqlite::{params, Connection, OptionalExtension, Row};

use super::{IdempotentAnswer, Result};

fn from_row(r: &Row<'_>) -> rusqlite::Result<IdempotentAnswer> {
    Ok(IdempotentAnswer {
        scope: r.get("scope")?,
        key: r.get("key")?,
        fingerprint: r.get("fingerprint")?,
        status: r.get("status")?,
        content_type: r.get("content_type")?,
        body: r.get("body")?,
        created_at_ms: r.get("created_at")?,
    })
}

/// Records an answer (replacing an older one of the same scope and key).
pub(super) fn put(c: &Connection, a: &IdempotentAnswer) -> Result<()> {
    c.execute(
        "INSERT OR REPLACE INTO idempotency
           (scope, key, fingerprint, status, content_type, body, created_at)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
        params![
            a.scope,
            a.key,
            a.fingerprint,
            a.status,
            a.content_type,
            a.body,
            a.created_at_ms
        ],
    )?;
    Ok(())
}

/// The answer recorded for `scope` and `key` at or after `since_ms`; older ones are deleted.
pub(super) fn get(
    c: &Connection,
    scope: &str,
    key: &str,
    since_ms: i64,
) -> Result<Option<IdempotentAnswer>> {
    c.execute(
        "DELETE FROM idempotency WHERE created_at < ?1",
        params![since_ms],
    )?;
    Ok(c.query_row(
        "SELECT * FROM idempotency WHERE scope = ?1 AND key = ?2",
        params![scope, key],
        from_row,
    )
    .optional()?)
}
