//! The rows kiln keeps: sandboxes, API keys, lifecycle events, templates.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub use kiln_net::Ingress;

/// Where a sandbox is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SandboxState {
    /// Being created (driver work in progress).
    Starting,
    Running,
    Paused,
    /// Ended: killed by request, expired, or cleaned up after a crash.
    Killed,
    /// Creation failed.
    Failed,
}

impl SandboxState {
    pub fn as_str(self) -> &'static str {
        match self {
            SandboxState::Starting => "starting",
            SandboxState::Running => "running",
            SandboxState::Paused => "paused",
            SandboxState::Killed => "killed",
            SandboxState::Failed => "failed",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "starting" => SandboxState::Starting,
            "running" => SandboxState::Running,
            "paused" => SandboxState::Paused,
            "killed" => SandboxState::Killed,
            "failed" => SandboxState::Failed,
            _ => return None,
        })
    }
    /// Whether the sandbox still holds host resources.
    pub fn is_live(self) -> bool {
        matches!(
            self,
            SandboxState::Starting | SandboxState::Running | SandboxState::Paused
        )
    }
}

/// What a pause saved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PauseMode {
    /// Memory, processes and filesystem: resuming continues where the sandbox stopped.
    Full,
    /// The filesystem only: resuming boots the sandbox again on its saved disk.
    Filesystem,
}

impl PauseMode {
    pub fn as_str(self) -> &'static str {
        match self {
            PauseMode::Full => "full",
            PauseMode::Filesystem => "filesystem",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "full" => Some(PauseMode::Full),
            "filesystem" => Some(PauseMode::Filesystem),
            _ => None,
        }
    }
}

/// One sandbox row.
#[derive(Debug, Clone, PartialEq)]
pub struct SandboxRecord {
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
    /// What the latest pause saved (None: never paused).
    pub pause_mode: Option<PauseMode>,
    /// Whether traffic to the sandbox while it is paused resumes it.
    pub auto_resume: bool,
    /// Whether an auto-pause keeps memory (else the filesystem only).
    pub auto_pause_memory: bool,
    /// The team that owns it (the team of the API key that created it).
    pub team: String,
    /// Who may reach its ports other than the agent's, and the `Host` they see.
    pub ingress: Ingress,
}

/// A running sandbox of template `base` with nothing else set (no id, team or driver), 1 CPU,
/// 512 MiB, and E2B's pause defaults: what test fixtures and simulations start from, naming
/// only what they care about (`..Default::default()`).
impl Default for SandboxRecord {
    fn default() -> Self {
        Self {
            id: String::new(),
            template_id: "base".into(),
            alias: None,
            client_id: String::new(),
            state: SandboxState::Running,
            metadata: BTreeMap::new(),
            env_vars: BTreeMap::new(),
            cpu_count: 1,
            memory_mb: 512,
            disk_size_mb: 0,
            envd_token: None,
            started_at_ms: 0,
            end_at_ms: 0,
            ended_at_ms: None,
            end_reason: None,
            auto_pause: false,
            driver: String::new(),
            pause_mode: None,
            auto_resume: false,
            auto_pause_memory: true,
            team: String::new(),
            ingress: Ingress::default(),
        }
    }
}

/// One API key row (the key itself is never stored, only its SHA-256).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRecord {
    pub id: String,
    pub name: String,
    /// First characters of the key, shown by `kiln keys list` to recognise it.
    pub prefix: String,
    pub hash: String,
    pub created_at_ms: i64,
    pub last_used_ms: Option<i64>,
    pub revoked_at_ms: Option<i64>,
    /// The team the key acts for.
    pub team: String,
}

/// One lifecycle event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Event {
    pub ts_ms: i64,
    pub sandbox_id: String,
    pub kind: String,
    pub detail: String,
}

/// A template the server has seen (spawn statistics for `GET /templates`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TemplateRecord {
    pub name: String,
    pub key: String,
    pub built_at_ms: i64,
    pub size_bytes: u64,
    pub spawn_count: u64,
    pub last_spawned_ms: Option<i64>,
    /// The template's ext4 image, for drivers that boot from a block device.
    pub image: Option<String>,
}

/// A snapshot of a sandbox: a template new sandboxes continue from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotRecord {
    pub id: String,
    /// Optional unique name it can also be used by.
    pub name: Option<String>,
    /// The sandbox it was taken from (which may be gone).
    pub sandbox_id: String,
    /// The template that sandbox was made from.
    pub template_id: String,
    /// The agent's access token in the snapshot (needed to give a restored agent a new one).
    pub envd_token: Option<String>,
    /// The source's environment variables from its create request.
    pub env_vars: BTreeMap<String, String>,
    pub created_at_ms: i64,
    /// Disk used by the snapshot.
    pub size_bytes: u64,
    /// The team that owns it (the source sandbox's).
    pub team: String,
}

/// A team's quotas; `None` fields fall back to the server's defaults.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TeamRecord {
    pub name: String,
    /// Sandboxes (running, paused or being created) at once.
    pub max_sandboxes: Option<u32>,
    /// Largest timeout (seconds) a sandbox of the team may have.
    pub max_timeout_secs: Option<u64>,
    /// Creates accepted per minute.
    pub creates_per_minute: Option<u32>,
    /// Volumes the team may hold.
    pub max_volumes: Option<u32>,
    pub created_at_ms: i64,
}

/// A lifecycle event with its position in the event log (the cursor of the events API).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StoredEvent {
    pub seq: i64,
    #[serde(flatten)]
    pub event: Event,
}

/// Which events a page of the events API holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EventQuery {
    /// Only events after this sequence number (the cursor); takes precedence over `since_ms`.
    pub after_seq: Option<i64>,
    /// Only events at or after this time.
    pub since_ms: Option<i64>,
    pub sandbox_id: Option<String>,
    /// Only the sandboxes of this team (running, paused or ended).
    pub team: Option<String>,
    /// Only these kinds (all when empty).
    pub kinds: Vec<String>,
    pub limit: u32,
}

/// The team of keys made without one, and of everything created before teams existed.
pub const DEFAULT_TEAM: &str = "default";

/// A registered webhook.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebhookRecord {
    pub id: String,
    pub team: String,
    pub url: String,
    /// HMAC-SHA256 key of its signatures.
    pub secret: String,
    /// Event kinds it receives (all lifecycle kinds when empty).
    pub events: Vec<String>,
    pub created_at_ms: i64,
}

/// Where a webhook delivery stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DeliveryStatus {
    Pending,
    Delivered,
    Failed,
}

impl DeliveryStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            DeliveryStatus::Pending => "pending",
            DeliveryStatus::Delivered => "delivered",
            DeliveryStatus::Failed => "failed",
        }
    }
    pub fn parse(s: &str) -> Self {
        match s {
            "delivered" => DeliveryStatus::Delivered,
            "failed" => DeliveryStatus::Failed,
            _ => DeliveryStatus::Pending,
        }
    }
}

/// One webhook delivery (a payload and its attempts so far).
#[derive(Debug, Clone, PartialEq)]
pub struct DeliveryRecord {
    pub id: i64,
    pub webhook_id: String,
    /// The event delivered (None: a test delivery).
    pub event_seq: Option<i64>,
    pub kind: String,
    pub payload: String,
    pub status: DeliveryStatus,
    pub attempts: u32,
    pub next_attempt_ms: i64,
    pub created_at_ms: i64,
    pub last_attempt_ms: Option<i64>,
    pub last_status_code: Option<u16>,
    pub last_error: Option<String>,
}

/// The result of one delivery attempt.
#[derive(Debug, Clone, PartialEq)]
pub struct Attempt {
    pub at_ms: i64,
    pub status_code: Option<u16>,
    pub error: Option<String>,
    /// Delivered (2xx), or else when to try again (None: give up).
    pub delivered: bool,
    pub retry_at_ms: Option<i64>,
}

/// The lifecycle event kinds of the events API and webhooks (a webhook registered without a
/// list receives these). The log holds other kinds too (`timeout`, `refreshed`, `snapshot`…).
pub const LIFECYCLE_KINDS: &[&str] = &[
    "created",
    "paused",
    "resumed",
    "killed",
    "timed-out",
    "oom",
    "pids-limit",
    "host-limit",
    "died",
    "network-policy-changed",
];

/// The answer of a create made with an `Idempotency-Key` (see `api::idempotency`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotentAnswer {
    /// The team and route the key belongs to.
    pub scope: String,
    pub key: String,
    /// SHA-256 of the request body (hex).
    pub fingerprint: String,
    pub status: u16,
    pub content_type: Option<String>,
    pub body: Vec<u8>,
    pub created_at_ms: i64,
}
