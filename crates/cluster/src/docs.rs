//! The JSON forms of kiln's records in etcd. The server's records are plain structs; these
//! mirrors give each a stable, named serde form (the enums keep their own serde names), so a
//! field added to a record is a compile error here until its JSON form is chosen.

use std::collections::BTreeMap;

use base64::Engine as _;
use kiln_server::store::{
    DeliveryRecord, DeliveryStatus, Event, IdempotentAnswer, Ingress, KeyRecord, PauseMode,
    SandboxRecord, SandboxState, SnapshotRecord, TeamRecord, TemplateRecord, WebhookRecord,
};
use serde::{Deserialize, Serialize};

use crate::error::{ClusterError, Result};

/// Parses the JSON value stored at `key`.
pub fn parse<T: serde::de::DeserializeOwned>(key: &[u8], value: &[u8]) -> Result<T> {
    serde_json::from_slice(value).map_err(|source| ClusterError::Corrupt {
        key: String::from_utf8_lossy(key).into_owned(),
        source,
    })
}

/// The JSON text of a value (the docs here always serialize).
pub fn json<T: Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).unwrap_or_default()
}

/// How the docs here carry bytes (sealed values, bodies): standard base64.
pub fn b64() -> base64::engine::GeneralPurpose {
    base64::engine::general_purpose::STANDARD
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SandboxDoc {
    pub id: String,
    pub template_id: String,
    pub alias: Option<String>,
    pub client_id: String,
    pub state: SandboxState,
    pub metadata: BTreeMap<String, String>,
    pub env_vars: BTreeMap<String, String>,
    pub cpu_count: u32,
    pub memory_mb: u32,
    pub disk_size_mb: u32,
    pub envd_token: Option<String>,
    pub started_at_ms: i64,
    pub end_at_ms: i64,
    pub ended_at_ms: Option<i64>,
    pub end_reason: Option<String>,
    pub auto_pause: bool,
    pub driver: String,
    pub pause_mode: Option<PauseMode>,
    pub auto_resume: bool,
    pub auto_pause_memory: bool,
    pub team: String,
    /// Ingress (absent in the docs of kilns before it lived in the record: public).
    #[serde(default)]
    pub traffic_token: Option<String>,
    #[serde(default)]
    pub mask_request_host: Option<String>,
}

impl From<&SandboxRecord> for SandboxDoc {
    fn from(s: &SandboxRecord) -> Self {
        let SandboxRecord {
            id,
            template_id,
            alias,
            client_id,
            state,
            metadata,
            env_vars,
            cpu_count,
            memory_mb,
            disk_size_mb,
            envd_token,
            started_at_ms,
            end_at_ms,
            ended_at_ms,
            end_reason,
            auto_pause,
            driver,
            pause_mode,
            auto_resume,
            auto_pause_memory,
            team,
            ingress,
        } = s.clone();
        Self {
            id,
            template_id,
            alias,
            client_id,
            state,
            metadata,
            env_vars,
            cpu_count,
            memory_mb,
            disk_size_mb,
            envd_token,
            started_at_ms,
            end_at_ms,
            ended_at_ms,
            end_reason,
            auto_pause,
            driver,
            pause_mode,
            auto_resume,
            auto_pause_memory,
            team,
            traffic_token: ingress.traffic_token,
            mask_request_host: ingress.mask_request_host,
        }
    }
}

impl From<SandboxDoc> for SandboxRecord {
    fn from(d: SandboxDoc) -> Self {
        Self {
            id: d.id,
            template_id: d.template_id,
            alias: d.alias,
            client_id: d.client_id,
            state: d.state,
            metadata: d.metadata,
            env_vars: d.env_vars,
            cpu_count: d.cpu_count,
            memory_mb: d.memory_mb,
            disk_size_mb: d.disk_size_mb,
            envd_token: d.envd_token,
            started_at_ms: d.started_at_ms,
            end_at_ms: d.end_at_ms,
            ended_at_ms: d.ended_at_ms,
            end_reason: d.end_reason,
            auto_pause: d.auto_pause,
            driver: d.driver,
            pause_mode: d.pause_mode,
            auto_resume: d.auto_resume,
            auto_pause_memory: d.auto_pause_memory,
            team: d.team,
            ingress: Ingress {
                traffic_token: d.traffic_token,
                mask_request_host: d.mask_request_host,
            },
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SnapshotDoc {
    pub id: String,
    pub name: Option<String>,
    pub sandbox_id: String,
    pub template_id: String,
    pub envd_token: Option<String>,
    pub env_vars: BTreeMap<String, String>,
    pub created_at_ms: i64,
    pub size_bytes: u64,
    pub team: String,
    /// On a cluster, the node that keeps the snapshot's files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// A fork's capture, for children on other nodes: never listed, deleted after the fork.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub transient: bool,
    /// The network settings its source ran with, as its node recorded them for creates from
    /// it, sealed by the cluster's vault (base64; None: none recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<String>,
}

impl From<&SnapshotRecord> for SnapshotDoc {
    fn from(s: &SnapshotRecord) -> Self {
        let SnapshotRecord {
            id,
            name,
            sandbox_id,
            template_id,
            envd_token,
            env_vars,
            created_at_ms,
            size_bytes,
            team,
        } = s.clone();
        Self {
            id,
            name,
            sandbox_id,
            template_id,
            envd_token,
            env_vars,
            created_at_ms,
            size_bytes,
            team,
            node: None,
            transient: false,
            network: None,
        }
    }
}

impl From<SnapshotDoc> for SnapshotRecord {
    fn from(d: SnapshotDoc) -> Self {
        Self {
            id: d.id,
            name: d.name,
            sandbox_id: d.sandbox_id,
            template_id: d.template_id,
            envd_token: d.envd_token,
            env_vars: d.env_vars,
            created_at_ms: d.created_at_ms,
            size_bytes: d.size_bytes,
            team: d.team,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EventDoc {
    pub ts_ms: i64,
    pub sandbox_id: String,
    pub kind: String,
    pub detail: String,
}

impl From<EventDoc> for Event {
    fn from(d: EventDoc) -> Self {
        Self {
            ts_ms: d.ts_ms,
            sandbox_id: d.sandbox_id,
            kind: d.kind,
            detail: d.detail,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WebhookDoc {
    pub id: String,
    pub team: String,
    pub url: String,
    pub secret: String,
    pub events: Vec<String>,
    pub created_at_ms: i64,
}

impl From<&WebhookRecord> for WebhookDoc {
    fn from(w: &WebhookRecord) -> Self {
        let WebhookRecord {
            id,
            team,
            url,
            secret,
            events,
            created_at_ms,
        } = w.clone();
        Self {
            id,
            team,
            url,
            secret,
            events,
            created_at_ms,
        }
    }
}

impl From<WebhookDoc> for WebhookRecord {
    fn from(d: WebhookDoc) -> Self {
        Self {
            id: d.id,
            team: d.team,
            url: d.url,
            secret: d.secret,
            events: d.events,
            created_at_ms: d.created_at_ms,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct KeyDoc {
    pub id: String,
    pub name: String,
    pub prefix: String,
    pub hash: String,
    pub created_at_ms: i64,
    pub last_used_ms: Option<i64>,
    pub revoked_at_ms: Option<i64>,
    pub team: String,
}

impl From<&KeyRecord> for KeyDoc {
    fn from(k: &KeyRecord) -> Self {
        let KeyRecord {
            id,
            name,
            prefix,
            hash,
            created_at_ms,
            last_used_ms,
            revoked_at_ms,
            team,
        } = k.clone();
        Self {
            id,
            name,
            prefix,
            hash,
            created_at_ms,
            last_used_ms,
            revoked_at_ms,
            team,
        }
    }
}

impl From<KeyDoc> for KeyRecord {
    fn from(d: KeyDoc) -> Self {
        Self {
            id: d.id,
            name: d.name,
            prefix: d.prefix,
            hash: d.hash,
            created_at_ms: d.created_at_ms,
            last_used_ms: d.last_used_ms,
            revoked_at_ms: d.revoked_at_ms,
            team: d.team,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TemplateDoc {
    pub name: String,
    pub key: String,
    pub built_at_ms: i64,
    pub size_bytes: u64,
    pub spawn_count: u64,
    pub last_spawned_ms: Option<i64>,
    pub image: Option<String>,
}

impl From<&TemplateRecord> for TemplateDoc {
    fn from(t: &TemplateRecord) -> Self {
        let TemplateRecord {
            name,
            key,
            built_at_ms,
            size_bytes,
            spawn_count,
            last_spawned_ms,
            image,
        } = t.clone();
        Self {
            name,
            key,
            built_at_ms,
            size_bytes,
            spawn_count,
            last_spawned_ms,
            image,
        }
    }
}

impl From<TemplateDoc> for TemplateRecord {
    fn from(d: TemplateDoc) -> Self {
        Self {
            name: d.name,
            key: d.key,
            built_at_ms: d.built_at_ms,
            size_bytes: d.size_bytes,
            spawn_count: d.spawn_count,
            last_spawned_ms: d.last_spawned_ms,
            image: d.image,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TeamDoc {
    pub name: String,
    pub max_sandboxes: Option<u32>,
    pub max_timeout_secs: Option<u64>,
    pub creates_per_minute: Option<u32>,
    /// Absent in documents written before teams had a volume cap.
    #[serde(default)]
    pub max_volumes: Option<u32>,
    pub created_at_ms: i64,
}

impl From<&TeamRecord> for TeamDoc {
    fn from(t: &TeamRecord) -> Self {
        let TeamRecord {
            name,
            max_sandboxes,
            max_timeout_secs,
            creates_per_minute,
            max_volumes,
            created_at_ms,
        } = t.clone();
        Self {
            name,
            max_sandboxes,
            max_timeout_secs,
            creates_per_minute,
            max_volumes,
            created_at_ms,
        }
    }
}

impl From<TeamDoc> for TeamRecord {
    fn from(d: TeamDoc) -> Self {
        Self {
            name: d.name,
            max_sandboxes: d.max_sandboxes,
            max_timeout_secs: d.max_timeout_secs,
            creates_per_minute: d.creates_per_minute,
            max_volumes: d.max_volumes,
            created_at_ms: d.created_at_ms,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct IdempotentDoc {
    pub scope: String,
    pub key: String,
    pub fingerprint: String,
    pub status: u16,
    pub content_type: Option<String>,
    /// The body in standard base64.
    pub body: String,
    pub created_at_ms: i64,
}

impl From<&IdempotentAnswer> for IdempotentDoc {
    fn from(a: &IdempotentAnswer) -> Self {
        Self {
            scope: a.scope.clone(),
            key: a.key.clone(),
            fingerprint: a.fingerprint.clone(),
            status: a.status,
            content_type: a.content_type.clone(),
            body: b64().encode(&a.body),
            created_at_ms: a.created_at_ms,
        }
    }
}

impl IdempotentDoc {
    pub fn into_answer(self, key: &[u8]) -> Result<IdempotentAnswer> {
        let body = b64()
            .decode(&self.body)
            .map_err(|e| ClusterError::Corrupt {
                key: String::from_utf8_lossy(key).into_owned(),
                source: serde::de::Error::custom(e),
            })?;
        Ok(IdempotentAnswer {
            scope: self.scope,
            key: self.key,
            fingerprint: self.fingerprint,
            status: self.status,
            content_type: self.content_type,
            body,
            created_at_ms: self.created_at_ms,
        })
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DeliveryDoc {
    pub id: i64,
    pub webhook_id: String,
    pub event_seq: Option<i64>,
    pub kind: String,
    pub payload: String,
    /// `pending`, `delivered` or `failed` (the status's own names).
    pub status: String,
    pub attempts: u32,
    pub next_attempt_ms: i64,
    pub created_at_ms: i64,
    pub last_attempt_ms: Option<i64>,
    pub last_status_code: Option<u16>,
    pub last_error: Option<String>,
}

impl DeliveryDoc {
    /// A new delivery `id` of `payload` to webhook `webhook_id`, due at `now` (`event_seq`: the
    /// event it carries; None for a test delivery).
    pub fn pending(
        id: i64,
        webhook_id: &str,
        event_seq: Option<i64>,
        kind: &str,
        payload: String,
        now: i64,
    ) -> Self {
        Self {
            id,
            webhook_id: webhook_id.to_string(),
            event_seq,
            kind: kind.to_string(),
            payload,
            status: DeliveryStatus::Pending.as_str().into(),
            attempts: 0,
            next_attempt_ms: now,
            created_at_ms: now,
            last_attempt_ms: None,
            last_status_code: None,
            last_error: None,
        }
    }
}

impl From<DeliveryDoc> for DeliveryRecord {
    fn from(d: DeliveryDoc) -> Self {
        Self {
            id: d.id,
            webhook_id: d.webhook_id,
            event_seq: d.event_seq,
            kind: d.kind,
            payload: d.payload,
            status: DeliveryStatus::parse(&d.status),
            attempts: d.attempts,
            next_attempt_ms: d.next_attempt_ms,
            created_at_ms: d.created_at_ms,
            last_attempt_ms: d.last_attempt_ms,
            last_status_code: d.last_status_code,
            last_error: d.last_error,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sandbox doc written by a kiln from before ingress settings lived in the record.
    #[test]
    fn a_sandbox_doc_without_ingress_fields_reads_as_public() {
        let old = br#"{"id":"a","template_id":"base","alias":null,"client_id":"kiln",
            "state":"running","metadata":{},"env_vars":{},"cpu_count":2,"memory_mb":512,
            "disk_size_mb":1024,"envd_token":"t","started_at_ms":1,"end_at_ms":2,
            "ended_at_ms":null,"end_reason":null,"auto_pause":false,"driver":"gvisor",
            "pause_mode":null,"auto_resume":false,"auto_pause_memory":true,"team":"default"}"#;
        let doc: SandboxDoc = parse(b"k", old).unwrap();
        let rec = SandboxRecord::from(doc);
        assert_eq!(rec.ingress, Ingress::default());
        let private = SandboxRecord {
            ingress: Ingress {
                traffic_token: Some("tok".into()),
                mask_request_host: Some("h:${PORT}".into()),
            },
            ..rec
        };
        let back: SandboxDoc = parse(b"k", &json(&SandboxDoc::from(&private))).unwrap();
        assert_eq!(SandboxRecord::from(back), private);
    }
}
