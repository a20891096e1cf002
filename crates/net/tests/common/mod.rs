//! What the namespace tests share: running `ip`/`nft`, their guard, and a test "internet"
//! (a network namespace of hosts on documentation addresses behind a host veth).

#![allow(dead_code)] // each test binary uses its own part

use std::path::PathBuf;
use std::process::Command;

/// Runs `args`; panics with its stderr when it fails.
pub fn sh(args: &[&str]) {
    let out = Command::new(args[0]).args(&args[1..]).output().unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Whether the test can run (root, `ip`, `nft`), under the skip policy of [`kiln_testkit`].
pub fn root_or_skip() -> bool {
    kiln_testkit::needs()
        .root("namespaces and nftables")
        .tools(&["ip", "nft"])
        .ok()
}

/// Test hosts: namespace `ns` whose `eth0` holds `addrs`, behind host veth `veth` holding
/// `gateway` (an address with its prefix, also the namespace's default route). Removed on drop.
pub struct TestHosts {
    ns: &'static str,
    veth: &'static str,
}

impl TestHosts {
    pub fn up(ns: &'static str, veth: &'static str, gateway: &str, addrs: &[&str]) -> TestHosts {
        let hosts = TestHosts { ns, veth };
        hosts.down();
        sh(&["ip", "netns", "add", ns]);
        sh(&[
            "ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns,
        ]);
        sh(&["ip", "addr", "add", gateway, "dev", veth]);
        sh(&["ip", "link", "set", veth, "up"]);
        for a in addrs {
            sh(&["ip", "-n", ns, "addr", "add", a, "dev", "eth0"]);
        }
        sh(&["ip", "-n", ns, "link", "set", "eth0", "up"]);
        sh(&["ip", "-n", ns, "link", "set", "lo", "up"]);
        let via = gateway.split('/').next().unwrap_or(gateway);
        sh(&["ip", "-n", ns, "route", "add", "default", "via", via]);
        hosts
    }

    fn down(&self) {
        let _ = Command::new("ip").args(["netns", "del", self.ns]).output();
        let _ = Command::new("ip").args(["link", "del", self.veth]).output();
    }

    /// The namespace's path, for `in_netns`.
    pub fn path(&self) -> PathBuf {
        PathBuf::from("/run/netns").join(self.ns)
    }
}

impl Drop for TestHosts {
    fn drop(&mut self) {
        self.down();
    }
}
