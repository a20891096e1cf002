//! A running sandbox's resource use read from its host cgroup (`kiln/<container id>` in each
//! hierarchy; cgroup v1, v2, or v2 at `/sys/fs/cgroup/unified` on hybrid hosts), so the
//! metrics sampler costs a few file reads per sandbox instead of a `runsc events --stats`
//! process (at hundreds of sandboxes, hundreds of runsc processes a second).
//!
//! What the numbers are: CPU is the cgroup's usage (the sentry, gofer and platform stubs; the
//! number `runsc events` reports for a one-container sandbox, which it takes from the same
//! file); memory is the host memory charged to the sandbox (its guest memory, the runtime's
//! own and the page cache of its files); pids are host tasks (the sentry's threads and stubs,
//! not guest processes). The guest's own view of its memory is the sentry's and comes through
//! the agent (`/metrics`), see the sampler.

use crate::driver::SandboxStats;

/// The file `v1` of controller `ctrl` (cgroup v1) or `v2` (unified) of container `cid`.
pub(crate) fn cgroup_file(cid: &str, ctrl: &str, v1: &str, v2: &str) -> [String; 3] {
    [
        format!("/sys/fs/cgroup/{ctrl}/kiln/{cid}/{v1}"),
        format!("/sys/fs/cgroup/kiln/{cid}/{v2}"),
        format!("/sys/fs/cgroup/unified/kiln/{cid}/{v2}"),
    ]
}

fn read_u64(path: &str) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// The value of key `key` in a flat-keyed cgroup file (`cpu.stat`, `memory.stat`).
fn keyed(path: &str, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

/// CPU time used by container `cid`'s cgroup, nanoseconds.
pub fn cpu_ns(cid: &str) -> Option<u64> {
    let [v1, v2, hybrid] = cgroup_file(cid, "cpuacct", "cpuacct.usage", "cpu.stat");
    read_u64(&v1).or_else(|| {
        [v2, hybrid]
            .iter()
            .find_map(|p| keyed(p, "usage_usec"))
            .map(|us| us.saturating_mul(1000))
    })
}

/// Host memory charged to container `cid`'s cgroup, bytes.
pub fn memory_bytes(cid: &str) -> Option<u64> {
    cgroup_file(cid, "memory", "memory.usage_in_bytes", "memory.current")
        .iter()
        .find_map(|p| read_u64(p))
}

/// Host tasks in container `cid`'s cgroup.
pub fn tasks(cid: &str) -> Option<u64> {
    cgroup_file(cid, "pids", "pids.current", "pids.current")
        .iter()
        .find_map(|p| read_u64(p))
}

/// The stats of container `cid` from its host cgroup, or None when it has none (the server
/// runs with cgroups ignored, or the sandbox is gone).
pub fn read(cid: &str) -> Option<SandboxStats> {
    let cpu_ns = cpu_ns(cid)?;
    Some(SandboxStats {
        cpu_ns,
        mem_used_bytes: memory_bytes(cid)?,
        // The host cgroup has headroom above the sandbox's size (oci::host_memory_limit).
        mem_limit_bytes: super::oci::cgroup_memory_limit(cid)
            .map(super::oci::sandbox_memory)
            .unwrap_or(0),
        mem_cache_bytes: super::oci::cgroup_file_cache(cid).unwrap_or(0),
        pids: tasks(cid).unwrap_or(0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keyed_files_and_missing_cgroups() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("cpu.stat");
        std::fs::write(&p, "usage_usec 1234\nuser_usec 1000\nsystem_usec 234\n").unwrap();
        let p = p.to_str().unwrap();
        assert_eq!(keyed(p, "usage_usec"), Some(1234));
        assert_eq!(keyed(p, "user_usec"), Some(1000));
        assert_eq!(keyed(p, "nr_periods"), None);
        assert_eq!(read("no-such-container-here"), None);
    }
}
