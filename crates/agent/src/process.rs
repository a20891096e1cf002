//! Process table: spawning commands (pipes or a PTY) as a given user, fanning their output out
//! to attached streams, stdin, signals, resize, and exit status.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use kiln_proto::process::{process_event, ProcessConfig, ProcessInfo};
use tokio::sync::{mpsc, watch};

use crate::cmdfd::CmdFd;
use crate::launch;
use crate::reaper::{self, Exit};
use crate::rpc::RpcError;
use crate::users::User;
use kiln_proto::connect::Code;

/// Output chunk size read from a child.
const CHUNK: usize = 32 * 1024;
/// Events buffered per attached stream before the child's output pump waits for it.
const SUBSCRIBER_QUEUE: usize = 64;

/// Something a process stream receives.
#[derive(Debug, Clone)]
pub enum Event {
    Stdout(Bytes),
    Stderr(Bytes),
    Pty(Bytes),
    End(process_event::EndEvent),
}

/// A running (or just finished) process.
pub struct Proc {
    pub pid: u32,
    pub tag: Option<String>,
    pub config: ProcessConfig,
    stdin: tokio::sync::Mutex<Option<Arc<CmdFd>>>,
    pty: Option<Arc<CmdFd>>,
    subscribers: Mutex<Vec<mpsc::Sender<Event>>>,
    end: watch::Sender<Option<process_event::EndEvent>>,
    /// The command's own pids cgroup (see `limits`), killed whole on SIGKILL.
    cgroup: Option<std::path::PathBuf>,
}

impl Proc {
    /// Attach a new listener. Returns the receiver, or the end event if the process already ended.
    pub fn subscribe(&self) -> Result<mpsc::Receiver<Event>, process_event::EndEvent> {
        let mut subs = self.subscribers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(end) = self.end.borrow().clone() {
            return Err(end);
        }
        let (tx, rx) = mpsc::channel(SUBSCRIBER_QUEUE);
        subs.push(tx);
        Ok(rx)
    }

    pub fn is_pty(&self) -> bool {
        self.pty.is_some()
    }

    pub fn info(&self) -> ProcessInfo {
        ProcessInfo {
            config: Some(self.config.clone()),
            pid: self.pid,
            tag: self.tag.clone(),
        }
    }

    /// Write to stdin (non-PTY) or the terminal (PTY).
    pub async fn write_input(&self, data: &[u8], pty: bool) -> Result<(), RpcError> {
        let fd = if pty {
            self.pty.clone().ok_or_else(|| {
                RpcError::new(
                    Code::FailedPrecondition,
                    format!("process {} has no PTY; send stdin input instead", self.pid),
                )
            })?
        } else if self.pty.is_some() {
            // envd accepts stdin input for PTY processes by writing it to the terminal.
            self.pty.clone().expect("checked")
        } else {
            self.stdin.lock().await.clone().ok_or_else(|| {
                RpcError::new(Code::FailedPrecondition, format!("stdin of process {} is closed or was not enabled (start it with stdin=true)", self.pid))
            })?
        };
        fd.write_all(data)
            .await
            .map_err(|e| RpcError::io(&format!("write input to process {}", self.pid), &e))
    }

    pub async fn close_stdin(&self) -> Result<(), RpcError> {
        if self.pty.is_some() {
            return Err(RpcError::new(
                Code::FailedPrecondition,
                "closing stdin is not supported for PTY processes; send Ctrl+D (0x04) instead",
            ));
        }
        self.stdin.lock().await.take();
        Ok(())
    }

    pub fn resize(&self, cols: u32, rows: u32) -> Result<(), RpcError> {
        let pty = self.pty.as_ref().ok_or_else(|| {
            RpcError::new(
                Code::FailedPrecondition,
                format!("process {} has no PTY to resize", self.pid),
            )
        })?;
        let ws = libc::winsize {
            ws_row: rows as u16,
            ws_col: cols as u16,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        // SAFETY: TIOCSWINSZ on our own PTY master with a valid winsize pointer.
        let r = unsafe { libc::ioctl(pty.raw(), libc::TIOCSWINSZ, &ws) };
        if r < 0 {
            return Err(RpcError::io("resize PTY", &io::Error::last_os_error()));
        }
        Ok(())
    }

    pub fn signal(&self, sig: i32) -> Result<(), RpcError> {
        // SAFETY: kill has no memory-safety preconditions.
        let r = unsafe { libc::kill(self.pid as i32, sig) };
        if sig == libc::SIGKILL {
            if let Some(dir) = self.cgroup.clone() {
                // Everything the command started (a fork bomb's children too) goes with it.
                std::thread::spawn(move || crate::cmd_cgroups::kill_cgroup(&dir));
            }
        }
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ESRCH) {
                return Err(RpcError::not_found(format!(
                    "process {} is not running",
                    self.pid
                )));
            }
            return Err(RpcError::io(&format!("signal process {}", self.pid), &e));
        }
        Ok(())
    }

    async fn broadcast(&self, ev: Event) {
        let subs: Vec<_> = self
            .subscribers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let mut dead = false;
        for s in &subs {
            if s.send(ev.clone()).await.is_err() {
                dead = true;
            }
        }
        if dead {
            self.subscribers
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .retain(|s| !s.is_closed());
        }
    }
}

fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two fds into the array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both fds were just created and are owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// What to start.
pub struct Spawn {
    pub config: ProcessConfig,
    pub tag: Option<String>,
    pub stdin: bool,
    /// `(cols, rows)` for a PTY process.
    pub pty: Option<(u16, u16)>,
    pub user: User,
    pub cwd: String,
    /// Full environment of the child.
    pub env: Vec<(String, String)>,
}

/// All processes started by the agent and still tracked.
#[derive(Default)]
pub struct Table {
    procs: Mutex<HashMap<u32, Arc<Proc>>>,
}

impl Table {
    pub fn list(&self) -> Vec<ProcessInfo> {
        let mut v: Vec<_> = self
            .procs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .map(|p| p.info())
            .collect();
        v.sort_by_key(|p| p.pid);
        v
    }

    pub fn by_pid(&self, pid: u32) -> Option<Arc<Proc>> {
        self.procs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&pid)
            .cloned()
    }

    pub fn by_tag(&self, tag: &str) -> Option<Arc<Proc>> {
        self.procs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .find(|p| p.tag.as_deref() == Some(tag))
            .cloned()
    }

    /// All tracked pids (for shutdown).
    pub fn pids(&self) -> Vec<u32> {
        self.procs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .copied()
            .collect()
    }

    /// Start a process; the returned receiver is attached before any output is read.
    pub fn spawn(
        self: &Arc<Self>,
        s: Spawn,
    ) -> Result<(Arc<Proc>, mpsc::Receiver<Event>), RpcError> {
        let Spawn {
            config,
            tag,
            stdin,
            pty,
            user,
            cwd,
            env,
        } = s;
        if config.cmd.is_empty() {
            return Err(RpcError::invalid("process.cmd is empty"));
        }
        // SAFETY: geteuid has no preconditions.
        let creds = (unsafe { libc::geteuid() } == 0).then(|| launch::Creds {
            uid: user.uid,
            gid: user.gid,
            groups: user.groups.clone(),
        });

        // The parent's ends (kept) and the child's (closed here once it has exec'd).
        let mut stdin_w = None;
        let mut out_r = None;
        let mut err_r = None;
        let mut master = None;
        let child_ends: [OwnedFd; 3] = if let Some((cols, rows)) = pty {
            let ws = nix::pty::Winsize {
                ws_row: rows.max(1),
                ws_col: cols.max(1),
                ws_xpixel: 0,
                ws_ypixel: 0,
            };
            let p = nix::pty::openpty(Some(&ws), None)
                .map_err(|e| RpcError::internal(format!("cannot open a PTY: {e}")))?;
            for fd in [&p.master, &p.slave] {
                // SAFETY: marking our own fd close-on-exec.
                unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
            }
            let dup = |f: &OwnedFd| f.try_clone().map_err(|e| RpcError::io("dup PTY", &e));
            master = Some(p.master);
            [dup(&p.slave)?, dup(&p.slave)?, p.slave]
        } else {
            let stdin_r = if stdin {
                let (r, w) = pipe().map_err(|e| RpcError::io("create stdin pipe", &e))?;
                stdin_w = Some(w);
                r
            } else {
                std::fs::File::open("/dev/null")
                    .map_err(|e| RpcError::io("open /dev/null", &e))?
                    .into()
            };
            let (r, out_w) = pipe().map_err(|e| RpcError::io("create stdout pipe", &e))?;
            out_r = Some(r);
            let (r, err_w) = pipe().map_err(|e| RpcError::io("create stderr pipe", &e))?;
            err_r = Some(r);
            [stdin_r, out_w, err_w]
        };

        let cgroup = crate::limits::CmdCgroup::create();
        // The fork-bomb pass resumes for it.
        crate::watchdog::command_started();
        let (pid, (), exit_rx) = reaper::spawn_registered(|| {
            let pid = launch::launch(&launch::Launch {
                program: &config.cmd,
                args: &config.args,
                env: &env,
                stdio: [0, 1, 2].map(|i| child_ends[i].as_raw_fd()),
                cgroup_procs: cgroup.as_ref().map(|c| c.procs_fd()),
                pty: master.is_some(),
                creds: creds.as_ref(),
                cwd: &cwd,
            })?;
            Ok((pid, ()))
        })
        .map_err(|e| spawn_error(&config.cmd, &cwd, &user.name, &e))?;
        drop(child_ends);
        let cgroup = cgroup.map(|c| c.dir().to_path_buf());

        let register = |fd: OwnedFd| {
            CmdFd::new(fd)
                .map(Arc::new)
                .map_err(|e| RpcError::io("register fd", &e))
        };
        let master = master.map(register).transpose()?;
        let stdin_w = stdin_w.map(register).transpose()?;
        let out_r = out_r.map(register).transpose()?;
        let err_r = err_r.map(register).transpose()?;

        let (end, _) = watch::channel(None);
        let proc_ = Arc::new(Proc {
            pid,
            tag,
            config,
            stdin: tokio::sync::Mutex::new(stdin_w),
            pty: master.clone(),
            subscribers: Mutex::new(Vec::new()),
            end,
            cgroup,
        });
        let rx = proc_
            .subscribe()
            .map_err(|_| RpcError::internal("process ended before it was tracked"))?;
        self.procs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(pid, proc_.clone());

        let (exited_tx, exited_rx) = watch::channel(false);
        let mut pumps = Vec::new();
        if let Some(m) = master {
            pumps.push(tokio::spawn(pump(
                proc_.clone(),
                m,
                Event::Pty as fn(Bytes) -> Event,
                exited_rx.clone(),
            )));
        }
        if let Some(o) = out_r {
            pumps.push(tokio::spawn(pump(
                proc_.clone(),
                o,
                Event::Stdout as fn(Bytes) -> Event,
                exited_rx.clone(),
            )));
        }
        if let Some(e) = err_r {
            pumps.push(tokio::spawn(pump(
                proc_.clone(),
                e,
                Event::Stderr as fn(Bytes) -> Event,
                exited_rx.clone(),
            )));
        }
        let table = self.clone();
        let p2 = proc_.clone();
        tokio::spawn(async move {
            let exit = exit_rx.await.unwrap_or(Exit::Code(-1));
            let _ = exited_tx.send(true);
            for p in pumps {
                let _ = p.await;
            }
            let (exit_code, exited) = match exit {
                Exit::Code(c) => (c, true),
                Exit::Signal { .. } => (-1, false),
            };
            let ev = process_event::EndEvent {
                exit_code,
                exited,
                status: reaper::status_text(exit),
                error: None,
            };
            p2.stdin.lock().await.take();
            p2.broadcast(Event::End(ev.clone())).await;
            {
                let mut subs = p2.subscribers.lock().unwrap_or_else(|p| p.into_inner());
                let _ = p2.end.send(Some(ev));
                subs.clear();
            }
            table
                .procs
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&p2.pid);
            if p2.cgroup.is_some() {
                tokio::task::spawn_blocking(crate::cmd_cgroups::sweep);
            }
            tracing::debug!(pid = p2.pid, "process finished");
        });
        Ok((proc_, rx))
    }
}

fn spawn_error(cmd: &str, cwd: &str, user: &str, e: &io::Error) -> RpcError {
    let code = match e.kind() {
        io::ErrorKind::NotFound | io::ErrorKind::InvalidInput => Code::InvalidArgument,
        io::ErrorKind::PermissionDenied => Code::PermissionDenied,
        _ => Code::Internal,
    };
    RpcError::new(
        code,
        format!("cannot start {cmd:?} as user {user:?} in {cwd:?}: {e}"),
    )
}

/// Read `fd` until EOF (or, once the process exited, until it stays quiet for a moment, so a
/// grandchild holding the pipe open does not keep the command running) and fan out chunks.
/// What a grandchild writes after that is read and dropped (see [`drain`]).
async fn pump(
    p: Arc<Proc>,
    fd: Arc<CmdFd>,
    make: fn(Bytes) -> Event,
    mut exited: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; CHUNK];
    loop {
        let n = if *exited.borrow() {
            match tokio::time::timeout(Duration::from_millis(50), fd.read(&mut buf)).await {
                Ok(r) => r,
                Err(_) => {
                    tokio::spawn(drain(fd));
                    break;
                }
            }
        } else {
            tokio::select! {
                r = fd.read(&mut buf) => r,
                _ = exited.changed() => continue,
            }
        };
        match n {
            Ok(0) => break,
            Ok(n) => p.broadcast(make(Bytes::copy_from_slice(&buf[..n]))).await,
            Err(e) if e.raw_os_error() == Some(libc::EIO) => break, // PTY slave closed
            Err(e) => {
                tracing::debug!(pid = p.pid, "output read failed: {e}");
                break;
            }
        }
    }
}

/// Keeps reading a finished command's output pipe until its last writer closes it, dropping
/// what comes. A program the command left running in the background (an application started
/// by a launcher that returns at once) keeps writing to the command's stdout and stderr;
/// closing them under it would kill it with SIGPIPE on its next write.
async fn drain(fd: Arc<CmdFd>) {
    let mut buf = vec![0u8; CHUNK];
    while let Ok(n) = fd.read(&mut buf).await {
        if n == 0 {
            break;
        }
    }
}
