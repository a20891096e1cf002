//! The audit tables (migration 4: `audit`, `audit_heads`, `audit_anchors`) behind
//! [`AuditStore`]: two connections of their own to the state database, one for the audit
//! writer's appends and pruning (with the chain heads it has seen), one for readers, so a
//! reader never waits behind a batch being written.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use rusqlite::{params, Connection, OptionalExtension, Row, TransactionBehavior};

use crate::audit::chain::{self, Head, GENESIS};
use crate::audit::cursor::{Cursor, Page};
use crate::audit::filter::Filter;
use crate::audit::guard::{ChainGuard, HeadMove};
use crate::audit::record::{Append, AuditRecord};

use super::aggregates::{AuditStore, StoredChain};
use super::alerts_sql::{self, AlertFilter, AlertRecord};
use super::side_db::{connect, Synchronous};
use super::Result;

const COLUMNS: &str = "id, sandbox_id, seq, ts, kind, body, prev_hash, hash";

/// The writer's connection and the heads of the chains it has appended to or read.
struct Writer {
    conn: Connection,
    heads: HashMap<String, Head>,
}

/// The SQLite [`AuditStore`].
pub struct SqliteAuditStore {
    writer: Mutex<Writer>,
    reader: Mutex<Connection>,
    /// Where the chains' heads are kept beyond this database (a cluster node's etcd).
    guard: OnceLock<Arc<dyn ChainGuard>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl SqliteAuditStore {
    /// Opens the audit tables of the (already migrated) state database at `path`.
    pub fn open(path: &Path) -> Result<Self> {
        Ok(Self::wrap(
            connect(path, Synchronous::Normal)?,
            connect(path, Synchronous::Normal)?,
        ))
    }

    /// A store over an empty in-memory database (tests that never read it).
    #[cfg(test)]
    pub(crate) fn open_in_memory() -> Result<Self> {
        Ok(Self::wrap(
            Connection::open_in_memory()?,
            Connection::open_in_memory()?,
        ))
    }

    fn wrap(writer: Connection, reader: Connection) -> Self {
        Self {
            writer: Mutex::new(Writer {
                conn: writer,
                heads: HashMap::new(),
            }),
            reader: Mutex::new(reader),
            guard: OnceLock::new(),
        }
    }
}

impl AuditStore for SqliteAuditStore {
    fn append(&self, batch: &[Append]) -> Result<Vec<AuditRecord>> {
        let mut w = lock(&self.writer);
        let Writer { conn, heads } = &mut *w;
        let guard = self.guard.get().map(|g| g.as_ref());
        let mut refused = HashSet::new();
        loop {
            let r = append(conn, heads, batch, guard, &refused);
            if !matches!(r, Ok(Ok(_))) {
                // The cached heads may be ahead of what was committed.
                heads.clear();
            }
            match r {
                Ok(Ok(out)) => return Ok(out),
                // Written again without the refused chains' records.
                Ok(Err(more)) if !more.is_subset(&refused) => refused.extend(more),
                Ok(Err(_)) => {
                    return Err(super::StoreError::Task(
                        "the chain guard refused chains it was not asked about".into(),
                    ))
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn set_guard(&self, guard: Arc<dyn ChainGuard>) -> bool {
        self.guard.set(guard).is_ok()
    }

    fn prune(&self, before_ms: Option<i64>, keep: Option<u64>, now_ms: i64) -> Result<usize> {
        let mut w = lock(&self.writer);
        let tx = w
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)?;
        let n = prune(&tx, before_ms, keep, now_ms)?;
        tx.commit()?;
        Ok(n)
    }

    fn query(&self, f: &Filter) -> Result<Vec<AuditRecord>> {
        one_hosts(f.after.as_ref())?;
        Ok(query(&lock(&self.reader), f)?)
    }

    fn chains(&self, team: Option<&str>) -> Result<Vec<String>> {
        let c = lock(&self.reader);
        let mut st = c.prepare(
            "SELECT h.sandbox_id FROM audit_heads h
             LEFT JOIN (SELECT sandbox_id, MIN(id) AS first FROM audit GROUP BY sandbox_id) a
             ON a.sandbox_id = h.sandbox_id
             WHERE ?1 IS NULL OR h.sandbox_id IN (SELECT id FROM sandboxes WHERE team = ?1)
             ORDER BY a.first, h.sandbox_id",
        )?;
        let rows = st.query_map([team], |r| r.get(0))?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    fn chain(&self, sandbox_id: &str) -> Result<StoredChain> {
        let c = lock(&self.reader);
        let records = {
            let mut st = c.prepare(&format!(
                "SELECT {COLUMNS} FROM audit WHERE sandbox_id = ?1 ORDER BY seq"
            ))?;
            let rows = st.query_map([sandbox_id], from_row)?;
            rows.collect::<rusqlite::Result<_>>()?
        };
        let anchor = c
            .query_row(
                "SELECT seq, hash FROM audit_anchors WHERE sandbox_id = ?1",
                [sandbox_id],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()?;
        let head = head(&c, sandbox_id)?;
        Ok(StoredChain {
            records,
            anchor,
            head,
        })
    }

    fn record_hash(&self, sandbox_id: &str, seq: i64) -> Result<Option<String>> {
        Ok(lock(&self.reader)
            .query_row(
                "SELECT hash FROM audit WHERE sandbox_id = ?1 AND seq = ?2",
                params![sandbox_id, seq],
                |r| r.get(0),
            )
            .optional()?)
    }

    fn owner(&self, sandbox_id: &str) -> Result<Option<String>> {
        Ok(lock(&self.reader)
            .query_row(
                "SELECT json_extract(body, '$.key') FROM audit
                 WHERE sandbox_id = ?1 AND kind = 'api' AND json_extract(body, '$.key') IS NOT NULL
                 ORDER BY seq LIMIT 1",
                [sandbox_id],
                |r| r.get(0),
            )
            .optional()?)
    }

    fn team_of(&self, id: &str) -> Result<Option<String>> {
        Ok(lock(&self.reader)
            .query_row("SELECT team FROM sandboxes WHERE id = ?1", [id], |r| {
                r.get(0)
            })
            .optional()?)
    }

    fn alerts(&self, f: &AlertFilter) -> Result<Page<AlertRecord>> {
        one_hosts(f.after.as_ref())?;
        let items = alerts_sql::query(&lock(&self.reader), f)?;
        Ok(Page::local(items, f.after.as_ref(), |a| a.id))
    }
}

/// Refuses a cluster's cursor (one host's log numbers its records itself).
fn one_hosts(after: Option<&Cursor>) -> Result<()> {
    match after {
        Some(Cursor::Nodes(_)) => Err(super::StoreError::Invalid(
            "this cursor is a kiln cluster's; this server's cursors are numbers (pass the \
             nextCursor of one of its own pages)"
                .into(),
        )),
        _ => Ok(()),
    }
}

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
fn head(c: &Connection, sandbox_id: &str) -> rusqlite::Result<Option<Head>> {
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

/// The head of `id`'s chain: from `heads`, else as recorded (then remembered).
fn cached_head(
    c: &Connection,
    heads: &mut HashMap<String, Head>,
    id: &str,
) -> rusqlite::Result<Option<Head>> {
    if let Some(h) = heads.get(id) {
        return Ok(Some(h.clone()));
    }
    let h = head(c, id)?;
    if let Some(h) = &h {
        heads.insert(id.to_string(), h.clone());
    }
    Ok(h)
}

/// What an append stored, or the chains its guard refused (then nothing was written).
type Written = std::result::Result<Vec<AuditRecord>, HashSet<String>>;

fn guarded<T>(r: std::result::Result<T, String>) -> Result<T> {
    r.map_err(|e| super::StoreError::Task(format!("the chains' heads: {e}")))
}

/// One write of an append, sealed before the write begins.
enum Step {
    Insert(AuditRecord),
    Continue(String, Head),
}

/// Appends `batch`, leaving out the records of `refused` chains: the records are sealed
/// against the chains' heads first (only this writer appends, so the heads cannot move
/// meanwhile), the guard, when there is one, moves the heads (no database lock is held while
/// it asks elsewhere), then one transaction writes them.
fn append(
    conn: &mut Connection,
    heads: &mut HashMap<String, Head>,
    batch: &[Append],
    guard: Option<&dyn ChainGuard>,
    refused: &HashSet<String>,
) -> Result<Written> {
    let mut steps = Vec::with_capacity(batch.len());
    let mut moves: Vec<HeadMove> = Vec::new();
    let mut moved: HashMap<String, usize> = HashMap::new();
    for a in batch {
        let linked;
        let (rec, start) = match a {
            Append::Record(r) => (r, GENESIS.to_string()),
            Append::Link {
                child,
                parent,
                ts_ms,
                body,
            } => {
                let there = match guard {
                    Some(g) => guarded(g.elsewhere(parent))?,
                    None => None,
                };
                let ph = match there {
                    Some(h) => Some(h),
                    None => cached_head(conn, heads, parent)?,
                };
                let (rec, start) = chain::link(child, parent, *ts_ms, body, ph.as_ref());
                linked = rec;
                (&linked, start)
            }
            Append::Continue {
                sandbox_id,
                seq,
                hash,
            } => {
                let head = Head {
                    seq: *seq,
                    hash: hash.clone(),
                };
                heads.insert(sandbox_id.clone(), head.clone());
                steps.push(Step::Continue(sandbox_id.clone(), head));
                continue;
            }
        };
        if refused.contains(&rec.sandbox_id) {
            continue;
        }
        let prev = cached_head(conn, heads, &rec.sandbox_id)?;
        let stored = chain::seal(rec, prev.as_ref(), &start);
        let next = Head {
            seq: stored.seq,
            hash: stored.hash.clone(),
        };
        heads.insert(stored.sandbox_id.clone(), next.clone());
        match moved.get(&stored.sandbox_id) {
            Some(&i) => moves[i].next = next,
            None => {
                moved.insert(stored.sandbox_id.clone(), moves.len());
                moves.push(HeadMove {
                    sandbox_id: stored.sandbox_id.clone(),
                    prev,
                    next,
                });
            }
        }
        steps.push(Step::Insert(stored));
    }
    if let Some(g) = guard.filter(|_| !moves.is_empty()) {
        let no = guarded(g.advance(&moves))?;
        if !no.is_empty() {
            return Ok(Err(no));
        }
    }
    // IMMEDIATE: take the write lock up front (waiting for it).
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let mut out = Vec::with_capacity(steps.len());
    for step in steps {
        match step {
            Step::Insert(mut r) => {
                insert(&tx, &mut r)?;
                out.push(r);
            }
            Step::Continue(id, head) => continue_at(&tx, &id, &head)?,
        }
    }
    tx.commit()?;
    Ok(Ok(out))
}

/// Makes `head` (kept by another host) the head of `id`'s chain here; a chain this store
/// never held starts at it as at a pruning anchor, so what follows verifies on its own.
fn continue_at(c: &Connection, id: &str, head: &Head) -> rusqlite::Result<()> {
    if self::head(c, id)?.is_none() {
        c.execute(
            "INSERT INTO audit_anchors (sandbox_id, seq, hash, pruned_at)
             VALUES (?1, ?2, ?3, ?4)
             ON CONFLICT(sandbox_id) DO UPDATE SET seq = excluded.seq, hash = excluded.hash,
               pruned_at = excluded.pruned_at",
            params![id, head.seq, head.hash, crate::store::now_ms()],
        )?;
    }
    c.execute(
        "INSERT INTO audit_heads (sandbox_id, seq, hash) VALUES (?1, ?2, ?3)
         ON CONFLICT(sandbox_id) DO UPDATE SET seq = excluded.seq, hash = excluded.hash",
        params![id, head.seq, head.hash],
    )?;
    Ok(())
}

/// Stores `r` (sealed: its place in the chain and its hash set), sets its cursor, and moves
/// its chain's head to it.
fn insert(c: &Connection, r: &mut AuditRecord) -> rusqlite::Result<()> {
    c.prepare_cached(
        "INSERT INTO audit (sandbox_id, seq, ts, kind, body, prev_hash, hash)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
    )?
    .execute(params![
        r.sandbox_id,
        r.seq,
        r.ts_ms,
        r.kind,
        r.body,
        r.prev_hash,
        r.hash
    ])?;
    r.cursor = c.last_insert_rowid();
    c.prepare_cached(
        "INSERT INTO audit_heads (sandbox_id, seq, hash) VALUES (?1, ?2, ?3)
         ON CONFLICT(sandbox_id) DO UPDATE SET seq = excluded.seq, hash = excluded.hash",
    )?
    .execute(params![r.sandbox_id, r.seq, r.hash])?;
    Ok(())
}

fn query(c: &Connection, f: &Filter) -> rusqlite::Result<Vec<AuditRecord>> {
    let mut sql = format!("SELECT {COLUMNS} FROM audit WHERE id > ?1");
    let after = f.after.as_ref().and_then(Cursor::local).unwrap_or(0);
    let mut args: Vec<rusqlite::types::Value> = vec![after.into()];
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

fn prune(
    c: &Connection,
    before_ms: Option<i64>,
    keep: Option<u64>,
    now_ms: i64,
) -> rusqlite::Result<usize> {
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
