//! The node-internal API's JSON forms: what a control replica asks of the node that owns a
//! sandbox ([`CreateDoc`], [`Op`]), what the node answers ([`OpAnswer`]), and how a refusal
//! travels back as the server's typed [`Error`] ([`error_of`]).

use std::collections::BTreeMap;

use http::StatusCode;
use kiln_server::manager::{CreateParams, MetricSample};
use kiln_server::store::{Ingress, MountRecord};
use kiln_server::Error;
use serde::{Deserialize, Serialize};

use crate::docs::{SandboxDoc, SnapshotDoc};

/// Where the node-internal API lives on a node's listener.
pub const API_PREFIX: &str = "/internal/v1";
/// The header carrying the cluster secret (`Bearer <secret>`).
pub const AUTH_HEADER: &str = "authorization";
/// The `Upgrade` protocol of a byte tunnel to one port of a sandbox.
pub const TUNNEL_PROTOCOL: &str = "kiln-tunnel";
/// Where a replica forwards the Template API on the node that runs the cluster's builds.
pub const BUILDS_PREFIX: &str = "/internal/v1/api";
/// The caller's team and key id on a forwarded Template API request (the replica checked the
/// API key).
pub const TEAM_HEADER: &str = "x-kiln-team";
pub const KEY_ID_HEADER: &str = "x-kiln-key-id";
/// The `Host` and `Content-Length` the client sent, on a forwarded Template API request.
pub const HOST_HEADER: &str = "x-kiln-host";
pub const LENGTH_HEADER: &str = "x-kiln-content-length";

/// Whether the build node has a template of `team` named `template` (a create's
/// `templateID`) built through the Template API.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BuiltQuery {
    pub team: String,
    pub template: String,
}

/// The header carrying a volume's content token on a forwarded volume-content request
/// (`Authorization` carries the cluster secret there).
pub const VOLUME_TOKEN_HEADER: &str = "x-kiln-volume-token";

/// A create as the control replica forwards it (its volume mounts resolved against the
/// team's volumes, all of the node it is sent to; network rules and an egress proxy as the
/// client gave them, in `settings`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CreateDoc {
    pub template_id: String,
    pub timeout_secs: Option<i64>,
    pub metadata: BTreeMap<String, String>,
    pub env_vars: BTreeMap<String, String>,
    pub secure: bool,
    pub auto_pause: bool,
    pub auto_resume: bool,
    pub auto_pause_filesystem_only: bool,
    pub allow_internet_access: Option<bool>,
    pub network: Option<NetworkDoc>,
    pub traffic_token: Option<String>,
    pub mask_request_host: Option<String>,
    pub team: String,
    /// A digest of the create's team, route and `Idempotency-Key` (None: the request had no
    /// key): the node runs one create per token ([`crate::placements`]).
    #[serde(default)]
    pub idempotency: Option<String>,
    /// A create from a snapshot another node keeps: its id, whose files the node fetches from
    /// object storage first when it does not have them.
    #[serde(default)]
    pub snapshot: Option<String>,
    /// The create's `rules` and `egressProxy` as the client gave them (placeholders, never a
    /// secret's value), which the node attaches to `network`
    /// ([`kiln_server::api::net_forwarded`]).
    #[serde(default)]
    pub settings: Option<serde_json::Value>,
    /// The volumes the sandbox mounts (kept by the node it is sent to).
    #[serde(default)]
    pub volume_mounts: Vec<MountDoc>,
    /// `template_id` names a template the team built through the Template API on the node
    /// it is sent to (the cluster's build node), which resolves it to its last layer.
    #[serde(default)]
    pub built: bool,
}

/// A volume mounted by a sandbox (the server's [`MountRecord`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MountDoc {
    pub volume_id: String,
    pub name: String,
    pub path: String,
}

impl From<&MountRecord> for MountDoc {
    fn from(m: &MountRecord) -> Self {
        Self {
            volume_id: m.volume_id.clone(),
            name: m.name.clone(),
            path: m.path.clone(),
        }
    }
}

impl From<MountDoc> for MountRecord {
    fn from(m: MountDoc) -> Self {
        Self {
            volume_id: m.volume_id,
            name: m.name,
            path: m.path,
        }
    }
}

/// What a control replica asks of the node that keeps a volume's files.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum VolumeCall {
    /// Keep this volume (its row and filesystem) unless the node has it already.
    Keep { volume: crate::volumes::VolumeDoc },
    /// Delete the volume of `team` and its files (409 while a sandbox mounts it).
    Delete { team: String },
}

/// An egress policy's lists as the API writes them.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NetworkDoc {
    pub allow_internet_access: bool,
    pub allow_out: Vec<String>,
    pub deny_out: Vec<String>,
    pub dns_servers: Vec<String>,
    pub https_ports: Vec<u16>,
}

impl NetworkDoc {
    /// The lists of `p`, whatever else it holds (what a node reports).
    pub fn lists(p: &kiln_net::EgressPolicy) -> Self {
        Self {
            allow_internet_access: p.allow_internet_access,
            allow_out: kiln_net::EgressPolicy::list_strings(&p.allow_out),
            deny_out: kiln_net::EgressPolicy::list_strings(&p.deny_out),
            dns_servers: p.dns_servers.iter().map(|a| a.to_string()).collect(),
            https_ports: p.https_ports.clone(),
        }
    }

    /// The `rules` and `egressProxy` of `p` as the API shows them (None: neither is set).
    pub fn shown(p: &kiln_net::EgressPolicy) -> Option<serde_json::Value> {
        let mut v = serde_json::Map::new();
        if let Some(t) = &p.transforms {
            v.insert("rules".into(), t.rules.to_json());
        }
        if let Some(x) = &p.egress_proxy {
            v.insert("egressProxy".into(), x.info_json());
        }
        (!v.is_empty()).then_some(serde_json::Value::Object(v))
    }

    /// The forwardable form of `p`, whose rules and egress proxy travel in `settings` (a
    /// policy holding them without `settings` is refused: they would be lost).
    pub fn of(
        p: &kiln_net::EgressPolicy,
        settings: Option<&serde_json::Value>,
    ) -> Result<Self, Error> {
        if settings.is_none() && (p.transforms.is_some() || p.egress_proxy.is_some()) {
            return Err(Error::Internal(
                "a policy with rules or an egress proxy was to be forwarded without them".into(),
            ));
        }
        Ok(Self::lists(p))
    }

    /// The policy the lists make (each entry validated again).
    pub fn into_policy(self) -> Result<kiln_net::EgressPolicy, Error> {
        let mut policy = kiln_net::EgressPolicy::from_lists(
            self.allow_internet_access,
            &self.allow_out,
            &self.deny_out,
            &self.dns_servers,
        )
        .map_err(|e| Error::bad_request(e.to_string()))?;
        policy.https_ports = self.https_ports;
        Ok(policy)
    }
}

impl CreateDoc {
    /// The forwardable form of `p`; refuses what a node cannot be handed yet.
    pub fn of(p: &CreateParams) -> Result<Self, Error> {
        let settings = p.network_settings.clone();
        let network = p
            .network
            .as_ref()
            .map(|n| NetworkDoc::of(n, settings.as_ref()))
            .transpose()?;
        Ok(Self {
            template_id: p.template_id.clone(),
            timeout_secs: p.timeout_secs,
            metadata: p.metadata.clone(),
            env_vars: p.env_vars.clone(),
            secure: p.secure,
            auto_pause: p.auto_pause,
            auto_resume: p.auto_resume,
            auto_pause_filesystem_only: p.auto_pause_filesystem_only,
            allow_internet_access: p.allow_internet_access,
            network,
            traffic_token: p.ingress.traffic_token.clone(),
            mask_request_host: p.ingress.mask_request_host.clone(),
            team: p.team.clone(),
            idempotency: p.idempotency.as_deref().map(crate::placements::token),
            snapshot: None,
            settings,
            volume_mounts: p.volume_mounts.iter().map(MountDoc::from).collect(),
            built: false,
        })
    }

    /// The create the node runs.
    pub fn into_params(self) -> Result<CreateParams, Error> {
        let network = self.network.map(NetworkDoc::into_policy).transpose()?;
        Ok(CreateParams {
            template_id: self.template_id,
            timeout_secs: self.timeout_secs,
            metadata: self.metadata,
            env_vars: self.env_vars,
            secure: self.secure,
            auto_pause: self.auto_pause,
            auto_resume: self.auto_resume,
            auto_pause_filesystem_only: self.auto_pause_filesystem_only,
            allow_internet_access: self.allow_internet_access,
            network,
            ingress: Ingress {
                traffic_token: self.traffic_token,
                mask_request_host: self.mask_request_host,
            },
            team: self.team,
            volume_mounts: self
                .volume_mounts
                .into_iter()
                .map(MountRecord::from)
                .collect(),
            idempotency: None,
            network_settings: self.settings,
        })
    }
}

/// One lifecycle call on a sandbox the node owns.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Op {
    Get,
    Kill {
        reason: String,
    },
    KillDetached {
        reason: String,
    },
    SetTimeout {
        secs: i64,
    },
    Extend {
        secs: i64,
        why: String,
    },
    ExpireNow,
    Pause {
        memory: bool,
        require_healthy_guest: bool,
    },
    Resume {
        memory: bool,
        secs: i64,
    },
    Connect {
        secs: i64,
        memory: bool,
    },
    Fork {
        count: u32,
        timeout_secs: Option<i64>,
    },
    /// Take paused sandbox `id` over from node `from` (its checkpoint in object storage),
    /// then resume it (`connect`: as a connect does).
    TakeOver {
        from: String,
        memory: bool,
        secs: i64,
        connect: bool,
    },
    /// The sandbox's metrics samples in a window (ms, both inclusive; None: unbounded).
    Metrics {
        start_ms: Option<i64>,
        end_ms: Option<i64>,
    },
    /// The sandbox's newest metrics sample (none before its first).
    LatestMetric,
    /// Take paused sandbox `id` over from draining node `from` and keep it paused here.
    Adopt {
        from: String,
    },
    /// Drop the local copy of a sandbox that another node took over.
    Release,
    /// The sandbox's egress policy (its lists).
    Network,
    /// The volumes the sandbox mounts.
    Mounts,
    /// The end of the sandbox's console output (of `team`'s sandbox; none once it ended).
    Console {
        team: String,
    },
    /// Replace the sandbox's egress policy with these lists, and its rules and egress proxy
    /// with `settings` as the client gave them (None: none).
    SetNetwork {
        network: NetworkDoc,
        #[serde(default)]
        settings: Option<serde_json::Value>,
    },
    /// Take a snapshot of the sandbox (of `team`; `memory: false`: its disk only).
    Snapshot {
        team: String,
        name: Option<String>,
        memory: bool,
    },
    /// Capture the sandbox for fork children on other nodes: a transient snapshot stored in
    /// object storage, and the create each child is.
    ForkOut {
        timeout_secs: Option<i64>,
    },
}

/// `POST …/snapshots/{id}/delete`: the team the snapshot belongs to.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SnapshotDelete {
    pub team: String,
}

/// What a call (or a create) answers (the fields its op fills).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct OpAnswer {
    /// The sandbox after the call (absent when it ended).
    pub sandbox: Option<SandboxDoc>,
    /// kill: whether it was running; resume/connect: whether it was resumed.
    pub flag: bool,
    /// set_timeout: the new end (ms).
    pub end_at_ms: i64,
    /// fork: one result per child, in order.
    pub children: Vec<Child>,
    /// The etcd revision at which the node published what the call changed (a control
    /// replica's cache reflects the call once its watch is there).
    pub revision: i64,
    /// metrics, latest_metric: the samples, oldest first.
    #[serde(default)]
    pub metrics: Vec<MetricDoc>,
    /// snapshot, fork_out: the snapshot taken.
    #[serde(default)]
    pub snapshot: Option<SnapshotDoc>,
    /// fork_out: the create of each child on another node.
    #[serde(default)]
    pub create: Option<CreateDoc>,
    /// network: the sandbox's egress policy (absent: it has no network).
    #[serde(default)]
    pub network: Option<NetworkDoc>,
    /// network: its `rules` and `egressProxy` as the API shows them (no password).
    #[serde(default)]
    pub shown: Option<serde_json::Value>,
    /// mounts: the volumes the sandbox mounts.
    #[serde(default)]
    pub mounts: Vec<MountDoc>,
    /// console: the end of the sandbox's console output.
    #[serde(default)]
    pub console: Option<String>,
}

/// One metrics sample as it travels (the server's [`MetricSample`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MetricDoc {
    pub timestamp_ms: i64,
    pub cpu_count: u32,
    pub cpu_used_pct: f64,
    pub mem_used: u64,
    pub mem_total: u64,
    pub mem_cache: u64,
    pub disk_used: u64,
    pub disk_total: u64,
}

impl From<&MetricSample> for MetricDoc {
    fn from(m: &MetricSample) -> Self {
        Self {
            timestamp_ms: m.timestamp_ms,
            cpu_count: m.cpu_count,
            cpu_used_pct: m.cpu_used_pct,
            mem_used: m.mem_used,
            mem_total: m.mem_total,
            mem_cache: m.mem_cache,
            disk_used: m.disk_used,
            disk_total: m.disk_total,
        }
    }
}

impl From<MetricDoc> for MetricSample {
    fn from(m: MetricDoc) -> Self {
        Self {
            timestamp_ms: m.timestamp_ms,
            cpu_count: m.cpu_count,
            cpu_used_pct: m.cpu_used_pct,
            mem_used: m.mem_used,
            mem_total: m.mem_total,
            mem_cache: m.mem_cache,
            disk_used: m.disk_used,
            disk_total: m.disk_total,
        }
    }
}

/// One fork child: the sandbox, or why it failed.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Child {
    pub sandbox: Option<SandboxDoc>,
    pub status: u16,
    pub message: String,
}

/// The 501 of something a cluster does not do yet.
pub fn not_in_cluster(what: &'static str) -> Error {
    Error::Driver(kiln_server::driver::DriverError::NotImplemented(what))
}

/// The server's typed error for a node's refusal (`status`, the message its body carried),
/// so the control replica answers the client as the node would have.
pub fn error_of(status: StatusCode, message: String, sandbox: &str) -> Error {
    match status {
        StatusCode::BAD_REQUEST => Error::BadRequest(message),
        StatusCode::NOT_FOUND if !sandbox.is_empty() => Error::SandboxNotFound(sandbox.into()),
        StatusCode::NOT_FOUND => Error::NotFound(message),
        StatusCode::CONFLICT => Error::Conflict(message),
        StatusCode::TOO_MANY_REQUESTS => Error::Limit(message),
        StatusCode::SERVICE_UNAVAILABLE => Error::Unavailable(message),
        StatusCode::NOT_IMPLEMENTED => not_in_cluster("this operation on a cluster node"),
        _ => Error::Internal(message),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_create_travels_whole() {
        let mut p = CreateParams {
            template_id: "base".into(),
            timeout_secs: Some(30),
            secure: true,
            auto_resume: true,
            team: "t1".into(),
            ..Default::default()
        };
        p.metadata.insert("k".into(), "v".into());
        p.ingress.traffic_token = Some("tok".into());
        p.network = Some(
            kiln_net::EgressPolicy::from_lists(false, &["10.1.2.3".into()], &[], &[]).unwrap(),
        );
        let doc: CreateDoc =
            serde_json::from_slice(&serde_json::to_vec(&CreateDoc::of(&p).unwrap()).unwrap())
                .unwrap();
        let back = doc.into_params().unwrap();
        assert_eq!(back.template_id, "base");
        assert_eq!(back.timeout_secs, Some(30));
        assert_eq!(back.metadata.get("k").map(String::as_str), Some("v"));
        assert_eq!(back.ingress.traffic_token.as_deref(), Some("tok"));
        assert!(back.secure && back.auto_resume);
        assert_eq!(back.network, p.network);
    }

    #[test]
    fn a_metrics_sample_travels_whole() {
        let m = MetricSample {
            timestamp_ms: 1_700_000_000_123,
            cpu_count: 2,
            cpu_used_pct: 12.5,
            mem_used: 3 << 20,
            mem_total: 512 << 20,
            mem_cache: 1 << 20,
            disk_used: 7 << 20,
            disk_total: 1 << 30,
        };
        let text = serde_json::to_vec(&MetricDoc::from(&m)).unwrap();
        let back: MetricDoc = serde_json::from_slice(&text).unwrap();
        assert_eq!(MetricSample::from(back), m);
        // An answer without samples (a node's older reply shape) reads as none.
        let a: OpAnswer = serde_json::from_str(
            r#"{"sandbox":null,"flag":false,"end_at_ms":0,"children":[],"revision":3}"#,
        )
        .unwrap();
        assert!(a.metrics.is_empty());
    }

    #[test]
    fn mounts_travel_whole() {
        let m = kiln_server::store::MountRecord {
            volume_id: "vol_1".into(),
            name: "data".into(),
            path: "/data".into(),
        };
        let p = CreateParams {
            volume_mounts: vec![m.clone()],
            ..Default::default()
        };
        let text = serde_json::to_string(&CreateDoc::of(&p).unwrap()).unwrap();
        let back: CreateDoc = serde_json::from_str(&text).unwrap();
        assert_eq!(back.into_params().unwrap().volume_mounts, vec![m]);
    }

    #[test]
    fn a_policys_lists_travel_with_its_rules_and_egress_proxy_as_given() {
        let mut p = kiln_net::EgressPolicy::from_lists(
            false,
            &["198.51.100.7".into(), "*.example.test".into()],
            &["0.0.0.0/0".into()],
            &["198.51.100.53".into()],
        )
        .unwrap();
        p.https_ports = vec![8443];
        let text = serde_json::to_string(&Op::SetNetwork {
            network: NetworkDoc::of(&p, None).unwrap(),
            settings: None,
        })
        .unwrap();
        let Op::SetNetwork { network, settings } = serde_json::from_str(&text).unwrap() else {
            panic!("{text}");
        };
        assert_eq!(
            (network.into_policy().unwrap(), settings),
            (p.clone(), None)
        );
        let proxy = serde_json::json!({"address": "198.51.100.8:1080"});
        p.egress_proxy = Some(kiln_net::upstream::EgressProxyConfig::parse(&proxy).unwrap());
        // An egress proxy travels as the client gave it, beside the lists ...
        let given = serde_json::json!({"egressProxy": proxy});
        let text = serde_json::to_string(&Op::SetNetwork {
            network: NetworkDoc::of(&p, Some(&given)).unwrap(),
            settings: Some(given.clone()),
        })
        .unwrap();
        let Op::SetNetwork { network, settings } = serde_json::from_str(&text).unwrap() else {
            panic!("{text}");
        };
        assert_eq!(settings, Some(given));
        assert!(network.into_policy().unwrap().egress_proxy.is_none());
        // ... and never silently dropped.
        let e = NetworkDoc::of(&p, None).unwrap_err();
        assert_eq!(kiln_server::ApiError::from(e).status, 500);
        // A node checks the lists again: a bad entry is a 400, not a policy.
        let bad = NetworkDoc {
            allow_out: vec!["not an address!".into()],
            ..NetworkDoc::lists(&kiln_net::EgressPolicy::default())
        };
        let e = bad.into_policy().unwrap_err();
        assert_eq!(kiln_server::ApiError::from(e).status, 400);
    }

    #[test]
    fn refusals_keep_their_status() {
        for (s, want) in [
            (400, 400),
            (404, 404),
            (409, 409),
            (429, 429),
            (503, 503),
            (501, 501),
        ] {
            let e = error_of(StatusCode::from_u16(s).unwrap(), "m".into(), "sb");
            assert_eq!(kiln_server::ApiError::from(e).status.as_u16(), want);
        }
    }
}
