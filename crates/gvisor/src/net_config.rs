//! The sandbox network settings of a server: on by default (E2B's default is internet on),
//! off when asked (`--network off`) or when the host cannot do it (no root, no `ip`/`nft`, no
//! network namespaces), with the reason kept for the startup output and for create's 501.
//!
//! Without `--net-range`, the host range is chosen here ([`kiln_net::range::pick_range`]):
//! the range the same state directory used last time if still free (so a restarted server
//! adopts its sandboxes' slots), else a free `10.N.0.0/16`. The choice is recorded in
//! `<state>/gvisor/net-range`.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use kiln_net::{Cidr, NetConfig};

/// What the operator asked for (`kiln serve` flags and their environment fallbacks).
#[derive(Debug, Clone)]
pub struct NetOptions {
    /// `--network on|off`.
    pub enabled: bool,
    /// `--net-range` (None: choose a free one).
    pub range: Option<Cidr>,
    /// Slots kept ready.
    pub pool_size: usize,
    /// `--allow-private`: private ranges sandboxes may reach.
    pub allow_private: Vec<Cidr>,
    /// `--dns-upstream` (empty: the host's resolvers).
    pub dns_upstreams: Vec<Ipv4Addr>,
    /// Connections per sandbox (0: no cap).
    pub max_connections: u32,
    /// Egress MiB/s per sandbox (0: no cap).
    pub egress_mib_per_sec: u32,
}

impl Default for NetOptions {
    fn default() -> Self {
        Self {
            enabled: true,
            range: None,
            pool_size: 4,
            allow_private: Vec::new(),
            dns_upstreams: Vec::new(),
            max_connections: 0,
            egress_mib_per_sec: 0,
        }
    }
}

/// The outcome: networking on (with how the range was chosen), or off and why.
#[derive(Debug, Clone)]
pub enum NetSetup {
    On {
        config: NetConfig,
        /// "10.213.0.0/16 (chosen: free on this host)" or similar.
        range_note: String,
    },
    Off {
        /// Why, in words for the operator.
        reason: String,
        /// Whether the operator asked for it (else the host cannot do networking).
        requested: bool,
    },
}

/// Directory of the gVisor driver's state under `state_dir` (names the pool's prefix).
fn driver_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("gvisor")
}

/// Name prefix of the slots of the server whose state is in `state_dir`.
pub fn prefix_for_state(state_dir: &Path) -> String {
    kiln_net::host::prefix_for(&driver_dir(state_dir).display().to_string())
}

/// Settles the network settings of the server with state in `state_dir`. Errors are the
/// operator's (a bad explicit range); a host without networking is `Off`, not an error.
pub async fn resolve(opts: &NetOptions, state_dir: &Path) -> Result<NetSetup, String> {
    if !opts.enabled {
        return Ok(NetSetup::Off {
            reason: "turned off (--network off)".into(),
            requested: true,
        });
    }
    if let Err(why) = kiln_net::range::probe().await {
        return Ok(NetSetup::Off {
            reason: why,
            requested: false,
        });
    }
    let prefix = prefix_for_state(state_dir);
    let record = driver_dir(state_dir).join("net-range");
    let (range, range_note) = match opts.range {
        Some(r) => (r, format!("{r} (--net-range)")),
        None => {
            let previous = std::fs::read_to_string(&record)
                .ok()
                .and_then(|t| t.trim().parse::<Cidr>().ok());
            let r = kiln_net::range::pick_range(&prefix, previous)
                .await
                .map_err(|e| e.to_string())?;
            let how = if Some(r) == previous {
                "the range this state directory used before"
            } else {
                "chosen automatically: free on this host"
            };
            (r, format!("{r} ({how}; --net-range to choose)"))
        }
    };
    if let Some(dir) = record.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    let _ = std::fs::write(&record, format!("{range}\n"));
    let dns_upstreams = if opts.dns_upstreams.is_empty() {
        kiln_net::dns::system_resolvers()
    } else {
        opts.dns_upstreams.clone()
    };
    Ok(NetSetup::On {
        config: NetConfig {
            range,
            pool_size: opts.pool_size,
            prefix,
            operator_allow: opts.allow_private.clone(),
            dns_upstreams,
            max_connections: opts.max_connections,
            egress_mib_per_sec: opts.egress_mib_per_sec,
            proxy_all_tcp: false,
        },
        range_note,
    })
}
