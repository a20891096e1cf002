//! The server's host-pressure relief (`SIGURG` to PID 1): the sandbox's host side (the
//! sentry's tasks and the platform's stub processes, which the sandbox's own accounting does
//! not see) is climbing towards its host limits, as a fork bomb's churn drives it (see the
//! server's `driver/gvisor/pressure.rs`). The command with the most processes is killed, all
//! of it, and the console says so.
//!
//! The kill is by process group first: a command runs in its own session, so one `kill(-pgid)`
//! takes its whole tree at once, atomically in the kernel, where killing pid by pid under a fork
//! bomb cannot keep up (each kill is a system call the starved agent waits its turn for, and the
//! survivors refill the cgroup in between). Pids left over (processes that made their own group,
//! or joined the cgroup through sudo) are then killed one by one, again by group first.
//!
//! `SIGURG` is ignored by default, so an agent without this handler (an older template) is not
//! harmed by the signal.

use std::path::{Path, PathBuf};

use crate::limits::members;

/// The signal the server sends.
pub const SIGNAL: i32 = libc::SIGURG;

/// A command with fewer processes is not what drives the host side up (a memory hog is the
/// OOM watcher's): relief leaves it alone.
const MIN_PROCESSES: u64 = 8;

const PIDS_ROOT: &str = "/sys/fs/cgroup/pids";

/// Handles [`SIGNAL`] (PID 1). Never returns.
pub async fn watch() {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut s) = signal(SignalKind::from_raw(SIGNAL)) else {
        tracing::warn!("no handler for the host-pressure relief signal");
        return std::future::pending().await;
    };
    while s.recv().await.is_some() {
        let _ = tokio::task::spawn_blocking(relieve).await;
    }
    std::future::pending().await
}

/// Kills the command with the most processes; returns its cgroup's name and size.
pub fn relieve() -> Option<(String, u64)> {
    let (dir, n) = largest(Path::new(PIDS_ROOT))?;
    kill_tree(&dir);
    let name = dir.file_name()?.to_string_lossy().into_owned();
    eprintln!("kiln-agent: Host limit near: killed command {name} ({n} processes)");
    Some((name, n))
}

/// The command cgroup under `root` with the most processes (by `pids.current`: one small read
/// per command).
fn largest(root: &Path) -> Option<(PathBuf, u64)> {
    std::fs::read_dir(root)
        .ok()?
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("kiln-cmd-"))
        .filter_map(|e| {
            let n = std::fs::read_to_string(e.path().join("pids.current")).ok()?;
            Some((e.path(), n.trim().parse::<u64>().ok()?))
        })
        .filter(|(_, n)| *n >= MIN_PROCESSES)
        .max_by_key(|(_, n)| *n)
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
    fn largest_picks_the_biggest_command() {
        let d = tempfile::tempdir().unwrap();
        let set = |name: &str, n: &str| {
            std::fs::create_dir_all(d.path().join(name)).unwrap();
            std::fs::write(d.path().join(name).join("pids.current"), n).unwrap();
        };
        // A lone small command (an `echo` after a bomb was killed) is left alone.
        set("kiln-cmd-1", "3");
        assert!(largest(d.path()).is_none());
        for (name, n) in [
            ("kiln-cmd-2", "170"),
            ("kiln-cmd-4", "12"),
            ("other", "900"),
        ] {
            set(name, n);
        }
        std::fs::create_dir(d.path().join("kiln-cmd-3")).unwrap();
        let (dir, n) = largest(d.path()).unwrap();
        assert_eq!(
            (dir.file_name().unwrap().to_str().unwrap(), n),
            ("kiln-cmd-2", 170)
        );
    }

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
