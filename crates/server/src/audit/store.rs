//! The audit tables in the state database: appending to a chain (the writer's side), reading
//! records with filters and cursors, verifying chains, and pruning with anchors. Plain
//! functions over a `rusqlite::Connection`, so the writer thread and the readers share them.

use rusqlite::{params, Connection, OptionalExtension, Row};
use serde_json::Value;

use super::chain::{self, Break, Head, Start, GENESIS};
use super::record::{AuditRecord, Kind, NewRecord};

pub type Result<T> = std::result::Result<T, rusqlite::Error>;

const COLUMNS: &str = "id, sandbox_id, seq, ts, kind, body, prev_hash, hash";

fn from_row(r: &Row<'_>) -> rusqlite::Result<AuditRecord> {
    Ok(AuditRecord {
        cursor: r.get(0)?,
        sandbox_id: r.get(1)?,
        seq: r.get(2)?,
        ts_ms: r.get(3)?,
        kind: r.get(4)?,
        body: r.get(5)?,
        prev_hash: r.get(6)?,
        hash: r.get(7)?,
    })
}

/// The head of `sandbox_id`'s chain as recorded (None: no chain yet).
pub fn head(c: &Connection, sandbox_id: &str) -> Result<Option<Head>> {
    c.query_row(
        "SELECT seq, hash FROM audit_heads WHERE sandbox_id = ?1",
        [sandbox_id],
        |r| {
            Ok(Head {
                seq: r.get(0)?,
                hash: r.get(1)?,
            })
        },
    )
    .optional()
}

/// Appends `rec` after `prev` (the chain's head, None for a new chain starting at `start`),
/// returning the stored record.
pub fn append(
    c: &Connection,
    rec: &NewRecord,
    prev: Option<&Head>,
    start: &str,
) -> Result<AuditRecord> {
    let (seq, prev_hash) = match prev {
        Some(h) => (h.seq + 1, h.hash.clone()),
        None => (1, start.to_string()),
    };
    let body = chain::canonical(&rec.body);
    let kind = rec.kind.as_str();
    let hash = chain::hash(&prev_hash, seq, &rec.sandbox_id, rec.ts_ms, kind, &body);
    c.prepare_cached(
        "INSERT INTO audit (sandbox_id, seq, ts, kind, body, prev_hash, hash)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
    )?
    .execute(params![
        rec.sandbox_id,
        seq,
        rec.ts_ms,
        kind,
        body,
        prev_hash,
        hash
    ])?;
    let cursor = c.last_insert_rowid();
    c.prepare_cached(
        "INSERT INTO audit_heads (sandbox_id, seq, hash) VALUES (?1, ?2, ?3)
         ON CONFLICT(sandbox_id) DO UPDATE SET seq = excluded.seq, hash = excluded.hash",
    )?
    .execute(params![rec.sandbox_id, seq, hash])?;
    Ok(AuditRecord {
        cursor,
        sandbox_id: rec.sandbox_id.clone(),
        seq,
        ts_ms: rec.ts_ms,
        kind: kind.to_string(),
        body,
        prev_hash,
        hash,
    })
}

/// What a query asks for.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    pub sandbox_id: Option<String>,
    /// Only the sandboxes of this team (running, paused or ended).
    pub team: Option<String>,
    /// Any of these kinds (all when empty).
    pub kinds: Vec<Kind>,
    /// Records at or after this time (ms).
    pub since_ms: Option<i64>,
    /// Records before this time (ms).
    pub until_ms: Option<i64>,
    /// Records after this cursor.
    pub after: Option<i64>,
    pub limit: usize,
}

/// Records matching `f`, oldest first, at most `f.limit`.
pub fn query(c: &Connection, f: &Filter) -> Result<Vec<AuditRecord>> {
    let mut sql = format!("SELECT {COLUMNS} FROM audit WHERE id > ?1");
    let mut args: Vec<rusqlite::types::Value> = vec![f.after.unwrap_or(0).into()];
    if let Some(s) = &f.sandbox_id {
        args.push(s.clone().into());
        sql.push_str(&format!(" AND sandbox_id = ?{}", args.len()));
    }
    if let Some(t) = &f.team {
        args.push(t.clone().into());
        sql.push_str(&format!(
            " AND sandbox_id IN (SELECT id FROM sandboxes WHERE team = ?{})",
            args.len()
        ));
    }
    if !f.kinds.is_empty() {
        let mut marks = Vec::new();
        for k in &f.kinds {
            args.push(k.as_str().to_string().into());
            marks.push(format!("?{}", args.len()));
        }
        sql.push_str(&format!(" AND kind IN ({})", marks.join(",")));
    }
    if let Some(t) = f.since_ms {
        args.push(t.into());
        sql.push_str(&format!(" AND ts >= ?{}", args.len()));
    }
    if let Some(t) = f.until_ms {
        args.push(t.into());
        sql.push_str(&format!(" AND ts < ?{}", args.len()));
    }
    args.push((f.limit.max(1) as i64).into());
    sql.push_str(&format!(" ORDER BY id LIMIT ?{}", args.len()));
    let mut st = c.prepare_cached(&sql)?;
    let rows = st.query_map(rusqlite::params_from_iter(args), from_row)?;
    rows.collect()
}

/// The outcome of verifying one sandbox's chain.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    /// Records checked.
    pub records: usize,
    /// Records pruned by retention before the first one checked.
    pub pruned: i64,
    pub ok: bool,
    /// The first broken record's seq.
    pub first_bad_seq: Option<i64>,
    pub reason: Option<String>,
    /// The parent chain this one continues (fork or snapshot).
    pub parent: Option<String>,
}

/// Every sandbox with a chain (of `team`'s sandboxes only, when given), in the order chains
/// were started.
pub fn chains(c: &Connection, team: Option<&str>) -> Result<Vec<String>> {
    let mut st = c.prepare(
        "SELECT h.sandbox_id FROM audit_heads h
         LEFT JOIN (SELECT sandbox_id, MIN(id) AS first FROM audit GROUP BY sandbox_id) a
         ON a.sandbox_id = h.sandbox_id
         WHERE ?1 IS NULL OR h.sandbox_id IN (SELECT id FROM sandboxes WHERE team = ?1)
         ORDER BY a.first, h.sandbox_id",
    )?;
    let rows = st.query_map([team], |r| r.get(0))?;
    rows.collect()
}

/// The team sandbox `id` belongs (or belonged) to, if the store knows it.
pub fn team_of(c: &Connection, id: &str) -> Result<Option<String>> {
    use rusqlite::OptionalExtension;
    c.query_row("SELECT team FROM sandboxes WHERE id = ?1", [id], |r| {
        r.get(0)
    })
    .optional()
}

/// Verifies `sandbox_id`'s chain: every stored record against its hash and its predecessor,
/// no gaps, the recorded head at the end, the pruning anchor (if any) at the start, and a
/// fork's first record against its parent's record.
pub fn verify(c: &Connection, sandbox_id: &str) -> Result<Report> {
    let records: Vec<AuditRecord> = {
        let mut st = c.prepare(&format!(
            "SELECT {COLUMNS} FROM audit WHERE sandbox_id = ?1 ORDER BY seq"
        ))?;
        let rows = st.query_map([sandbox_id], from_row)?;
        rows.collect::<Result<_>>()?
    };
    let anchor: Option<(i64, String)> = c
        .query_row(
            "SELECT seq, hash FROM audit_anchors WHERE sandbox_id = ?1",
            [sandbox_id],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .optional()?;
    let head = head(c, sandbox_id)?;
    let first = records.first().map(AuditRecord::body_json);
    let parent = first.as_ref().and_then(|b| {
        (b["event"] == "chain_start")
            .then(|| b["parent"].as_str().map(str::to_string))
            .flatten()
    });
    let start = match (&anchor, &parent) {
        (Some((seq, hash)), _) => Start {
            seq: *seq,
            hash: Some(hash.clone()),
        },
        // Checked against the parent below.
        (None, Some(_)) => Start { seq: 0, hash: None },
        (None, None) => Start {
            seq: 0,
            hash: Some(GENESIS.to_string()),
        },
    };
    let mut result = chain::verify(&records, &start, head.as_ref());
    if result.is_ok() && anchor.is_none() {
        if let (Some(p), Some(r0)) = (&parent, records.first()) {
            result = check_parent_link(c, p, r0, first.as_ref());
        }
    }
    let (ok, first_bad_seq, reason) = match result {
        Ok(()) => (true, None, None),
        Err(Break { seq, reason }) => (false, Some(seq), Some(reason)),
    };
    Ok(Report {
        sandbox_id: sandbox_id.to_string(),
        records: records.len(),
        pruned: anchor.map(|a| a.0).unwrap_or(0),
        ok,
        first_bad_seq,
        reason,
        parent,
    })
}

fn check_parent_link(
    c: &Connection,
    parent: &str,
    first: &AuditRecord,
    body: Option<&Value>,
) -> std::result::Result<(), Break> {
    let pseq = body.and_then(|b| b["parentSeq"].as_i64()).unwrap_or(0);
    let expect: Option<String> = if pseq == 0 {
        Some(GENESIS.to_string())
    } else {
        c.query_row(
            "SELECT hash FROM audit WHERE sandbox_id = ?1 AND seq = ?2",
            params![parent, pseq],
            |r| r.get(0),
        )
        .optional()
        .ok()
        .flatten()
    };
    match expect {
        // The parent's record was pruned: the link cannot be checked, the chain itself was.
        None => Ok(()),
        Some(h) if h == first.prev_hash => Ok(()),
        Some(_) => Err(Break {
            seq: first.seq,
            reason: format!(
                "record {} does not link to record {pseq} of its parent {parent}",
                first.seq
            ),
        }),
    }
}

/// Retention: removes records older than `before_ms` and all but the newest `keep` records,
/// leaving for each chain an anchor (its last removed record's seq and hash) so what remains
/// still verifies. Returns how many records were removed.
pub fn prune(
    c: &Connection,
    before_ms: Option<i64>,
    keep: Option<u64>,
    now_ms: i64,
) -> Result<usize> {
    let mut cut: i64 = 0;
    if let Some(t) = before_ms {
        let by_age: Option<i64> =
            c.query_row("SELECT MAX(id) FROM audit WHERE ts < ?1", [t], |r| r.get(0))?;
        cut = cut.max(by_age.unwrap_or(0));
    }
    if let Some(n) = keep {
        let by_size: Option<i64> = c
            .query_row(
                "SELECT id FROM audit ORDER BY id DESC LIMIT 1 OFFSET ?1",
                [n as i64],
                |r| r.get(0),
            )
            .optional()?;
        cut = cut.max(by_size.unwrap_or(0));
    }
    if cut == 0 {
        return Ok(0);
    }
    // Ids grow along each chain, so what goes is a prefix of every chain it touches.
    c.execute(
        "INSERT INTO audit_anchors (sandbox_id, seq, hash, pruned_at)
         SELECT a.sandbox_id, a.seq, a.hash, ?2 FROM audit a
         JOIN (SELECT sandbox_id, MAX(seq) AS m FROM audit WHERE id <= ?1 GROUP BY sandbox_id) x
           ON a.sandbox_id = x.sandbox_id AND a.seq = x.m
         WHERE true
         ON CONFLICT(sandbox_id) DO UPDATE SET seq = excluded.seq, hash = excluded.hash,
           pruned_at = excluded.pruned_at",
        params![cut, now_ms],
    )?;
    c.execute("DELETE FROM audit WHERE id <= ?1", [cut])
}

/// The key that created `sandbox_id`, from its chain's first API record.
pub fn owner(c: &Connection, sandbox_id: &str) -> Result<Option<String>> {
    c.query_row(
        "SELECT json_extract(body, '$.key') FROM audit
         WHERE sandbox_id = ?1 AND kind = 'api' AND json_extract(body, '$.key') IS NOT NULL
         ORDER BY seq LIMIT 1",
        [sandbox_id],
        |r| r.get(0),
    )
    .optional()
}
