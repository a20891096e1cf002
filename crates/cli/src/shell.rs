//! `kiln sandbox shell`: an interactive login shell in a sandbox PTY. The local terminal is put
//! in raw mode for the session and restored on every way out (the shell exits, the stream
//! fails, SIGTERM/SIGHUP/SIGINT/SIGQUIT arrive); each SIGWINCH resizes the sandbox's PTY to the
//! local window.

use std::io::{Read, Write};
use std::time::Duration;

use anyhow::{bail, Context};
use kiln_envd::{EnvdClient, ProcessEvent};
use tokio::signal::unix::{signal, SignalKind};

use crate::client::Client;
use crate::term;

/// How long a shell ended by a signal waits for the sandbox to confirm the kill of its bash.
const KILL_WAIT: Duration = Duration::from_secs(2);

fn write_out(d: &[u8]) {
    let mut o = std::io::stdout().lock();
    let _ = o.write_all(d);
    let _ = o.flush();
}

/// Runs the shell; its exit code, or 128 + the signal's number when a signal ended it.
pub async fn run(client: Client, id: &str, user: Option<String>) -> anyhow::Result<i32> {
    let sbx = client.sandbox(id).await?;
    let envd = client.envd(&sbx).await?;
    let size = term::size(0).unwrap_or((80, 24));
    // Dropped on every return below (and on unwinding): the terminal gets its settings back.
    let _raw = term::RawMode::enable(0).ok();
    let mut signals = Signals::new()?;
    let req = kiln_envd::bash_request("exec bash -l", Default::default(), None, Some(size));
    let mut events = envd.start(&req, user.as_deref()).await?;
    let pid = loop {
        match events.next_event().await? {
            Some(ProcessEvent::Started { pid }) => break pid,
            Some(ProcessEvent::Exited { code, .. }) => return Ok(code),
            Some(ProcessEvent::Pty(d) | ProcessEvent::Stdout(d) | ProcessEvent::Stderr(d)) => {
                write_out(&d)
            }
            None => bail!("the sandbox ended the shell before it started"),
        }
    };
    forward_stdin(envd.clone(), pid, user.clone());
    // A resize that happened between reading the size and the start.
    if let Some((cols, rows)) = term::size(0).filter(|s| *s != size) {
        resize(&envd, pid, cols, rows, user.clone());
    }
    loop {
        tokio::select! {
            ev = events.next_event() => match ev.context("reading the shell's output")? {
                Some(ProcessEvent::Pty(d) | ProcessEvent::Stdout(d) | ProcessEvent::Stderr(d)) => {
                    write_out(&d)
                }
                Some(ProcessEvent::Exited { code, .. }) => return Ok(code),
                Some(ProcessEvent::Started { .. }) => {}
                None => bail!("the shell's stream ended without an exit status"),
            },
            s = signals.next() => match s {
                Sig::Winch => {
                    if let Some((cols, rows)) = term::size(0) {
                        resize(&envd, pid, cols, rows, user.clone());
                    }
                }
                Sig::End(signo) => {
                    let kill = kill(&envd, pid, user.as_deref());
                    let _ = tokio::time::timeout(KILL_WAIT, kill).await;
                    return Ok(128 + signo);
                }
            },
        }
    }
}

/// Local stdin → the PTY: a blocking reader thread feeding an async sender.
fn forward_stdin(envd: EnvdClient, pid: u32, user: Option<String>) {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Vec<u8>>(64);
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        let mut stdin = std::io::stdin();
        while let Ok(n) = stdin.read(&mut buf) {
            if n == 0 || tx.blocking_send(buf[..n].to_vec()).is_err() {
                break;
            }
        }
    });
    tokio::spawn(async move {
        while let Some(data) = rx.recv().await {
            if envd
                .send_input(pid, data, true, user.as_deref())
                .await
                .is_err()
            {
                break;
            }
        }
    });
}

/// Resizes the PTY without holding up the output.
fn resize(envd: &EnvdClient, pid: u32, cols: u16, rows: u16, user: Option<String>) {
    let envd = envd.clone();
    tokio::spawn(async move {
        if let Err(e) = envd.resize_pty(pid, cols, rows, user.as_deref()).await {
            tracing::debug!("resizing the sandbox PTY: {e}");
        }
    });
}

/// SIGKILL to the shell's bash, so a shell ended from outside leaves nothing running.
async fn kill(envd: &EnvdClient, pid: u32, user: Option<&str>) {
    if let Err(e) = envd.kill(pid, user).await {
        tracing::debug!("killing the sandbox shell: {e}");
    }
}

enum Sig {
    Winch,
    /// A signal that ends the session, by number.
    End(i32),
}

/// The signals the shell session handles.
struct Signals {
    winch: tokio::signal::unix::Signal,
    ends: Vec<(i32, tokio::signal::unix::Signal)>,
}

impl Signals {
    fn new() -> anyhow::Result<Self> {
        let mut ends = Vec::new();
        for signo in [libc::SIGTERM, libc::SIGHUP, libc::SIGINT, libc::SIGQUIT] {
            let s = signal(SignalKind::from_raw(signo)).context("installing a signal handler")?;
            ends.push((signo, s));
        }
        Ok(Self {
            winch: signal(SignalKind::window_change()).context("installing a signal handler")?,
            ends,
        })
    }

    async fn next(&mut self) -> Sig {
        let ends = first_of(&mut self.ends);
        tokio::select! {
            _ = self.winch.recv() => Sig::Winch,
            signo = ends => Sig::End(signo),
        }
    }
}

/// The number of the first of `ends` to arrive.
async fn first_of(ends: &mut [(i32, tokio::signal::unix::Signal)]) -> i32 {
    std::future::poll_fn(|cx| {
        for (signo, s) in ends.iter_mut() {
            if s.poll_recv(cx).is_ready() {
                return std::task::Poll::Ready(*signo);
            }
        }
        std::task::Poll::Pending
    })
    .await
}
