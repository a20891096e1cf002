//! Host-wide networking: the host range checked against the host's routes, forwarding, the
//! host's nftables table, and removing what an earlier run of the same pool left behind.

use std::net::Ipv4Addr;

use crate::cmd::{nft, run};
use crate::rules::host_ruleset;
use crate::slot::teardown_names;
use crate::{Cidr, NetError, Result};

/// A short name prefix (`k` + 4 hex digits) derived from `seed` (kiln's state directory), so
/// two kiln servers on one host never touch each other's namespaces.
pub fn prefix_for(seed: &str) -> String {
    // FNV-1a: stable across builds and Rust versions.
    let mut h: u32 = 0x811c_9dc5;
    for b in seed.bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    format!("k{:04x}", h & 0xffff)
}

/// The host's IPv4 routes' destinations (`ip -j route`), `default` excluded.
pub async fn route_destinations() -> Result<Vec<(Cidr, String)>> {
    let out = run("ip", &["-j", "-4", "route", "show", "table", "all"], None).await?;
    let v: serde_json::Value = serde_json::from_str(out.trim())
        .map_err(|e| NetError::Config(format!("parsing `ip -j route`: {e}")))?;
    let mut dsts = Vec::new();
    for r in v.as_array().into_iter().flatten() {
        let dst = r["dst"].as_str().unwrap_or("");
        if dst == "default" || dst.is_empty() {
            continue;
        }
        if let Ok(c) = dst.parse::<Cidr>() {
            let dev = r["dev"].as_str().unwrap_or("?").to_string();
            dsts.push((c, dev));
        }
    }
    Ok(dsts)
}

/// Fails when the host range overlaps a route of the host that is not one of this pool's own
/// veths (`own_prefix`).
pub async fn check_range(range: &Cidr, own_prefix: &str) -> Result<()> {
    for (dst, dev) in route_destinations().await? {
        if dev.starts_with(own_prefix) {
            continue;
        }
        // Broadcast/local entries of the host's own addresses show up as /32s too.
        if dst.overlaps(range) {
            return Err(NetError::Config(format!(
                "the sandbox host range {range} overlaps the host's route {dst} (dev {dev}); \
                 choose another range with --net-range"
            )));
        }
    }
    Ok(())
}

/// The host's own IPv4 addresses.
pub async fn host_addresses() -> Result<Vec<Ipv4Addr>> {
    let out = run("ip", &["-j", "-4", "addr", "show"], None).await?;
    let v: serde_json::Value = serde_json::from_str(out.trim())
        .map_err(|e| NetError::Config(format!("parsing `ip -j addr`: {e}")))?;
    let mut addrs = Vec::new();
    for link in v.as_array().into_iter().flatten() {
        for a in link["addr_info"].as_array().into_iter().flatten() {
            if let Some(ip) = a["local"].as_str().and_then(|s| s.parse().ok()) {
                addrs.push(ip);
            }
        }
    }
    Ok(addrs)
}

/// Where pools keep their lock files: a pool holds `<prefix>.lock` (flock) for its life, so a
/// later start can tell a dead pool's leftovers from a live one's.
pub const LOCK_DIR: &str = "/run/kiln-net";

/// Takes the lock of `prefix`; fails if a live pool holds it.
pub fn lock_prefix(prefix: &str) -> Result<std::fs::File> {
    use std::os::fd::AsRawFd;
    std::fs::create_dir_all(LOCK_DIR).map_err(crate::io_err(format!("creating {LOCK_DIR}")))?;
    let path = format!("{LOCK_DIR}/{prefix}.lock");
    let f = std::fs::File::create(&path).map_err(crate::io_err(format!("creating {path}")))?;
    // SAFETY: flock on a file descriptor we own; no memory is shared with the kernel.
    let rc = unsafe { nix::libc::flock(f.as_raw_fd(), nix::libc::LOCK_EX | nix::libc::LOCK_NB) };
    if rc != 0 {
        return Err(NetError::Config(format!(
            "another kiln server already uses the network prefix {prefix} (same state directory)"
        )));
    }
    Ok(f)
}

/// Removes what dead pools (whose lock nobody holds) left in `range`: their slots and tables.
pub async fn reclaim_stale(range: &Cidr, own_prefix: &str) -> Result<()> {
    let mut dead = std::collections::BTreeSet::new();
    for (dst, dev) in route_destinations().await? {
        let Some(p) = pool_prefix_of(&dev) else {
            continue;
        };
        if p != own_prefix && dst.overlaps(range) {
            dead.insert(p.to_string());
        }
    }
    for p in dead {
        let Ok(_lock) = lock_prefix(&p) else { continue };
        tracing::info!(prefix = %p, "removing network slots a dead kiln server left behind");
        for i in leftover_indices(&p) {
            remove_slot(&p, i).await?;
        }
        let _ = remove_table(&p).await;
    }
    Ok(())
}

/// The pool prefix of a host veth name (`k1a2bh7` → `k1a2b`).
fn pool_prefix_of(dev: &str) -> Option<&str> {
    let b = dev.as_bytes();
    let ok = b.len() > 6
        && b[0] == b'k'
        && b[1..5].iter().all(u8::is_ascii_hexdigit)
        && b[5] == b'h'
        && b[6..].iter().all(u8::is_ascii_digit);
    ok.then(|| &dev[..5])
}

/// Name of the host table of the pool with `prefix`.
pub fn host_table(prefix: &str) -> String {
    format!("kiln_{prefix}")
}

/// Turns on forwarding and loads the host table.
pub async fn setup(prefix: &str, range: &Cidr) -> Result<()> {
    std::fs::write("/proc/sys/net/ipv4/ip_forward", "1")
        .map_err(crate::io_err("enabling IPv4 forwarding"))?;
    nft(
        None,
        &host_ruleset(&host_table(prefix), &format!("{prefix}h"), range),
    )
    .await
}

/// Removes the host table of `prefix`.
pub async fn remove_table(prefix: &str) -> Result<()> {
    let t = host_table(prefix);
    nft(None, &format!("table ip {t}\ndelete table ip {t}\n")).await
}

/// Slot indices whose namespaces or host veths exist for `prefix`.
pub fn leftover_indices(prefix: &str) -> std::collections::BTreeSet<u32> {
    let mut found = std::collections::BTreeSet::new();
    let ns_prefix = format!("{prefix}-");
    if let Ok(rd) = std::fs::read_dir("/run/netns") {
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(rest) = name.strip_prefix(&ns_prefix) {
                if let Ok(i) = rest.trim_end_matches(['r', 's']).parse() {
                    found.insert(i);
                }
            }
        }
    }
    let veth_prefix = format!("{prefix}h");
    if let Ok(rd) = std::fs::read_dir("/sys/class/net") {
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(Ok(i)) = name.strip_prefix(&veth_prefix).map(str::parse) {
                found.insert(i);
            }
        }
    }
    found
}

/// Tears down the leftovers of slot `index` of `prefix`.
pub async fn remove_slot(prefix: &str, index: u32) -> Result<()> {
    teardown_names(
        &format!("{prefix}-{index}r"),
        &format!("{prefix}-{index}s"),
        &format!("{prefix}h{index}"),
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_are_short_and_stable() {
        let p = prefix_for("/var/lib/kiln");
        assert_eq!(p.len(), 5);
        assert_eq!(p, prefix_for("/var/lib/kiln"));
        assert_ne!(p, prefix_for("/tmp/other"));
        // The longest interface name stays within IFNAMSIZ - 1.
        assert!(format!("{p}h65535").len() <= 15);
        assert_eq!(pool_prefix_of("k1a2bh7"), Some("k1a2b"));
        assert_eq!(pool_prefix_of("eth0"), None);
        assert_eq!(pool_prefix_of("k1a2bh"), None);
    }
}
