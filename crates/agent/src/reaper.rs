//! Child reaping. The agent owns `waitpid(-1)`: children it spawned are registered here and get
//! their status delivered; everything else (orphans re-parented to us as PID 1) is reaped and
//! dropped. Never mix with `tokio::process` in this process.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use tokio::sync::oneshot;

/// How a child ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    Code(i32),
    Signal { sig: i32, core: bool },
}

type Table = HashMap<u32, oneshot::Sender<Exit>>;

fn table() -> &'static Mutex<Table> {
    static T: OnceLock<Mutex<Table>> = OnceLock::new();
    T.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Spawn with `spawn` while holding the reaper lock, and register the child's pid, so its exit
/// cannot be reaped before it is registered.
pub fn spawn_registered<T>(
    spawn: impl FnOnce() -> std::io::Result<(u32, T)>,
) -> std::io::Result<(u32, T, oneshot::Receiver<Exit>)> {
    let mut t = table().lock().unwrap_or_else(|p| p.into_inner());
    let (pid, v) = spawn()?;
    let (tx, rx) = oneshot::channel();
    t.insert(pid, tx);
    Ok((pid, v, rx))
}

/// Reap every exited child (non-blocking).
pub fn reap_all() {
    let mut t = table().lock().unwrap_or_else(|p| p.into_inner());
    loop {
        let mut status = 0;
        // SAFETY: waitpid with a valid status pointer; WNOHANG never blocks.
        let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
        if pid <= 0 {
            break;
        }
        let exit = if libc::WIFEXITED(status) {
            Exit::Code(libc::WEXITSTATUS(status))
        } else if libc::WIFSIGNALED(status) {
            Exit::Signal {
                sig: libc::WTERMSIG(status),
                core: libc::WCOREDUMP(status),
            }
        } else {
            continue;
        };
        if let Some(tx) = t.remove(&(pid as u32)) {
            let _ = tx.send(exit);
        } else {
            tracing::debug!(pid, ?exit, "reaped orphan");
        }
    }
}

/// Run the reaper on SIGCHLD forever (spawn as a task).
pub async fn run() {
    let mut sig = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::child()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!("cannot listen for SIGCHLD, children will not be reaped: {e}");
            return;
        }
    };
    loop {
        reap_all();
        if sig.recv().await.is_none() {
            return;
        }
    }
}

/// Go-style status text (`exit status 1`, `signal: killed`) as envd reports it.
pub fn status_text(e: Exit) -> String {
    match e {
        Exit::Code(c) => format!("exit status {c}"),
        Exit::Signal { sig, core } => {
            let name = match sig {
                1 => "hangup".to_string(),
                2 => "interrupt".to_string(),
                3 => "quit".to_string(),
                4 => "illegal instruction".to_string(),
                6 => "aborted".to_string(),
                7 => "bus error".to_string(),
                8 => "floating point exception".to_string(),
                9 => "killed".to_string(),
                10 => "user defined signal 1".to_string(),
                11 => "segmentation fault".to_string(),
                12 => "user defined signal 2".to_string(),
                13 => "broken pipe".to_string(),
                14 => "alarm clock".to_string(),
                15 => "terminated".to_string(),
                n => format!("signal {n}"),
            };
            if core {
                format!("signal: {name} (core dumped)")
            } else {
                format!("signal: {name}")
            }
        }
    }
}
