//! What an audit record is: its kind, the record as stored (with its place in the chain), and
//! its JSON shape on the API.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// What a record is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// A process started, attached to, fed, signalled or ended through the agent.
    Process,
    /// A file operation through the agent (RPC or `/files`).
    File,
    /// A connection leaving the sandbox, allowed or refused.
    Net,
    /// A DNS query through the sandbox's forwarder.
    Dns,
    /// A lifecycle transition (created, paused, resumed, forked, killed …).
    Lifecycle,
    /// A REST API call naming the sandbox.
    Api,
    /// A system call inside the sandbox (opt-in: metadata `kiln.audit.syscalls=true`).
    Syscall,
}

impl Kind {
    pub const ALL: [Kind; 7] = [
        Kind::Process,
        Kind::File,
        Kind::Net,
        Kind::Dns,
        Kind::Lifecycle,
        Kind::Api,
        Kind::Syscall,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Process => "process",
            Kind::File => "file",
            Kind::Net => "net",
            Kind::Dns => "dns",
            Kind::Lifecycle => "lifecycle",
            Kind::Api => "api",
            Kind::Syscall => "syscall",
        }
    }

    pub fn parse(s: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.as_str() == s)
    }
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A record on its way to the store (the writer gives it its place in the chain).
#[derive(Debug, Clone)]
pub struct NewRecord {
    pub sandbox_id: String,
    pub ts_ms: i64,
    pub kind: Kind,
    pub body: Value,
}

/// One entry of an append to the audit chain.
#[derive(Debug, Clone)]
pub enum Append {
    /// A record after its chain's head.
    Record(NewRecord),
    /// Starts `child`'s chain with a lifecycle record linking to `parent`'s head (fork, create
    /// from a snapshot); `body` says how.
    Link {
        child: String,
        parent: String,
        ts_ms: i64,
        body: Value,
    },
    /// Continues `sandbox_id`'s chain from its head (`seq`, `hash`) on the host that kept it
    /// before (a sandbox that moved here): its next record here follows that head.
    Continue {
        sandbox_id: String,
        seq: i64,
        hash: String,
    },
}

/// A stored record. `cursor` is its position in the whole log (the store's row id), `seq` its
/// position in its sandbox's chain (1, 2, 3 … with no gaps).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct AuditRecord {
    #[serde(serialize_with = "cursor_str")]
    pub cursor: i64,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    pub seq: i64,
    #[serde(rename = "timestamp", serialize_with = "rfc3339")]
    pub ts_ms: i64,
    pub kind: String,
    /// The body as stored (canonical JSON text); what the hash covers.
    #[serde(rename = "body", serialize_with = "raw_json")]
    pub body: String,
    pub prev_hash: String,
    pub hash: String,
}

impl AuditRecord {
    /// The body as JSON (`Null` if the stored text is not JSON, i.e. it was tampered with).
    pub fn body_json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or(Value::Null)
    }
}

fn cursor_str<S: serde::Serializer>(c: &i64, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&c.to_string())
}

fn rfc3339<S: serde::Serializer>(ms: &i64, s: S) -> Result<S::Ok, S::Error> {
    let t = chrono::DateTime::from_timestamp_millis(*ms).unwrap_or_default();
    s.serialize_str(&t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
}

fn raw_json<S: serde::Serializer>(body: &str, s: S) -> Result<S::Ok, S::Error> {
    match serde_json::from_str::<Value>(body) {
        Ok(v) => v.serialize(s),
        Err(_) => s.serialize_str(body),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_round_trip() {
        for k in Kind::ALL {
            assert_eq!(Kind::parse(k.as_str()), Some(k));
        }
        assert_eq!(Kind::parse("nope"), None);
    }

    #[test]
    fn api_shape() {
        let r = AuditRecord {
            cursor: 7,
            sandbox_id: "abc".into(),
            seq: 2,
            ts_ms: 0,
            kind: "process".into(),
            body: r#"{"event":"start","pid":3}"#.into(),
            prev_hash: "00".into(),
            hash: "11".into(),
        };
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["cursor"], "7");
        assert_eq!(v["sandboxID"], "abc");
        assert_eq!(v["timestamp"], "1970-01-01T00:00:00.000Z");
        assert_eq!(v["body"]["pid"], 3);
        assert_eq!(v["prevHash"], "00");
    }
}
