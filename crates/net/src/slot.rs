//! One slot: its names and addresses, setting it up and tearing it down.

use std::net::Ipv4Addr;
use std::path::PathBuf;

use crate::cmd::{ip_batch, nft, run};
use crate::policy::EgressPolicy;
use crate::rules::{slot_ruleset, HostFacts, GUEST_LINK, UPLINK};
use crate::{Result, GATEWAY_ADDR, GUEST_ADDR, GUEST_PREFIX};

/// A slot of the pool. Its names all derive from the pool's prefix and the slot's index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot {
    pub index: u32,
    /// The pool's name prefix (`k` + 4 hex digits).
    pub prefix: String,
    /// Host side of the /31.
    pub host_addr: Ipv4Addr,
    /// The slot's unique address (the sandbox's address as the host sees it).
    pub slot_addr: Ipv4Addr,
}

impl Slot {
    /// The namespace the sandbox runs in (same addressing in every slot).
    pub fn sandbox_ns(&self) -> String {
        format!("{}-{}s", self.prefix, self.index)
    }

    /// The namespace that routes, translates and filters for the sandbox.
    pub fn router_ns(&self) -> String {
        format!("{}-{}r", self.prefix, self.index)
    }

    /// The host's end of the slot's veth.
    pub fn host_veth(&self) -> String {
        format!("{}h{}", self.prefix, self.index)
    }

    /// Path of the sandbox namespace (what an OCI spec's network namespace points at).
    pub fn sandbox_ns_path(&self) -> PathBuf {
        PathBuf::from("/run/netns").join(self.sandbox_ns())
    }

    pub fn router_ns_path(&self) -> PathBuf {
        PathBuf::from("/run/netns").join(self.router_ns())
    }

    /// Creates the namespaces, veths, addresses, routes, forwarding and the ruleset.
    pub async fn setup(&self, host: &HostFacts, policy: &EgressPolicy) -> Result<()> {
        let (r, s, h) = (self.router_ns(), self.sandbox_ns(), self.host_veth());
        ip_batch(
            None,
            &[
                format!("netns add {r}"),
                format!("netns add {s}"),
                format!("link add {h} type veth peer name {UPLINK} netns {r}"),
                format!("addr add {}/31 dev {h}", self.host_addr),
                format!("link set {h} up"),
            ],
        )
        .await?;
        ip_batch(
            Some(&r),
            &[
                "link set lo up".into(),
                format!("addr add {}/31 dev {UPLINK}", self.slot_addr),
                format!("link set {UPLINK} up"),
                format!("link add {GUEST_LINK} type veth peer name eth0 netns {s}"),
                format!("addr add {GATEWAY_ADDR}/{GUEST_PREFIX} dev {GUEST_LINK}"),
                format!("link set {GUEST_LINK} up"),
                format!("route add default via {}", self.host_addr),
            ],
        )
        .await?;
        // No IPv6 in the sandbox namespace either: the runtime copies what it finds there.
        run(
            "ip",
            &[
                "netns",
                "exec",
                &s,
                "sysctl",
                "-q",
                "-w",
                "net.ipv6.conf.all.disable_ipv6=1",
                "-w",
                "net.ipv6.conf.default.disable_ipv6=1",
            ],
            None,
        )
        .await?;
        self.address_guest().await?;
        run(
            "ip",
            &[
                "netns",
                "exec",
                &r,
                "sysctl",
                "-q",
                "-w",
                "net.ipv4.ip_forward=1",
                // Sandboxes are IPv4-only: no IPv6 (not even link-local) on the router side.
                "-w",
                "net.ipv6.conf.all.disable_ipv6=1",
                "-w",
                "net.ipv6.conf.default.disable_ipv6=1",
            ],
            None,
        )
        .await?;
        self.apply(host, policy).await
    }

    /// (Re)addresses the sandbox side. An isolation runtime that takes the interface over
    /// (gVisor's netstack) leaves it without its address when the sandbox stops.
    pub async fn address_guest(&self) -> Result<()> {
        crate::rtnl::address(
            &self.sandbox_ns_path(),
            crate::rtnl::Addressing {
                dev: "eth0",
                addr: GUEST_ADDR,
                prefix: GUEST_PREFIX,
                gateway: GATEWAY_ADDR,
            },
        )
        .await
    }

    /// Replaces the slot's ruleset (one atomic transaction).
    pub async fn apply(&self, host: &HostFacts, policy: &EgressPolicy) -> Result<()> {
        nft(
            Some(&self.router_ns()),
            &slot_ruleset(self.slot_addr, host, policy),
        )
        .await
    }

    /// Removes everything the slot holds on the host. Deleting the namespaces destroys their
    /// interfaces (and the host veth with its peer) and their rulesets. Idempotent.
    pub async fn teardown(&self) -> Result<()> {
        teardown_names(&self.router_ns(), &self.sandbox_ns(), &self.host_veth()).await
    }
}

/// Deletes two namespaces and a host veth, whichever of them exist.
pub async fn teardown_names(router_ns: &str, sandbox_ns: &str, host_veth: &str) -> Result<()> {
    let mut first_err = None;
    for ns in [sandbox_ns, router_ns] {
        if std::path::Path::new("/run/netns").join(ns).exists() {
            if let Err(e) = run("ip", &["netns", "del", ns], None).await {
                first_err.get_or_insert(e);
            }
        }
    }
    if std::path::Path::new("/sys/class/net")
        .join(host_veth)
        .exists()
    {
        // Usually gone with its peer already; a race with the kernel's namespace cleanup is
        // harmless.
        let _ = run("ip", &["link", "del", host_veth], None).await;
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(()),
    }
}
