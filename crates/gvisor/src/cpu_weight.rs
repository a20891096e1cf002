//! A sandbox's CPU weight among its siblings (`kiln/<container id>` in the cpu hierarchy):
//! a warm pool's sandbox boots and waits at the smallest weight, so when the host's cores are
//! busy it gets only what the sandboxes at work leave, and goes back to the default weight
//! before its first request. Its CPU limit (the quota of its size) is not touched.

use std::collections::HashSet;
use std::sync::Mutex;

use crate::host_stats::cgroup_file;
use crate::oci::BACKGROUND_SHARES;

/// The driver's side of the weights: a sandbox told to leave the background before its start
/// made its cgroup (a create began to wait for its boot meanwhile) gets the default weight
/// as soon as its start made it.
#[derive(Default)]
pub struct Weights {
    due: Mutex<HashSet<String>>,
}

impl Weights {
    fn due(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.due.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sandbox `id` (container `cid`) runs in the background or not from now on.
    pub fn set(&self, id: &str, cid: &str, background: bool) {
        let mut due = self.due();
        if set_background(cid, background) || background {
            due.remove(id);
        } else {
            due.insert(id.to_string());
        }
    }

    /// Sandbox `id`'s start made its cgroup (container `cid`).
    pub fn started(&self, id: &str, cid: &str) {
        let mut due = self.due();
        if due.remove(id) {
            set_background(cid, false);
        }
    }

    /// Sandbox `id` stopped.
    pub fn forget(&self, id: &str) {
        self.due().remove(id);
    }
}

/// cgroup v1 `cpu.shares`: the smallest the kernel takes (a background sandbox's from its
/// start, in its OCI spec), and the default.
const SHARES: (u64, u64) = (BACKGROUND_SHARES, 1024);
/// cgroup v2 `cpu.weight`: the smallest, and the default.
const WEIGHT: (u64, u64) = (1, 100);

/// Sets container `cid`'s weight to the smallest (`background`) or the default; false when
/// it has no cpu cgroup (not started yet, gone, or cgroups ignored).
pub fn set_background(cid: &str, background: bool) -> bool {
    let pick = |(low, normal): (u64, u64)| if background { low } else { normal };
    let [v1, v2, hybrid] = cgroup_file(cid, "cpu", "cpu.shares", "cpu.weight");
    let tries = [
        (v1, pick(SHARES)),
        (v2, pick(WEIGHT)),
        (hybrid, pick(WEIGHT)),
    ];
    for (path, value) in tries {
        match std::fs::write(&path, value.to_string()) {
            Ok(()) => return true,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => {
                tracing::debug!(cgroup = %path, error = %e, "setting a sandbox's CPU weight");
                return true;
            }
        }
    }
    false
}

/// Container `cid`'s weight as (value, default), or None without a cpu cgroup.
#[cfg(test)]
fn weight(cid: &str) -> Option<(u64, u64)> {
    let [v1, v2, hybrid] = cgroup_file(cid, "cpu", "cpu.shares", "cpu.weight");
    let read = |p: &str| std::fs::read_to_string(p).ok()?.trim().parse::<u64>().ok();
    read(&v1)
        .map(|v| (v, SHARES.1))
        .or_else(|| read(&v2).map(|v| (v, WEIGHT.1)))
        .or_else(|| read(&hybrid).map(|v| (v, WEIGHT.1)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Makes container `cid`'s cpu cgroup (v1, else v2) and returns its directory.
    fn make_cgroup(cid: &str) -> String {
        let [v1, v2, hybrid] = cgroup_file(cid, "cpu", "cpu.shares", "cpu.weight");
        [v1, v2, hybrid]
            .into_iter()
            .map(|f| f.rsplit_once('/').unwrap().0.to_string())
            .find(|d| std::fs::create_dir_all(d).is_ok())
            .expect("this test needs a cpu cgroup hierarchy it may write (root)")
    }

    #[test]
    fn a_background_sandbox_gets_the_smallest_weight_and_back_the_default() {
        let cid = format!("kiln-weight-test-{}", std::process::id());
        let dir = make_cgroup(&cid);
        let before = weight(&cid);
        set_background(&cid, true);
        let low = weight(&cid);
        set_background(&cid, false);
        let back = weight(&cid);
        let _ = std::fs::remove_dir(&dir);
        let (_, normal) = before.expect("the new cgroup's weight");
        assert_eq!(
            before.map(|w| w.0),
            Some(normal),
            "a new cgroup has the default"
        );
        let smallest = if normal == SHARES.1 {
            SHARES.0
        } else {
            WEIGHT.0
        };
        assert_eq!(low, Some((smallest, normal)));
        assert_eq!(back, Some((normal, normal)));
        // A container without a cgroup is left alone (no panic, nothing created).
        set_background("kiln-weight-test-absent", true);
        assert_eq!(weight("kiln-weight-test-absent"), None);
    }

    #[test]
    fn a_sandbox_told_to_leave_the_background_before_its_start_leaves_it_at_its_start() {
        let cid = format!("kiln-weight-due-{}", std::process::id());
        let w = Weights::default();
        // Told before its cgroup exists: nothing to write yet.
        w.set("x", &cid, false);
        let dir = make_cgroup(&cid);
        // Its start makes the cgroup at the spec's background weight, then applies the word.
        set_background(&cid, true);
        let at_start = weight(&cid);
        w.started("x", &cid);
        let after = weight(&cid);
        // Said once: a later start (a restore's new container) is left as it is.
        set_background(&cid, true);
        w.started("x", &cid);
        let again = weight(&cid);
        // Told while it runs: written at once.
        w.set("x", &cid, false);
        let told = weight(&cid);
        let _ = std::fs::remove_dir(&dir);
        let normal = after.expect("a weight").1;
        assert!(at_start.unwrap().0 < normal);
        assert_eq!(after, Some((normal, normal)));
        assert!(again.unwrap().0 < normal);
        assert_eq!(told, Some((normal, normal)));
        assert!(w.due().is_empty());
    }
}
