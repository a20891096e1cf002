//! The sandbox network flags `kiln serve` and `kiln node` share, and settling them.

use kiln_gvisor::net_config::{resolve, NetOptions, NetSetup};

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum OnOff {
    #[value(alias = "1")]
    On,
    #[value(alias = "0")]
    Off,
}

/// Sandbox networking (on by default, as on E2B).
#[derive(clap::Args)]
pub struct NetArgs {
    /// Sandbox networking: internet egress under each sandbox's policy, ingress to any port.
    /// With `off` (or on a host that cannot do it) sandboxes have no network and creates
    /// asking for internet access get 501.
    #[arg(long, env = "KILN_NETWORK", default_value = "on")]
    network: OnOff,
    /// Host-side range of the sandboxes' addresses (each takes a /31). Default: the range
    /// this state directory used before, else a free 10.N.0.0/16 (N in 200..254).
    #[arg(long, env = "KILN_NET_RANGE", value_name = "CIDR")]
    net_range: Option<kiln_net::Cidr>,
    /// Network slots kept ready (pre-created namespaces).
    #[arg(long, env = "KILN_NET_POOL", default_value_t = 4)]
    net_pool: usize,
    /// Private range sandboxes may reach (on-prem services), subject to each sandbox's policy
    /// (repeatable, or comma-separated).
    #[arg(
        long = "allow-private",
        env = "KILN_NET_ALLOW_PRIVATE",
        value_name = "CIDR",
        value_delimiter = ','
    )]
    allow_private: Vec<kiln_net::Cidr>,
    /// Upstream resolvers of the sandboxes' DNS forwarders (default: the host's).
    #[arg(
        long = "dns-upstream",
        env = "KILN_DNS_UPSTREAM",
        value_name = "IP",
        value_delimiter = ','
    )]
    dns_upstream: Vec<std::net::Ipv4Addr>,
    /// Most connections a sandbox may have open at once (0: no cap).
    #[arg(long, env = "KILN_NET_MAX_CONNS", default_value_t = 0)]
    net_max_conns: u32,
    /// Egress bandwidth cap of each sandbox, MiB/s (0: no cap).
    #[arg(long, env = "KILN_NET_EGRESS_MIBS", default_value_t = 0)]
    net_egress_mibs: u32,
}

impl NetArgs {
    fn options(&self) -> NetOptions {
        NetOptions {
            enabled: self.network == OnOff::On,
            range: self.net_range,
            pool_size: self.net_pool,
            allow_private: self.allow_private.clone(),
            dns_upstreams: self.dns_upstream.clone(),
            max_connections: self.net_max_conns,
            egress_mib_per_sec: self.net_egress_mibs,
        }
    }
}

/// Settles sandbox networking and says what it is (a host without it gets a warning, not a
/// failed start).
pub async fn network_config(
    a: &NetArgs,
    state_dir: &std::path::Path,
) -> anyhow::Result<Option<kiln_net::NetConfig>> {
    match resolve(&a.options(), state_dir)
        .await
        .map_err(|e| anyhow::anyhow!("sandbox networking: {e}"))?
    {
        NetSetup::On { config, range_note } => {
            println!("kiln: sandbox networking on, host range {range_note}");
            Ok(Some(config))
        }
        NetSetup::Off {
            reason,
            requested: true,
        } => {
            println!("kiln: sandbox networking off: {reason}");
            Ok(None)
        }
        NetSetup::Off { reason, .. } => {
            eprintln!(
                "kiln: warning: sandbox networking is unavailable on this host: {reason}; \
                 sandboxes run without a network and creates asking for internet access get \
                 501 (see `kiln doctor`)"
            );
            Ok(None)
        }
    }
}
