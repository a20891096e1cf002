//! Choosing the host range when the operator names none, and probing whether this host can
//! give sandboxes a network at all.
//!
//! A range is free when no route or address of the host overlaps it (this server's own slot
//! veths excepted) and no other live kiln server has claimed it. Claims are files
//! `<LOCK_DIR>/<prefix>.range`; a claim counts while its owner's lock is held (the pool holds
//! it for its life) or while it is young (the gap between choosing and starting the pool).

use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::time::Duration;

use crate::cmd::run;
use crate::host::{route_destinations, LOCK_DIR};
use crate::{io_err, Cidr, NetError, Result};

/// Ranges never chosen automatically: the documentation networks (test hosts live there).
const NEVER: [&str; 3] = ["192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24"];
/// First and last second octet of the automatic candidates `10.N.0.0/16`.
const FIRST: u8 = 200;
const LAST: u8 = 254;
/// How long a claim counts without its owner's lock (choosing → starting the pool).
const CLAIM_GRACE: Duration = Duration::from_secs(120);

/// The automatic candidates for `prefix`, in the order tried: `10.200.0.0/16`…`10.254.0.0/16`,
/// starting at a place derived from the prefix so that two servers starting together rarely
/// try the same one first.
pub fn candidates(prefix: &str) -> Vec<Cidr> {
    let n = u32::from(LAST - FIRST) + 1;
    let seed = u32::from_str_radix(prefix.trim_start_matches('k'), 16).unwrap_or(0) % n;
    (0..n)
        .map(|i| {
            let octet = FIRST as u32 + (seed + i) % n;
            Cidr::new(Ipv4Addr::new(10, octet as u8, 0, 0), 16).expect("valid")
        })
        .collect()
}

/// Whether a lock file is held by a live process. Read from `/proc/locks` rather than by trying
/// the lock, which could make a server starting at that moment think its prefix taken.
fn lock_held(path: &std::path::Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let Ok(meta) = std::fs::metadata(path) else {
        return false;
    };
    let locks = std::fs::read_to_string("/proc/locks").unwrap_or_default();
    flock_on_inode(&locks, meta.ino())
}

/// Whether `/proc/locks` text lists a flock on inode `ino` (`… FLOCK ADVISORY WRITE <pid>
/// <maj>:<min>:<ino> 0 EOF`).
fn flock_on_inode(locks: &str, ino: u64) -> bool {
    locks.lines().any(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        f.contains(&"FLOCK")
            && f.iter().any(|w| {
                w.rsplit(':').next().and_then(|i| i.parse::<u64>().ok()) == Some(ino)
                    && w.matches(':').count() == 2
            })
    })
}

/// A claim file's text: `<range> <pid>` (older servers wrote the range alone).
pub fn claim_text(range: &Cidr) -> String {
    format!("{range} {}\n", std::process::id())
}

/// The range and the writer's pid of a claim file's text.
pub fn parse_claim(text: &str) -> (Option<Cidr>, Option<u32>) {
    let mut w = text.split_whitespace();
    let range = w.next().and_then(|r| r.parse().ok());
    (range, w.next().and_then(|p| p.parse().ok()))
}

/// Whether process `pid` exists.
pub fn pid_alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// Ranges other live kiln servers have claimed.
fn claims_of_others(own_prefix: &str) -> Vec<Cidr> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(LOCK_DIR) else {
        return out;
    };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(p) = name.strip_suffix(".range") else {
            continue;
        };
        if p == own_prefix {
            continue;
        }
        let young = e
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age < CLAIM_GRACE);
        let text = std::fs::read_to_string(e.path()).unwrap_or_default();
        let (range, pid) = parse_claim(&text);
        // A claim whose writer is dead counts no more, young or not.
        let young = young && pid.is_none_or(pid_alive);
        let live = young || lock_held(&std::path::Path::new(LOCK_DIR).join(format!("{p}.lock")));
        if let Some(c) = range.filter(|_| live) {
            out.push(c);
        }
    }
    out
}

/// The host's IPv4 addresses with the device each is on.
async fn addresses_by_device() -> Result<Vec<(Ipv4Addr, String)>> {
    let out = run("ip", &["-j", "-4", "addr", "show"], None).await?;
    let v: serde_json::Value = serde_json::from_str(out.trim())
        .map_err(|e| NetError::Config(format!("parsing `ip -j addr`: {e}")))?;
    let mut addrs = Vec::new();
    for link in v.as_array().into_iter().flatten() {
        let dev = link["ifname"].as_str().unwrap_or("").to_string();
        for a in link["addr_info"].as_array().into_iter().flatten() {
            if let Some(ip) = a["local"].as_str().and_then(|s| s.parse().ok()) {
                addrs.push((ip, dev.clone()));
            }
        }
    }
    Ok(addrs)
}

/// Picks a free host range for the pool with `prefix` (trying `preferred` first, e.g. the range
/// an earlier run of the same server used, so that its sandboxes' slots can be adopted) and
/// claims it. Fails when every candidate is taken.
pub async fn pick_range(prefix: &str, preferred: Option<Cidr>) -> Result<Cidr> {
    std::fs::create_dir_all(LOCK_DIR).map_err(io_err(format!("creating {LOCK_DIR}")))?;
    // One chooser at a time on this host.
    let guard_path = format!("{LOCK_DIR}/choose.lock");
    let guard =
        std::fs::File::create(&guard_path).map_err(io_err(format!("creating {guard_path}")))?;
    let fd = guard.as_raw_fd();
    tokio::task::spawn_blocking(move || {
        // SAFETY: flock on a descriptor owned by `guard`, which outlives the call.
        unsafe { nix::libc::flock(fd, nix::libc::LOCK_EX) }
    })
    .await
    .map_err(|e| NetError::Config(format!("waiting for the range lock: {e}")))?;
    let own_dev = format!("{prefix}h");
    let mut taken: Vec<Cidr> = route_destinations()
        .await?
        .into_iter()
        .filter(|(_, dev)| !dev.starts_with(&own_dev))
        .map(|(c, _)| c)
        .collect();
    taken.extend(
        addresses_by_device()
            .await?
            .into_iter()
            .filter(|(_, dev)| !dev.starts_with(&own_dev))
            .map(|(a, _)| Cidr::new(a, 32).expect("valid")),
    );
    taken.extend(NEVER.iter().map(|c| c.parse::<Cidr>().expect("valid")));
    taken.extend(claims_of_others(prefix));
    let pick = preferred
        .into_iter()
        .chain(candidates(prefix))
        .find(|c| !taken.iter().any(|t| t.overlaps(c)))
        .ok_or_else(|| {
            NetError::Config(format!(
                "no free sandbox host range among 10.{FIRST}.0.0/16 … 10.{LAST}.0.0/16 (all \
                 overlap the host's routes or other kiln servers); name one with --net-range"
            ))
        })?;
    let claim = format!("{LOCK_DIR}/{prefix}.range");
    std::fs::write(&claim, claim_text(&pick)).map_err(io_err(format!("writing {claim}")))?;
    drop(guard);
    Ok(pick)
}

/// Why this host cannot give sandboxes a network (`Ok` when it can): needs root, `ip` and `nft`,
/// and a scratch namespace with a veth pair and an nftables table in it.
pub async fn probe() -> std::result::Result<(), String> {
    if !nix::unistd::geteuid().is_root() {
        return Err("not running as root (network namespaces and nftables need it)".into());
    }
    for (tool, flag) in [("ip", "-V"), ("nft", "-v")] {
        if run(tool, &[flag], None).await.is_err() {
            return Err(format!(
                "`{tool}` is missing or does not run (install iproute2 and nftables)"
            ));
        }
    }
    let ns = format!("kiln-probe-{}", std::process::id());
    let r = async {
        run("ip", &["netns", "add", &ns], None).await?;
        run(
            "ip",
            &[
                "-n", &ns, "link", "add", "kp0", "type", "veth", "peer", "name", "kp1",
            ],
            None,
        )
        .await?;
        crate::cmd::nft(Some(&ns), "table ip kiln_probe {\n}\n").await
    }
    .await;
    let _ = run("ip", &["netns", "del", &ns], None).await;
    r.map_err(|e| match e {
        NetError::Command { command, output } => {
            format!(
                "`{command}` failed: {output} (network namespaces, veth and nf_tables are needed)"
            )
        }
        other => other.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_carry_their_writer() {
        let c: Cidr = "10.201.0.0/16".parse().unwrap();
        let (r, pid) = parse_claim(&claim_text(&c));
        assert_eq!((r, pid), (Some(c), Some(std::process::id())));
        assert!(pid_alive(std::process::id()));
        assert_eq!(parse_claim("10.201.0.0/16\n"), (Some(c), None));
        assert_eq!(parse_claim(""), (None, None));
    }

    #[test]
    fn flocks_are_found_by_inode() {
        let locks = "1: FLOCK  ADVISORY  WRITE 4242 00:1a:777 0 EOF\n\
                     2: POSIX  ADVISORY  WRITE 17 00:1a:778 0 EOF\n";
        assert!(flock_on_inode(locks, 777));
        assert!(!flock_on_inode(locks, 778));
        assert!(!flock_on_inode(locks, 77));
    }

    #[test]
    fn candidates_cover_the_block_once_avoiding_test_networks() {
        let a = candidates("k1a2b");
        assert_eq!(a.len(), 55);
        let mut sorted = a.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), 55);
        assert_ne!(candidates("k0000")[0], candidates("k0001")[0]);
        for never in NEVER {
            let n: Cidr = never.parse().unwrap();
            assert!(!a.iter().any(|c| c.overlaps(&n)));
        }
    }
}
