//! Finding, killing and reaping a sandbox's runsc processes on the host.
//!
//! The server is a child subreaper (see [`super::GvisorDriver::new`]), so the `runsc-sandbox`
//! and `runsc-gofer` processes that `runsc run --detach` leaves behind become its children:
//! stop kills and reaps them itself instead of waiting for the host's init.

use std::path::Path;
use std::time::Duration;

/// How long stop waits for a killed sandbox's processes to exit.
const REAP_TIMEOUT: Duration = Duration::from_secs(3);

fn kill_pids(pids: &[libc::pid_t]) {
    for &pid in pids {
        // SAFETY: kill takes plain integers; pid is a positive process id read from /proc.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
}

/// Reaps whichever of `pids` have exited; true when none of them is left to wait for (all
/// reaped, or not our children, in which case `runsc delete` waits for them).
fn reap_some(pids: &[libc::pid_t]) -> bool {
    let mut done = true;
    for &pid in pids {
        let mut status = 0;
        // SAFETY: waitpid on a specific pid with WNOHANG; status is a valid out pointer.
        let rc = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if rc == 0 {
            done = false;
        }
    }
    done
}

/// Reaps exited runsc sandbox/gofer processes this process adopted (as child subreaper) whose
/// exit nobody waited for yet, e.g. of a sandbox that died on its own. Those processes run
/// `/proc/self/exe` of runsc, so their command name is `exe`; processes this server spawns
/// itself (`runsc …`) are left to their owners.
pub fn reap_adopted_zombies() {
    // SAFETY: getpid has no preconditions.
    let me = unsafe { libc::getpid() };
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return;
    };
    for e in rd.flatten() {
        let Some(pid) = e
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<libc::pid_t>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let comm = &stat[open + 1..close];
        let mut rest = stat[close + 1..].split_whitespace();
        let (state, ppid) = (rest.next(), rest.next().and_then(|p| p.parse().ok()));
        if comm == "exe" && state == Some("Z") && ppid == Some(me) {
            let mut status = 0;
            // SAFETY: waitpid on a specific exited child with WNOHANG; status is valid.
            unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        }
    }
}

/// A process as it was seen: its id and start time (a later process reusing the id has
/// another start time).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Process {
    pid: libc::pid_t,
    started: u64,
}

impl Process {
    pub fn pid(&self) -> libc::pid_t {
        self.pid
    }
}

/// Start time of process `pid` (clock ticks after boot), None when it is gone.
fn start_time(pid: libc::pid_t) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Field 22; the fields after the command name start at field 3.
    stat[stat.rfind(')')? + 1..]
        .split_whitespace()
        .nth(19)?
        .parse()
        .ok()
}

/// `pids` as processes (those still there).
pub fn identify(pids: &[libc::pid_t]) -> Vec<Process> {
    pids.iter()
        .filter_map(|&pid| {
            Some(Process {
                pid,
                started: start_time(pid)?,
            })
        })
        .collect()
}

/// The ids of `procs` that are still the same processes.
pub fn still_running(procs: &[Process]) -> Vec<libc::pid_t> {
    procs
        .iter()
        .filter(|p| start_time(p.pid) == Some(p.started))
        .map(|p| p.pid)
        .collect()
}

/// One runsc process under a server's state root.
struct RunscProcess {
    pid: libc::pid_t,
    /// Its command line; the first is `runsc-sandbox` or `runsc-gofer`.
    args: Vec<String>,
}

/// The `runsc-sandbox` and `runsc-gofer` processes whose arguments name runsc state root
/// `root` (`--root=…`, which runsc passes on to its sandbox and gofer processes); one pass
/// over /proc. Another kiln server on the host (a second node, a bench's server) has a root
/// of its own, and may run a sandbox of the same id: a sandbox moved between two nodes of one
/// host keeps its id and container id.
fn runsc_processes(root: &Path) -> Vec<RunscProcess> {
    let root_arg = format!("--root={}", root.to_string_lossy());
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in rd.flatten() {
        let Some(pid) = e
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<libc::pid_t>().ok())
        else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        if !cmdline.starts_with(b"runsc-sandbox\0") && !cmdline.starts_with(b"runsc-gofer\0") {
            continue;
        }
        let args: Vec<String> = cmdline
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        if args.contains(&root_arg) {
            out.push(RunscProcess { pid, args });
        }
    }
    out
}

/// Whether process `pid` is a zombie.
fn zombie(pid: libc::pid_t) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rfind(')')
            .and_then(|i| stat[i + 1..].split_whitespace().next())
            == Some("Z")
    })
}

/// The sandbox's own host processes (`runsc-sandbox`, `runsc-gofer`) under runsc state root
/// `root`: the sandbox's command line names the container id, the gofer's names the bundle
/// under `sandbox_dir` (the gofers of every generation of the sandbox: None matches by
/// container id only).
pub fn sandbox_processes(id: &str, sandbox_dir: Option<&Path>, root: &Path) -> Vec<libc::pid_t> {
    let dir = sandbox_dir.map(|d| d.to_string_lossy().into_owned());
    runsc_processes(root)
        .into_iter()
        .filter(|p| {
            p.args[1..]
                .iter()
                .any(|a| a == id || dir.as_deref().is_some_and(|d| a.contains(d)))
        })
        .map(|p| p.pid)
        .collect()
}

/// Ids of the sandboxes that have a live `runsc-sandbox` process under runsc state root
/// `root` (its `--id` or trailing container id argument); one pass over /proc.
pub fn live_sandbox_ids(root: &Path) -> std::collections::HashSet<String> {
    let mut out = std::collections::HashSet::new();
    for p in runsc_processes(root) {
        if p.args[0] != "runsc-sandbox" || zombie(p.pid) {
            continue;
        }
        // Every argument that could be the id: the check against the list of running ids
        // happens in the caller.
        for a in p.args.into_iter().skip(1) {
            match a.split_once('=') {
                Some((_, v)) if a.starts_with('-') => out.insert(v.to_string()),
                _ => out.insert(a),
            };
        }
    }
    out
}

/// Kills `pids` and reaps them, waiting at most [`REAP_TIMEOUT`].
pub async fn kill_and_reap(pids: &[libc::pid_t]) {
    kill_pids(pids);
    let deadline = tokio::time::Instant::now() + REAP_TIMEOUT;
    while !reap_some(pids) && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    reap_adopted_zombies();
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::CommandExt;

    /// A process that looks like a `runsc-sandbox` of container `cid` under `root`, once its
    /// command line shows it (the spawn may return before /proc has the new one).
    fn fake_sandbox(root: &str, cid: &str) -> std::process::Child {
        let child = std::process::Command::new("/bin/sh")
            .arg0("runsc-sandbox")
            .args(["-c", "sleep 30; :", &format!("--root={root}"), cid])
            .spawn()
            .unwrap();
        let cmdline = format!("/proc/{}/cmdline", child.id());
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while !std::fs::read(&cmdline).is_ok_and(|c| c.starts_with(b"runsc-sandbox\0")) {
            assert!(
                std::time::Instant::now() < deadline,
                "the fake sandbox never started"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        child
    }

    #[test]
    fn only_processes_of_this_runsc_root_are_a_sandbox_s() {
        let cid = format!("g2-reaptest{}", std::process::id());
        let (mut mine, mut theirs) = (
            fake_sandbox("/s/a/runsc", &cid),
            fake_sandbox("/s/b/runsc", &cid),
        );
        let (a, b) = (Path::new("/s/a/runsc"), Path::new("/s/b/runsc"));
        let found = sandbox_processes(&cid, None, a);
        assert_eq!(found, vec![mine.id() as libc::pid_t]);
        assert_eq!(
            sandbox_processes(&cid, None, b),
            vec![theirs.id() as libc::pid_t]
        );
        assert!(sandbox_processes(&cid, None, Path::new("/s/c/runsc")).is_empty());
        assert!(live_sandbox_ids(a).contains(&cid));
        assert!(!live_sandbox_ids(Path::new("/s/c/runsc")).contains(&cid));
        for c in [&mut mine, &mut theirs] {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
