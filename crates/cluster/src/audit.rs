//! The audit log on a cluster. A sandbox's chain is kept by the node that runs it, in that
//! node's own audit log (its SQLite, its retention, its rule engine): the node records the
//! lifecycle, connections and DNS queries itself, and a control replica records what it sees
//! pass (the E2B API calls naming the sandbox, the envd operations its proxy forwards) and
//! hands those records to the sandbox's node ([`crate::control`]'s forwarding store, which
//! reads through the nodes too). A sandbox that moves continues its chain on its new node
//! (the heads in etcd: [`crate::heads`]), so a chain may be kept in parts by several nodes.
//! This module is the node-internal API's JSON forms of that: one call ([`AuditCall`])
//! answered by one [`AuditAnswer`].

use kiln_server::audit::chain::Head;
use kiln_server::audit::{AuditRecord, Filter, Kind, NewRecord};
use kiln_server::store::alerts_sql::{AlertFilter, AlertRecord};
use kiln_server::store::StoredChain;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Where a node answers audit calls (under the internal API's prefix).
pub const AUDIT_PATH: &str = "/audit";

/// What a control replica asks of a node's audit log.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "call", rename_all = "snake_case")]
pub enum AuditCall {
    /// Appends records made by the replica, each after its sandbox's chain head; answered
    /// once stored.
    Append { records: Vec<NewRecordDoc> },
    /// The stored records matching a filter (the node's cursors).
    Query { filter: Filter },
    /// The rule engine's alerts matching a filter (the node's alert ids).
    Alerts { filter: AlertFilter },
    /// Every sandbox the node keeps a chain of (of one team's only, when given).
    Chains { team: Option<String> },
    /// One sandbox's chain as stored, for verification.
    Chain { sandbox_id: String },
    /// The hash of one record of a chain (a fork's link to its parent).
    RecordHash { sandbox_id: String, seq: i64 },
    /// The key that created the sandbox, from its chain.
    Owner { sandbox_id: String },
    /// The team the sandbox belongs (or belonged) to.
    TeamOf { sandbox_id: String },
}

/// A node's answer: the field its call asks for.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct AuditAnswer {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub records: Vec<RecordDoc>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub alerts: Vec<AlertDoc>,
    /// Records of an append not kept: their chains are extended by another node now.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub moved: Vec<MovedDoc>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ids: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chain: Option<ChainDoc>,
    /// A hash, an owner's key or a team (by call).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
}

/// Records an append handed to a node that does not extend their chains now, and the node
/// that does (as the refusing node last saw it).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MovedDoc {
    pub node: Option<String>,
    pub records: Vec<NewRecordDoc>,
}

/// A record on its way to a node's chain.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NewRecordDoc {
    pub sandbox_id: String,
    pub ts_ms: i64,
    pub kind: Kind,
    pub body: Value,
}

impl From<&NewRecord> for NewRecordDoc {
    fn from(r: &NewRecord) -> Self {
        Self {
            sandbox_id: r.sandbox_id.clone(),
            ts_ms: r.ts_ms,
            kind: r.kind,
            body: r.body.clone(),
        }
    }
}

impl From<NewRecordDoc> for NewRecord {
    fn from(d: NewRecordDoc) -> Self {
        Self {
            sandbox_id: d.sandbox_id,
            ts_ms: d.ts_ms,
            kind: d.kind,
            body: d.body,
        }
    }
}

/// A stored record, field for field (its body the stored text the hash covers).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RecordDoc {
    pub cursor: i64,
    pub sandbox_id: String,
    pub seq: i64,
    pub ts_ms: i64,
    pub kind: String,
    pub body: String,
    pub prev_hash: String,
    pub hash: String,
}

impl From<&AuditRecord> for RecordDoc {
    fn from(r: &AuditRecord) -> Self {
        Self {
            cursor: r.cursor,
            sandbox_id: r.sandbox_id.clone(),
            seq: r.seq,
            ts_ms: r.ts_ms,
            kind: r.kind.clone(),
            body: r.body.clone(),
            prev_hash: r.prev_hash.clone(),
            hash: r.hash.clone(),
        }
    }
}

impl From<RecordDoc> for AuditRecord {
    fn from(d: RecordDoc) -> Self {
        Self {
            cursor: d.cursor,
            sandbox_id: d.sandbox_id,
            seq: d.seq,
            ts_ms: d.ts_ms,
            kind: d.kind,
            body: d.body,
            prev_hash: d.prev_hash,
            hash: d.hash,
        }
    }
}

/// A stored alert, field for field.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AlertDoc {
    pub id: i64,
    pub ts_ms: i64,
    pub sandbox_id: String,
    pub team: Option<String>,
    pub rule: String,
    pub priority: String,
    pub output: String,
    pub tags: Vec<String>,
    pub actions: Vec<String>,
    pub records: Vec<i64>,
    pub count: u64,
    pub first_ms: i64,
    pub last_ms: i64,
    pub rules: Vec<String>,
    pub incident: String,
}

impl From<AlertRecord> for AlertDoc {
    fn from(a: AlertRecord) -> Self {
        Self {
            id: a.id,
            ts_ms: a.ts_ms,
            sandbox_id: a.sandbox_id,
            team: a.team,
            rule: a.rule,
            priority: a.priority,
            output: a.output,
            tags: a.tags,
            actions: a.actions,
            records: a.records,
            count: a.count,
            first_ms: a.first_ms,
            last_ms: a.last_ms,
            rules: a.rules,
            incident: a.incident,
        }
    }
}

impl From<AlertDoc> for AlertRecord {
    fn from(d: AlertDoc) -> Self {
        Self {
            id: d.id,
            ts_ms: d.ts_ms,
            sandbox_id: d.sandbox_id,
            team: d.team,
            rule: d.rule,
            priority: d.priority,
            output: d.output,
            tags: d.tags,
            actions: d.actions,
            records: d.records,
            count: d.count,
            first_ms: d.first_ms,
            last_ms: d.last_ms,
            rules: d.rules,
            incident: d.incident,
        }
    }
}

/// A chain as stored: its records, where retention cut it, its recorded head.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ChainDoc {
    pub records: Vec<RecordDoc>,
    pub anchor: Option<(i64, String)>,
    pub head: Option<(i64, String)>,
}

impl From<&StoredChain> for ChainDoc {
    fn from(c: &StoredChain) -> Self {
        Self {
            records: c.records.iter().map(RecordDoc::from).collect(),
            anchor: c.anchor.clone(),
            head: c.head.as_ref().map(|h| (h.seq, h.hash.clone())),
        }
    }
}

impl From<ChainDoc> for StoredChain {
    fn from(d: ChainDoc) -> Self {
        Self {
            records: d.records.into_iter().map(AuditRecord::from).collect(),
            anchor: d.anchor,
            head: d.head.map(|(seq, hash)| Head { seq, hash }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_server::audit::cursor::Cursor;

    #[test]
    fn a_stored_chain_crosses_the_wire_unchanged() {
        let rec = AuditRecord {
            cursor: 41,
            sandbox_id: "sbx1".into(),
            seq: 3,
            ts_ms: 1_700_000_000_123,
            kind: "process".into(),
            body: r#"{"cmd":"ls","event":"start"}"#.into(),
            prev_hash: "aa".into(),
            hash: "bb".into(),
        };
        let chain = StoredChain {
            records: vec![rec.clone()],
            anchor: Some((2, "aa".into())),
            head: Some(Head {
                seq: 3,
                hash: "bb".into(),
            }),
        };
        let text = serde_json::to_string(&ChainDoc::from(&chain)).unwrap();
        let back: StoredChain = serde_json::from_str::<ChainDoc>(&text).unwrap().into();
        assert_eq!(back.records, vec![rec]);
        assert_eq!(back.anchor, chain.anchor);
        assert_eq!(back.head, chain.head);
    }

    #[test]
    fn calls_are_tagged_and_filters_keep_their_kinds() {
        let call = AuditCall::Query {
            filter: Filter {
                sandbox_id: Some("sbx1".into()),
                kinds: vec![Kind::Process, Kind::File],
                after: Some(Cursor::At(7)),
                limit: 100,
                ..Filter::default()
            },
        };
        let v = serde_json::to_value(&call).unwrap();
        assert_eq!(v["call"], "query");
        assert_eq!(v["filter"]["kinds"], serde_json::json!(["process", "file"]));
        let AuditCall::Query { filter } = serde_json::from_value(v).unwrap() else {
            panic!("not a query");
        };
        assert_eq!(filter.kinds, vec![Kind::Process, Kind::File]);
        assert_eq!(filter.after, Some(Cursor::At(7)));
    }
}
