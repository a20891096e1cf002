//! Removing what killed kiln servers left on the host, whatever their range.
//!
//! Every pool names its namespaces `<p>-<i>r`/`<p>-<i>s`, its host veths `<p>h<i>` and its
//! host table `kiln_<p>` after its prefix `<p>` ([`crate::host::prefix_for`]), and holds the
//! flock of `<LOCK_DIR>/<p>.lock` for its life; its claim `<LOCK_DIR>/<p>.range` names the
//! pid that wrote it. A prefix whose lock nobody holds and whose claim's pid is gone belongs to
//! a dead server: its slots are removed, except those whose sandbox namespace still has
//! processes in it (a sandbox that outlived its server, which that server's next start adopts)
//! or whose lease record names a sandbox directory that still exists (a paused sandbox, whose
//! restore needs its slot; see [`record_lease`]); once none is left, its host table, range
//! claim, lock file and lease records go too.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use crate::cmd::run;
use crate::host::{host_table, leftover_indices, lock_prefix, remove_slot, remove_table, LOCK_DIR};
use crate::range::{parse_claim, pid_alive};
use crate::Result;

/// What [`sweep_dead`] did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SweepReport {
    /// Prefixes of dead servers found.
    pub dead: Vec<String>,
    /// Slots removed.
    pub slots_removed: usize,
    /// Slots kept because a sandbox still runs in them.
    pub slots_kept: usize,
}

/// Directory of the lease records of the pool with `prefix`.
fn leases_dir(prefix: &str) -> String {
    format!("{LOCK_DIR}/{prefix}.leases")
}

/// Records that slot `index` of `prefix` belongs to the sandbox whose files are in
/// `sandbox_dir`: while that directory exists, no other server's sweep removes the slot.
pub fn record_lease(prefix: &str, index: u32, sandbox_dir: &Path) -> Result<()> {
    let dir = leases_dir(prefix);
    std::fs::create_dir_all(&dir).map_err(crate::io_err(format!("creating {dir}")))?;
    let path = format!("{dir}/{index}");
    std::fs::write(&path, sandbox_dir.as_os_str().as_encoded_bytes())
        .map_err(crate::io_err(format!("writing {path}")))
}

/// Forgets the lease record of slot `index` of `prefix` (the slot was released).
pub fn forget_lease(prefix: &str, index: u32) {
    let _ = std::fs::remove_file(format!("{}/{index}", leases_dir(prefix)));
}

/// Whether slot `index` of `prefix` has a lease record naming a sandbox directory that exists.
fn leased_to_existing_sandbox(prefix: &str, index: u32) -> bool {
    std::fs::read(format!("{}/{index}", leases_dir(prefix))).is_ok_and(|b| {
        let p = std::path::PathBuf::from(std::ffi::OsString::from(
            String::from_utf8_lossy(&b).into_owned(),
        ));
        p.is_absolute() && p.is_dir()
    })
}

/// Whether `s` is a pool prefix: `k` and four lowercase hex digits.
fn is_prefix(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 5
        && b[0] == b'k'
        && b[1..]
            .iter()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c))
}

/// The prefix of a slot namespace name (`k1a2b-7r` → `k1a2b`).
fn prefix_of_netns(name: &str) -> Option<&str> {
    let (p, rest) = name.split_once('-')?;
    let idx = rest.strip_suffix(['r', 's'])?;
    (is_prefix(p) && !idx.is_empty() && idx.bytes().all(|c| c.is_ascii_digit())).then_some(p)
}

/// The prefix of a host veth name (`k1a2bh7` → `k1a2b`).
fn prefix_of_veth(name: &str) -> Option<&str> {
    let p = name.get(..5)?;
    let idx = name.get(5..)?.strip_prefix('h')?;
    (is_prefix(p) && !idx.is_empty() && idx.bytes().all(|c| c.is_ascii_digit())).then_some(p)
}

/// The prefixes of the `kiln_<p>` tables in `nft list tables` output.
fn prefixes_of_tables(listing: &str) -> Vec<String> {
    listing
        .lines()
        .filter_map(|l| l.trim().strip_prefix("table ip kiln_"))
        .filter(|p| is_prefix(p))
        .map(str::to_string)
        .collect()
}

fn names_in(dir: &str) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Every pool prefix with something on this host: namespaces, veths, tables, claims.
async fn prefixes_on_host() -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    for n in names_in("/run/netns") {
        found.extend(prefix_of_netns(&n).map(str::to_string));
    }
    for n in names_in("/sys/class/net") {
        found.extend(prefix_of_veth(&n).map(str::to_string));
    }
    if let Ok(out) = run("nft", &["list", "tables"], None).await {
        found.extend(prefixes_of_tables(&out));
    }
    for n in names_in(LOCK_DIR) {
        if let Some(p) = n.strip_suffix(".range").filter(|p| is_prefix(p)) {
            found.insert(p.to_string());
        }
    }
    found
}

/// Network namespace inodes that some process is in now (`/proc/<pid>/ns/net`).
fn namespaces_in_use() -> BTreeSet<u64> {
    let mut inodes = BTreeSet::new();
    for pid in names_in("/proc") {
        if !pid.bytes().all(|c| c.is_ascii_digit()) {
            continue;
        }
        if let Ok(m) = std::fs::metadata(format!("/proc/{pid}/ns/net")) {
            inodes.insert(m.ino());
        }
    }
    inodes
}

/// Whether a process is in the namespace `/run/netns/<name>`.
fn occupied(name: &str, in_use: &BTreeSet<u64>) -> bool {
    std::fs::metadata(Path::new("/run/netns").join(name)).is_ok_and(|m| in_use.contains(&m.ino()))
}

/// Removes the leftovers of every dead server other than `own_prefix` (see the module docs).
pub async fn sweep_dead(own_prefix: &str) -> Result<SweepReport> {
    let mut report = SweepReport::default();
    let mut locks = BTreeMap::new();
    for p in prefixes_on_host().await {
        if p == own_prefix {
            continue;
        }
        // A server between choosing its range and starting its pool holds no lock yet but
        // has written its pid in its claim.
        let claim = std::fs::read_to_string(format!("{LOCK_DIR}/{p}.range")).unwrap_or_default();
        if parse_claim(&claim).1.is_some_and(pid_alive) {
            continue;
        }
        // Held by a live server: not ours to touch. Ours now, while we sweep.
        if let Ok(lock) = lock_prefix(&p) {
            locks.insert(p, lock);
        }
    }
    if locks.is_empty() {
        return Ok(report);
    }
    let in_use = namespaces_in_use();
    for p in locks.keys() {
        report.dead.push(p.clone());
        let mut kept = 0;
        for i in leftover_indices(p) {
            if occupied(&format!("{p}-{i}s"), &in_use) || leased_to_existing_sandbox(p, i) {
                kept += 1;
                continue;
            }
            remove_slot(p, i).await?;
            report.slots_removed += 1;
        }
        report.slots_kept += kept;
        if kept == 0 {
            if run("nft", &["list", "table", "ip", &host_table(p)], None)
                .await
                .is_ok()
            {
                remove_table(p).await?;
            }
            // The lock file too (held by us until the end of the sweep), so that dead servers'
            // names do not pile up.
            let _ = std::fs::remove_file(format!("{LOCK_DIR}/{p}.range"));
            let _ = std::fs::remove_dir_all(leases_dir(p));
            let _ = std::fs::remove_file(format!("{LOCK_DIR}/{p}.lock"));
        }
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_records_count_while_their_sandbox_directory_exists() {
        let prefix = format!("kt{:03x}", std::process::id() & 0xfff);
        let sandbox = tempfile::tempdir().unwrap();
        record_lease(&prefix, 3, sandbox.path()).unwrap();
        assert!(leased_to_existing_sandbox(&prefix, 3));
        assert!(!leased_to_existing_sandbox(&prefix, 4));
        let gone = sandbox.path().to_path_buf();
        drop(sandbox);
        assert!(!gone.exists());
        assert!(!leased_to_existing_sandbox(&prefix, 3));
        forget_lease(&prefix, 3);
        assert!(!Path::new(&format!("{}/3", leases_dir(&prefix))).exists());
        let _ = std::fs::remove_dir_all(leases_dir(&prefix));
    }

    #[test]
    fn names_are_recognized_strictly() {
        assert_eq!(prefix_of_netns("k1a2b-7r"), Some("k1a2b"));
        assert_eq!(prefix_of_netns("k1a2b-12s"), Some("k1a2b"));
        assert_eq!(prefix_of_netns("k1a2b-r"), None);
        assert_eq!(prefix_of_netns("kiln-probe-12"), None);
        assert_eq!(prefix_of_netns("ktsdk"), None);
        assert_eq!(prefix_of_netns("kZZZZ-1r"), None);
        assert_eq!(prefix_of_veth("k1a2bh7"), Some("k1a2b"));
        assert_eq!(prefix_of_veth("k1a2bh"), None);
        assert_eq!(prefix_of_veth("ktsdk0"), None);
        assert_eq!(prefix_of_veth("eth0"), None);
        assert_eq!(
            prefixes_of_tables("table inet filter\ntable ip kiln_k00ff\ntable ip kiln_probe\n"),
            vec!["k00ff".to_string()]
        );
    }
}
