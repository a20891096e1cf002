//! A sandbox's share of the host CPU against the other sandboxes.
//!
//! Every sandbox has its own cgroup under `kiln/` (`cgroupsPath` `/kiln/<container id>`), and
//! the kernel divides the CPU among sibling cgroups by weight when they all want it. A warm
//! pool's sandbox serves nobody yet, so its boot should not slow the sandboxes in use (on a
//! small host a pool refilling after a burst otherwise takes half the cores from the commands
//! the burst's callers run). It starts with [`BACKGROUND_SHARES`] — in the bundle, so the
//! runtime sets it before the sandbox's first instruction — and gets the default weight back
//! when a create claims it or waits for its boot ([`foreground`]). A low weight only matters under contention: an
//! otherwise idle host boots the pool at full speed, and a weight above the minimum means a
//! busy host still lets it boot.

/// `cpu.shares` (cgroup v1) of a sandbox that serves nobody yet: a tenth of the default 1024.
/// runsc gives cgroup v2 the matching `cpu.weight`.
pub const BACKGROUND_SHARES: u64 = 102;
/// cgroup v1's default `cpu.shares`.
const DEFAULT_SHARES: u64 = 1024;
/// cgroup v2's default `cpu.weight`.
const DEFAULT_WEIGHT: u64 = 100;

/// Gives container `cid`'s cgroup the default CPU weight (v1, v2, or v2 at
/// `/sys/fs/cgroup/unified` on hybrid hosts; the first that exists). A host without a CPU
/// controller for the sandbox's cgroup is left as it is.
pub fn foreground(cid: &str) {
    let tries = [
        (
            format!("/sys/fs/cgroup/cpu/kiln/{cid}/cpu.shares"),
            DEFAULT_SHARES,
        ),
        (
            format!("/sys/fs/cgroup/kiln/{cid}/cpu.weight"),
            DEFAULT_WEIGHT,
        ),
        (
            format!("/sys/fs/cgroup/unified/kiln/{cid}/cpu.weight"),
            DEFAULT_WEIGHT,
        ),
    ];
    for (path, value) in tries {
        match std::fs::write(&path, value.to_string()) {
            Ok(()) => return,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => {
                tracing::warn!(file = %path, error = %e, "could not give a claimed sandbox its CPU share");
                return;
            }
        }
    }
}

/// Removes a background share from an OCI spec (`linux.resources.cpu.shares`): a container the
/// runtime restores from the bundle (resume, the next generation) serves its requests again.
pub fn clear_background(spec: &mut serde_json::Value) -> bool {
    spec.pointer_mut("/linux/resources/cpu")
        .and_then(|c| c.as_object_mut())
        .is_some_and(|c| c.remove("shares").is_some())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clearing_removes_only_the_share() {
        let mut v = serde_json::json!({"linux": {"resources": {"cpu": {"shares": 102, "quota": 200000, "period": 100000}}}});
        assert!(clear_background(&mut v));
        assert_eq!(
            v["linux"]["resources"]["cpu"],
            serde_json::json!({"quota": 200000, "period": 100000})
        );
        assert!(!clear_background(&mut v));
        assert!(!clear_background(&mut serde_json::json!({"linux": {}})));
    }
}
