//! Sandbox networking for kiln.
//!
//! Every sandbox runs in a *slot*: two network namespaces wired to the host.
//!
//! ```text
//!  host ns                 router ns "<p>-<i>r"                     sandbox ns "<p>-<i>s"
//!  <p>h<i> HOST/31  <-veth->  up0 SLOT/31   gw0 169.254.0.22/30  <-veth->  eth0 169.254.0.21/30
//!                           (NAT: SLOT <-> 169.254.0.21, egress policy, DNS forwarder socket)
//! ```
//!
//! The sandbox namespace (what the isolation runtime gets, e.g. `runsc --network=sandbox`)
//! looks the same in every slot ([`GUEST_ADDR`], [`GATEWAY_ADDR`]), so a snapshot taken in one
//! slot resumes in any other. The router namespace translates the guest to the slot's unique
//! host-side address and applies the egress policy with nftables ([`rules`]). Slots are created
//! ahead of time by a [`pool::SlotPool`], so creating a sandbox does not wait for them.
//!
//! Modules: [`addr`] (IPv4 CIDRs, the host range), [`policy`] (E2B's egress policy),
//! [`rules`] (nftables text), [`cmd`] (running `ip`/`nft`), [`slot`] (one slot's setup and
//! teardown), [`host`] (host-wide forwarding and NAT), [`pool`] (the pool), [`netns`]
//! (sockets inside a namespace), [`range`] (choosing a free host range, probing the host), [`dns`] (the per-sandbox DNS forwarder, reading messages with [`dns_msg`]), [`egress`] (the
//! per-sandbox proxy that applies domain rules, naming connections with [`sni`]), [`relay`] (the proxy's
//! byte-counting splice), [`flows`] (UDP and ICMP flows the ruleset decides, read as NFLOG
//! packets and conntrack events with [`nfnl`]), [`observe`]
//! (what the proxy and the forwarder tell the audit log), [`sweep`] (what killed servers left behind),
//! [`ingress`] (who may reach a sandbox's ports; kept in the server's sandbox record),
//! [`intercept`] (TLS interception for `network.rules` header transforms), [`upstream`] (an
//! upstream SOCKS5 proxy for a sandbox's egress, E2B's `egressProxy`).

pub mod addr;
pub mod cmd;
pub mod dns;
pub mod dns_msg;
pub mod egress;
mod egress_sock;
pub mod flows;
pub mod host;
pub mod ingress;
pub mod intercept;
pub mod netns;
pub mod nfnl;
pub mod observe;
pub mod policy;
pub mod pool;
pub mod range;
pub mod relay;
pub mod rtnl;
pub mod rules;
pub mod slot;
pub mod sni;
pub mod sweep;
pub mod target;
pub mod upstream;

use std::net::Ipv4Addr;

pub use addr::Cidr;
pub use ingress::Ingress;
pub use policy::EgressPolicy;
pub use pool::{NetConfig, SlotPool};
pub use slot::Slot;

/// The sandbox's own address, identical in every slot.
pub const GUEST_ADDR: Ipv4Addr = Ipv4Addr::new(169, 254, 0, 21);
/// The sandbox's gateway (the router namespace's side), also its DNS server.
pub const GATEWAY_ADDR: Ipv4Addr = Ipv4Addr::new(169, 254, 0, 22);
/// Prefix length of the guest link.
pub const GUEST_PREFIX: u8 = 30;
/// Port of the proxy on the slot's gateway address.
pub const PROXY_PORT: u16 = 15001;

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("`{command}` failed: {output}")]
    Command { command: String, output: String },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid network configuration: {0}")]
    Config(String),
    #[error("invalid network policy: {0}")]
    Policy(String),
    #[error("no free network slot: all {0} slots of the host range are in use")]
    Exhausted(u32),
}

pub type Result<T, E = NetError> = std::result::Result<T, E>;

pub(crate) fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> NetError {
    let what = what.into();
    move |source| NetError::Io { what, source }
}
