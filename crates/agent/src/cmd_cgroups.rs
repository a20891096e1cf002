//! The per-command pids cgroups (`/sys/fs/cgroup/pids/kiln-cmd-N`, made by
//! [`crate::limits::CmdCgroup`]): listing them, their process counts and members, their caps,
//! and killing one whole. The OOM pass, the fork-bomb killer and the host-pressure relief act
//! through these.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// Where the pids controller is mounted inside the sandbox.
pub const PIDS_ROOT: &str = "/sys/fs/cgroup/pids";
/// The name prefix of a command's cgroup.
pub const PREFIX: &str = "kiln-cmd-";

/// `pids.current` of the cgroup `dir`.
pub fn pids_current(dir: &Path) -> Option<u64> {
    std::fs::read_to_string(dir.join("pids.current"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Sets a command cgroup's `pids.max` (1: frozen, no fork succeeds).
pub fn set_max(dir: &Path, max: u64) {
    if let Err(e) = std::fs::write(dir.join("pids.max"), max.to_string()) {
        tracing::warn!("cannot set pids.max of {}: {e}", dir.display());
    }
}

/// Command cgroups under `root`.
pub fn commands(root: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(root)
        .map(|rd| {
            rd.flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with(PREFIX))
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default()
}

/// The command with the most processes among those with `min` or more, and its count.
pub fn largest_from(min: u64) -> Option<(PathBuf, u64)> {
    commands(Path::new(PIDS_ROOT))
        .into_iter()
        .filter_map(|d| Some((pids_current(&d)?, d)))
        .filter(|(n, _)| *n >= min)
        .max_by_key(|(n, _)| *n)
        .map(|(n, d)| (d, n))
}

/// Pids listed in a cgroup directory.
pub fn members(dir: &Path) -> Vec<i32> {
    std::fs::read_to_string(dir.join("cgroup.procs"))
        .map(|s| s.lines().filter_map(|l| l.trim().parse().ok()).collect())
        .unwrap_or_default()
}

/// SIGKILLs every process of a command's cgroup (a fork bomb's children included), retrying
/// while new ones appear.
pub fn kill_cgroup(dir: &Path) {
    for _ in 0..50 {
        let pids = members(dir);
        if pids.is_empty() {
            return;
        }
        for p in pids {
            // SAFETY: kill has no memory-safety preconditions.
            unsafe { libc::kill(p, libc::SIGKILL) };
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Removes empty command cgroups (those whose commands have all ended).
pub fn sweep() {
    let Ok(rd) = std::fs::read_dir(PIDS_ROOT) else {
        return;
    };
    for e in rd.flatten() {
        let name = e.file_name();
        if name.to_string_lossy().starts_with(PREFIX) && members(&e.path()).is_empty() {
            let _ = std::fs::remove_dir(e.path());
        }
    }
}

/// The `cgroup.procs` file of the command cgroup `pid` is in, if any (a sudo command joins
/// its caller's).
pub fn cgroup_procs_of(pid: i32) -> Option<PathBuf> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    let rel = text.lines().find_map(|l| {
        let mut f = l.splitn(3, ':');
        let (_, ctrl, path) = (f.next()?, f.next()?, f.next()?);
        ctrl.split(',')
            .any(|c| c == "pids")
            .then(|| path.to_string())
    })?;
    let name = rel.trim_start_matches('/');
    if !name.starts_with(PREFIX) || name.contains('/') {
        return None;
    }
    let p = Path::new(PIDS_ROOT).join(name).join("cgroup.procs");
    p.exists().then_some(p)
}

/// The process group of `pid`, if it is one that may be killed whole (not the agent's).
fn group_of(pid: i32) -> Option<i32> {
    // SAFETY: getpgid and getpgrp take plain integers and touch no memory.
    let (pg, own) = unsafe { (libc::getpgid(pid), libc::getpgrp()) };
    (pg > 1 && pg != own).then_some(pg)
}

/// SIGKILLs every process of the cgroup `dir`: the group of its first member at once (for a
/// command, that is all of it), then every group and pid still listed.
pub fn kill_tree(dir: &Path) {
    let kill = |target: i32| {
        // SAFETY: kill takes plain integers; a negative target names a process group.
        unsafe { libc::kill(target, libc::SIGKILL) };
    };
    for round in 0..20 {
        let pids: Vec<i32> = members(dir).into_iter().filter(|&p| p > 1).collect();
        if pids.is_empty() {
            return;
        }
        // One group kill usually empties the cgroup: look again before going pid by pid.
        let take = if round == 0 { 1 } else { pids.len() };
        for &p in &pids[..take] {
            match group_of(p) {
                Some(pg) => kill(-pg),
                None => kill(p),
            }
            if round > 0 {
                kill(p);
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kill_tree_kills_a_process_group_at_once() {
        use std::os::unix::process::CommandExt;
        // A shell in its own group with children that keep replacing themselves.
        let mut child = std::process::Command::new("sh")
            .args([
                "-c",
                "for i in 1 2 3 4; do (while :; do sleep 0.01; done) & done; wait",
            ])
            .process_group(0)
            .spawn()
            .unwrap();
        let pg = child.id() as i32;
        std::thread::sleep(std::time::Duration::from_millis(200));
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("cgroup.procs"), format!("{pg}\n")).unwrap();
        // The fake cgroup keeps listing the leader until it is gone; kill_tree must not spin.
        let t = std::time::Instant::now();
        kill_tree(d.path());
        assert!(t.elapsed() < std::time::Duration::from_secs(5));
        let status = child.wait().unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(libc::SIGKILL));
        // The children die too (reaped by whoever adopted them, give it a moment).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        // SAFETY: kill with signal 0 only checks whether the group still exists.
        while unsafe { libc::kill(-pg, 0) } == 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "the group's children survived"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}
