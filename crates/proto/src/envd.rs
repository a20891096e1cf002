//! envd's plain-HTTP JSON bodies (the OpenAPI part of envd: `/init`, `/metrics`, `/files`).

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

/// Port envd listens on inside a sandbox.
pub const ENVD_PORT: u16 = 49983;

/// Version kiln-agent reports in `/health`-adjacent places; high enough to enable every feature
/// gate of the e2b SDK 2.x (recursive watch, stdin, default user, file metadata, octet-stream
/// upload, entry info in watch events).
pub const ENVD_VERSION: &str = "0.6.4";

/// Where `/init`'s `kilnExtraCas` go in a sandbox, all in one file (Debian's layout:
/// `update-ca-certificates` keeps them in the bundle it rebuilds; Node reads this one file).
pub const TRUST_EXTRA_FILE: &str = "/usr/local/share/ca-certificates/kiln-extra-cas.crt";
/// The system bundle of a sandbox (Debian's layout), where the extra CAs are appended.
pub const TRUST_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// Body of `POST /init`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InitRequest {
    /// Environment variables every process gets (merged below per-process envs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env_vars: Option<HashMap<String, String>>,
    /// Once set, every request must carry it in `X-Access-Token` (or a valid file URL signature).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub access_token: Option<String>,
    /// User used when a request names none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_user: Option<String>,
    /// Working directory used when a request names none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_workdir: Option<String>,
    /// RFC 3339 time to set the clock to (only applied when running as root).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timestamp: Option<String>,
    /// Hyperloop/proxy IP (accepted for compatibility, unused).
    #[serde(
        default,
        rename = "hyperloopIP",
        skip_serializing_if = "Option::is_none"
    )]
    pub hyperloop_ip: Option<String>,
    /// kiln: CA certificates (PEM) the sandbox trusts besides its template's roots; the agent
    /// puts them in [`TRUST_EXTRA_FILE`] and appends those [`TRUST_BUNDLE`] lacks before it
    /// answers.
    #[serde(
        default,
        rename = "kilnExtraCas",
        skip_serializing_if = "Option::is_none"
    )]
    pub extra_cas: Option<Vec<String>>,
}

/// Body of `GET /metrics`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Metrics {
    /// Unix seconds when the sample was taken.
    pub ts: i64,
    pub cpu_count: u32,
    /// Percent, 0..=100 × cores normalised to 0..=100.
    pub cpu_used_pct: f32,
    /// Bytes (envd reports MiB in `mem_used_mib`/`mem_total_mib` too).
    pub mem_total: u64,
    pub mem_used: u64,
    #[serde(rename = "mem_total_mib")]
    pub mem_total_mib: u64,
    #[serde(rename = "mem_used_mib")]
    pub mem_used_mib: u64,
    pub disk_used: u64,
    pub disk_total: u64,
    /// Bytes of the sandbox's page cache (`Cached` of its `/proc/meminfo`); 0 from an agent
    /// that does not report it.
    #[serde(default)]
    pub mem_cache: u64,
    /// kiln's extension: the processes the agent killed lately to keep the sandbox alive
    /// (newest last, a bounded log); absent from envd's answer and from an agent with none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kiln_kills: Vec<KillRecord>,
}

/// A process or command kiln-agent killed (out of memory, over its process cap, or on the
/// server's word that the sandbox's host side nears its limits).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KillRecord {
    /// When it happened (Unix milliseconds, the sandbox's clock).
    pub ts_ms: i64,
    /// `oom`, `pids` or `host`.
    pub kind: String,
    /// What was killed and why, as the console line says it.
    pub detail: String,
}

/// One entry of the `POST /files` answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EntryInfo {
    pub path: String,
    pub name: String,
    /// `"file"` (envd only reports files here).
    #[serde(rename = "type")]
    pub kind: String,
}

/// JSON error body of envd's HTTP API.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApiError {
    pub code: u16,
    pub message: String,
}
