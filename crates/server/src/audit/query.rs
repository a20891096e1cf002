//! Verifying a chain as stored ([`verify`] → [`Report`]) over any [`AuditStore`].

use serde_json::Value;

use super::chain::{self, Break, Start, GENESIS};
use super::record::AuditRecord;
use crate::store::{AuditStore, Result};

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

/// Verifies `sandbox_id`'s chain: every stored record against its hash and its predecessor,
/// no gaps, the recorded head at the end, the pruning anchor (if any) at the start, and a
/// fork's first record against its parent's record.
pub fn verify(store: &dyn AuditStore, sandbox_id: &str) -> Result<Report> {
    let stored = store.chain(sandbox_id)?;
    let records = &stored.records;
    let first = records.first().map(AuditRecord::body_json);
    let parent = first.as_ref().and_then(|b| {
        (b["event"] == "chain_start")
            .then(|| b["parent"].as_str().map(str::to_string))
            .flatten()
    });
    let start = match (&stored.anchor, &parent) {
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
    let mut result = chain::verify(records, &start, stored.head.as_ref());
    if result.is_ok() && stored.anchor.is_none() {
        if let (Some(p), Some(r0)) = (&parent, records.first()) {
            result = check_parent_link(store, p, r0, first.as_ref());
        }
    }
    let (ok, first_bad_seq, reason) = match result {
        Ok(()) => (true, None, None),
        Err(Break { seq, reason }) => (false, Some(seq), Some(reason)),
    };
    Ok(Report {
        sandbox_id: sandbox_id.to_string(),
        records: records.len(),
        pruned: stored.anchor.map(|a| a.0).unwrap_or(0),
        ok,
        first_bad_seq,
        reason,
        parent,
    })
}

fn check_parent_link(
    store: &dyn AuditStore,
    parent: &str,
    first: &AuditRecord,
    body: Option<&Value>,
) -> std::result::Result<(), Break> {
    let pseq = body.and_then(|b| b["parentSeq"].as_i64()).unwrap_or(0);
    let expect: Option<String> = if pseq == 0 {
        Some(GENESIS.to_string())
    } else {
        store.record_hash(parent, pseq).ok().flatten()
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
