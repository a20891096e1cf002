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
//! Before the kill every big command is frozen (`pids.max` 1): one write each, so the churn
//! stops even if the kill itself is slow. The signal is taken by a thread of its own parked in
//! `sigwaitinfo` (see [`run`]). `SIGURG` is ignored by default, so an agent without this handler
//! (an older template) is not harmed by the signal.

use std::path::{Path, PathBuf};

use crate::cmd_cgroups::{self, kill_tree, PIDS_ROOT};

/// The signal the server sends.
pub const SIGNAL: i32 = libc::SIGURG;

/// A command with fewer processes is not what drives the host side up (a memory hog is the
/// OOM watcher's): relief leaves it alone.
const MIN_PROCESSES: u64 = 8;

/// Blocks [`SIGNAL`] in the calling thread and the threads it starts, so that only
/// [`run`]'s `sigwaitinfo` takes it. Call from PID 1's main thread before any thread starts.
pub fn block_signal() {
    // SAFETY: a zeroed sigset_t is valid storage for sigemptyset; the pointers are to locals.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, SIGNAL);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}

/// Takes [`SIGNAL`] (PID 1, a thread of its own; never returns). A thread parked in
/// `sigwaitinfo` runs as soon as the signal comes, with nothing in between (no async runtime
/// to wake, no blocking pool to queue on): under a fork bomb every step is a turn the starved
/// agent waits for.
pub fn run() {
    // SAFETY: as in block_signal.
    let set = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, SIGNAL);
        set
    };
    loop {
        // SAFETY: waits for a signal of a valid set; no siginfo wanted.
        let sig = unsafe { libc::sigwaitinfo(&set, std::ptr::null_mut()) };
        if sig == SIGNAL {
            relieve();
        }
    }
}

/// Kills the command with the most processes; returns its cgroup's name and size. Every big
/// command is frozen first (`pids.max` 1: one write each, and the churn stops), the others
/// get their cap back after the kill.
pub fn relieve() -> Option<(String, u64)> {
    let big = sizes(Path::new(PIDS_ROOT));
    for (dir, _) in &big {
        cmd_cgroups::set_max(dir, 1);
    }
    let (dir, n) = big.iter().max_by_key(|(_, n)| *n)?.clone();
    kill_tree(&dir);
    if let Some(max) = crate::limits::command_pids_max() {
        for (other, _) in big.iter().filter(|(d, _)| *d != dir) {
            cmd_cgroups::set_max(other, max);
        }
    }
    let name = dir.file_name()?.to_string_lossy().into_owned();
    crate::kills::record(
        crate::kills::Reason::Host,
        format!("Host limit near: killed command {name} ({n} processes)"),
    );
    Some((name, n))
}

/// The command cgroups under `root` with [`MIN_PROCESSES`] or more, and their sizes (by
/// `pids.current`: one small read per command).
fn sizes(root: &Path) -> Vec<(PathBuf, u64)> {
    cmd_cgroups::commands(root)
        .into_iter()
        .filter_map(|d| {
            let n = std::fs::read_to_string(d.join("pids.current")).ok()?;
            Some((d, n.trim().parse::<u64>().ok()?))
        })
        .filter(|(_, n)| *n >= MIN_PROCESSES)
        .collect()
}

/// The command cgroup under `root` with the most processes.
#[cfg(test)]
fn largest(root: &Path) -> Option<(PathBuf, u64)> {
    sizes(root).into_iter().max_by_key(|(_, n)| *n)
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
}
