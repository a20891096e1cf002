//! The agent's record of the processes it killed to keep the sandbox alive (the OOM pass,
//! the fork-bomb killer, the host-pressure relief) and of the sudo requests its broker
//! refused: each is a console line and an entry of a short log the agent's `/metrics` answer
//! carries (`kiln_kills`), from which the server's metrics sampler makes `oom`, `pids-limit`,
//! `host-limit` and `sudo-refused` events.
//!
//! The log keeps the newest [`KEEP`] kills. Each has the wall-clock time it happened: the
//! server reports the kills newer than what it reported before (or than the sandbox's start,
//! so a fork or a sandbox restored from a snapshot does not report its source's kills).

use std::collections::VecDeque;
use std::sync::Mutex;

pub use kiln_proto::envd::KillRecord;

/// Kills kept for the server to collect (it samples every few seconds).
pub const KEEP: usize = 64;

/// Why a process or command was killed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// The sandbox used more memory than its size.
    Memory,
    /// A command forked past its process cap (a fork bomb).
    Pids,
    /// The server saw the sandbox's host side near its limits (`SIGURG`).
    Host,
    /// Not a kill: the sudo broker refused a request (the sandbox's sudoers does not allow it).
    SudoRefused,
}

impl Reason {
    /// The name on the wire ([`KillRecord::kind`]).
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Memory => "oom",
            Reason::Pids => "pids",
            Reason::Host => "host",
            Reason::SudoRefused => "sudo",
        }
    }
}

static LOG: Mutex<VecDeque<KillRecord>> = Mutex::new(VecDeque::new());

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// Kills the command whose cgroup is `dir`, all of it ([`crate::cmd_cgroups::kill_tree`]), and
/// records it as "`title`: killed command <name> (`detail`)".
pub fn kill_command(reason: Reason, dir: &std::path::Path, title: &str, detail: String) {
    crate::cmd_cgroups::kill_tree(dir);
    let name = dir.file_name().unwrap_or_default().to_string_lossy();
    record(reason, format!("{title}: killed command {name} ({detail})"));
}

/// Records a kill: `what` says what was killed and why, in the kernel's style
/// ("Out of memory: Killed process 12 (python3) …"). Also written to the console.
pub fn record(reason: Reason, what: String) {
    eprintln!("kiln-agent: {what}");
    let mut log = LOG.lock().unwrap_or_else(|p| p.into_inner());
    if log.len() == KEEP {
        log.pop_front();
    }
    log.push_back(KillRecord {
        ts_ms: now_ms(),
        kind: reason.as_str().to_string(),
        detail: what,
    });
}

/// The kills kept, oldest first.
pub fn recent() -> Vec<KillRecord> {
    LOG.lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .cloned()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kills_are_kept_newest_last_and_bounded() {
        let before = recent().len();
        record(
            Reason::Memory,
            "Out of memory: Killed process 7 (hog)".into(),
        );
        let log = recent();
        assert_eq!(log.len(), before + 1);
        let last = log.last().unwrap();
        assert_eq!(last.kind, "oom");
        assert_eq!(last.detail, "Out of memory: Killed process 7 (hog)");
        assert!(last.ts_ms > 1_600_000_000_000);
        for i in 0..KEEP + 3 {
            record(
                Reason::Pids,
                format!("Fork bomb: killed command kiln-cmd-{i}"),
            );
        }
        let log = recent();
        assert_eq!(log.len(), KEEP);
        assert_eq!(
            log.last().unwrap().detail,
            format!("Fork bomb: killed command kiln-cmd-{}", KEEP + 2)
        );
        assert!(log.windows(2).all(|w| w[0].ts_ms <= w[1].ts_ms));
        // A command killed whole (an empty cgroup here: nothing to signal) is named by its dir.
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("kiln-cmd-9");
        std::fs::create_dir(&dir).unwrap();
        kill_command(Reason::Pids, &dir, "Fork loop", "7 processes".into());
        let last = recent().pop().unwrap();
        assert_eq!(last.kind, "pids");
        assert_eq!(
            last.detail,
            "Fork loop: killed command kiln-cmd-9 (7 processes)"
        );
    }
}
