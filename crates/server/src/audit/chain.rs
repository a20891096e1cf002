//! The hash chain: each record's hash is SHA-256 over the previous record's hash and the
//! record itself (sequence number, sandbox, time, kind and canonical JSON body), so editing or
//! deleting a stored record breaks every link after it.
//!
//! A chain starts from [`GENESIS`], or, for a sandbox that continues another one's state (a
//! fork, a create from a snapshot), from the parent's head at that moment; pruning leaves an
//! anchor (the last pruned record's seq and hash) that the remaining records link to.

use serde_json::Value;
use sha2::{Digest, Sha256};

use super::record::{AuditRecord, Kind, NewRecord};

/// `prev_hash` of the first record of a chain without a parent.
pub const GENESIS: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// JSON text with object keys sorted at every level and no insignificant whitespace.
pub fn canonical(v: &Value) -> String {
    let mut out = String::new();
    write_canonical(v, &mut out);
    out
}

fn write_canonical(v: &Value, out: &mut String) {
    match v {
        Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            out.push('{');
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(k.clone()).to_string());
                out.push(':');
                write_canonical(&m[k], out);
            }
            out.push('}');
        }
        Value::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(x, out);
            }
            out.push(']');
        }
        other => out.push_str(&other.to_string()),
    }
}

/// The hash of a record whose fields are these.
pub fn hash(prev: &str, seq: i64, sandbox_id: &str, ts_ms: i64, kind: &str, body: &str) -> String {
    let mut h = Sha256::new();
    for part in [
        prev.as_bytes(),
        seq.to_string().as_bytes(),
        sandbox_id.as_bytes(),
        ts_ms.to_string().as_bytes(),
        kind.as_bytes(),
        body.as_bytes(),
    ] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part);
    }
    hex::encode(h.finalize())
}

/// The record `rec` becomes when appended after `prev` (its chain's head; None: the first
/// record of a chain starting from `start`). Its `cursor` is the store's to set.
pub fn seal(rec: &NewRecord, prev: Option<&Head>, start: &str) -> AuditRecord {
    let (seq, prev_hash) = match prev {
        Some(h) => (h.seq + 1, h.hash.clone()),
        None => (1, start.to_string()),
    };
    let body = canonical(&rec.body);
    let kind = rec.kind.as_str();
    let hash = hash(&prev_hash, seq, &rec.sandbox_id, rec.ts_ms, kind, &body);
    AuditRecord {
        cursor: 0,
        sandbox_id: rec.sandbox_id.clone(),
        seq,
        ts_ms: rec.ts_ms,
        kind: kind.to_string(),
        body,
        prev_hash,
        hash,
    }
}

/// The lifecycle record starting `child`'s chain at `parent`'s head (None: the parent has no
/// chain), and the hash that chain starts from. `body` (an object) gains `event`, `parent` and
/// `parentSeq`.
pub fn link(
    child: &str,
    parent: &str,
    ts_ms: i64,
    body: &Value,
    parent_head: Option<&Head>,
) -> (NewRecord, String) {
    let mut body = body.clone();
    if let Value::Object(o) = &mut body {
        o.insert("event".into(), "chain_start".into());
        o.insert("parent".into(), parent.into());
        o.insert("parentSeq".into(), parent_head.map_or(0, |h| h.seq).into());
    }
    let start = parent_head.map_or(GENESIS.to_string(), |h| h.hash.clone());
    let rec = NewRecord {
        sandbox_id: child.to_string(),
        ts_ms,
        kind: Kind::Lifecycle,
        body,
    };
    (rec, start)
}

/// The hash `r` should have, recomputed from its fields.
pub fn recompute(r: &AuditRecord) -> String {
    hash(
        &r.prev_hash,
        r.seq,
        &r.sandbox_id,
        r.ts_ms,
        &r.kind,
        &r.body,
    )
}

/// Where a chain's verification starts: the seq before its first stored record and the hash
/// that record must link to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Start {
    pub seq: i64,
    /// None: the first record's own `prev_hash` is trusted (a fork's link to its parent is
    /// checked separately).
    pub hash: Option<String>,
}

/// The chain's last record as the writer remembers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    pub seq: i64,
    pub hash: String,
}

/// The first place a chain is broken.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Break {
    /// The seq of the first record that was edited, or that follows a deleted one (for a
    /// deleted tail: the seq after the last stored record).
    pub seq: i64,
    pub reason: String,
}

/// Checks `records` (one sandbox's stored records in seq order) from `start` up to `head`.
pub fn verify(records: &[AuditRecord], start: &Start, head: Option<&Head>) -> Result<(), Break> {
    let mut expect_seq = start.seq + 1;
    let mut prev: Option<String> = start.hash.clone();
    for r in records {
        if r.seq != expect_seq {
            return Err(Break {
                seq: expect_seq,
                reason: if r.seq > expect_seq {
                    format!("records {expect_seq}..{} are missing (deleted)", r.seq - 1)
                } else {
                    format!("record {} appears twice or out of order", r.seq)
                },
            });
        }
        if let Some(p) = &prev {
            if &r.prev_hash != p {
                return Err(Break {
                    seq: r.seq,
                    reason: format!(
                        "record {} does not link to the record before it (edited or replaced)",
                        r.seq
                    ),
                });
            }
        }
        if recompute(r) != r.hash {
            return Err(Break {
                seq: r.seq,
                reason: format!("record {} was edited (its hash does not match)", r.seq),
            });
        }
        prev = Some(r.hash.clone());
        expect_seq += 1;
    }
    if let Some(h) = head {
        let last = expect_seq - 1;
        if h.seq > last {
            return Err(Break {
                seq: last + 1,
                reason: format!(
                    "records {}..{} at the end of the chain are missing (deleted)",
                    last + 1,
                    h.seq
                ),
            });
        }
        if h.seq == last && h.seq > start.seq && prev.as_deref() != Some(h.hash.as_str()) {
            return Err(Break {
                seq: last,
                reason: format!("record {last} is not the chain's recorded head (replaced)"),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chain(n: i64) -> Vec<AuditRecord> {
        let mut prev = GENESIS.to_string();
        (1..=n)
            .map(|seq| {
                let body = canonical(&json!({"n": seq, "b": [1, {"z": 1, "a": 2}]}));
                let h = hash(&prev, seq, "sbx", 1000 + seq, "process", &body);
                let r = AuditRecord {
                    cursor: seq,
                    sandbox_id: "sbx".into(),
                    seq,
                    ts_ms: 1000 + seq,
                    kind: "process".into(),
                    body,
                    prev_hash: prev.clone(),
                    hash: h.clone(),
                };
                prev = h;
                r
            })
            .collect()
    }

    fn start() -> Start {
        Start {
            seq: 0,
            hash: Some(GENESIS.into()),
        }
    }

    fn head(c: &[AuditRecord]) -> Head {
        let l = c.last().unwrap();
        Head {
            seq: l.seq,
            hash: l.hash.clone(),
        }
    }

    #[test]
    fn canonical_sorts_keys_everywhere() {
        let v = json!({"b": 1, "a": {"d": [true, null], "c": "x\"y"}});
        assert_eq!(canonical(&v), r#"{"a":{"c":"x\"y","d":[true,null]},"b":1}"#);
    }

    #[test]
    fn intact_chain_verifies() {
        let c = chain(5);
        assert_eq!(verify(&c, &start(), Some(&head(&c))), Ok(()));
        assert_eq!(verify(&[], &start(), None), Ok(()));
    }

    #[test]
    fn edited_body_fails_at_that_record() {
        let mut c = chain(5);
        let h = head(&c);
        c[2].body = c[2].body.replace("\"n\":3", "\"n\":4");
        assert_eq!(verify(&c, &start(), Some(&h)).unwrap_err().seq, 3);
    }

    #[test]
    fn edited_and_rehashed_record_fails_at_the_next_link() {
        let mut c = chain(5);
        let h = head(&c);
        c[1].kind = "file".into();
        c[1].hash = recompute(&c[1]);
        let e = verify(&c, &start(), Some(&h)).unwrap_err();
        assert_eq!(e.seq, 3, "{e:?}");
    }

    #[test]
    fn deleted_records_are_found() {
        let c = chain(5);
        let h = head(&c);
        let mut middle = c.clone();
        middle.remove(1);
        assert_eq!(verify(&middle, &start(), Some(&h)).unwrap_err().seq, 2);
        let mut tail = c.clone();
        tail.pop();
        assert_eq!(verify(&tail, &start(), Some(&h)).unwrap_err().seq, 5);
        let mut first = c.clone();
        first.remove(0);
        assert_eq!(verify(&first, &start(), Some(&h)).unwrap_err().seq, 1);
    }

    #[test]
    fn a_pruned_prefix_verifies_from_its_anchor() {
        let c = chain(5);
        let h = head(&c);
        let anchor = Start {
            seq: 2,
            hash: Some(c[1].hash.clone()),
        };
        assert_eq!(verify(&c[2..], &anchor, Some(&h)), Ok(()));
        let wrong = Start {
            seq: 2,
            hash: Some(c[0].hash.clone()),
        };
        assert_eq!(verify(&c[2..], &wrong, Some(&h)).unwrap_err().seq, 3);
    }
}
