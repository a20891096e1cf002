//! A bash context: one persistent `bash` process. Each cell is written to a file and sourced
//! (so variables, functions and `cd` persist), then a per-cell marker carrying `$?` is printed
//! on stdout and stderr, which tells us the cell ended. Interrupt: SIGINT to its process group
//! (bash traps it, so the shell and its state survive).

use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::{bail, Context as _};
use serde_json::{Map, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStderr, ChildStdin, ChildStdout, Command};
use tokio::sync::mpsc;

use super::output::Event;

/// A running bash context.
pub struct Bash {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    stderr: BufReader<ChildStderr>,
    dir: PathBuf,
    count: i64,
}

fn is_name(k: &str) -> bool {
    !k.is_empty()
        && !k.starts_with(|c: char| c.is_ascii_digit())
        && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

fn quote(v: &str) -> String {
    format!("'{}'", v.replace('\'', r"'\''"))
}

impl Bash {
    /// Start bash in `cwd`; cell files go to `dir`.
    pub async fn start(cwd: &Path, dir: &Path) -> anyhow::Result<Bash> {
        std::fs::create_dir_all(dir)?;
        let mut cmd = Command::new("bash");
        super::end_with_service(&mut cmd);
        // SAFETY: only async-signal-safe calls (signal(2)) between fork and exec. A parent
        // started in the background may ignore SIGINT; cells must be interruptible.
        unsafe {
            cmd.pre_exec(|| {
                libc::signal(libc::SIGINT, libc::SIG_DFL);
                libc::signal(libc::SIGQUIT, libc::SIG_DFL);
                Ok(())
            });
        }
        let mut child = cmd
            .args(["--noprofile", "--norc"])
            .current_dir(cwd)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .context("start bash")?;
        let (Some(mut stdin), Some(stdout), Some(stderr)) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            bail!("bash without pipes");
        };
        stdin.write_all(b"trap ':' INT\n").await?;
        Ok(Bash {
            child,
            stdin,
            stdout: BufReader::new(stdout),
            stderr: BufReader::new(stderr),
            dir: dir.to_path_buf(),
            count: 0,
        })
    }

    /// Interrupt the running cell.
    pub fn interrupt(&self) {
        if let Some(pid) = self.child.id() {
            // SAFETY: kill(2) on the process group of a child we spawned as its group leader.
            unsafe { libc::kill(-(pid as i32), libc::SIGINT) };
        }
    }

    /// Run one cell, streaming its output to `out`; returns the execution count.
    pub async fn execute(
        &mut self,
        code: &str,
        env: &Map<String, Value>,
        out: mpsc::Sender<Event>,
    ) -> anyhow::Result<Option<i64>> {
        self.count += 1;
        let marker = format!("__KILN_CELL_DONE_{}__", super::new_id());
        let cell = self.dir.join(format!("cell-{}.sh", super::new_id()));
        std::fs::write(&cell, code)?;
        let mut script = String::new();
        let mut restore = String::new();
        for (k, v) in env {
            if !is_name(k) {
                continue;
            }
            let v = v
                .as_str()
                .map(str::to_string)
                .unwrap_or_else(|| v.to_string());
            script.push_str(&format!(
                "if [ -n \"${{{k}+x}}\" ]; then __kiln_old_{k}=\"${k}\"; else unset __kiln_old_{k}; fi; export {k}={}\n",
                quote(&v)
            ));
            restore.push_str(&format!(
                "if [ -n \"${{__kiln_old_{k}+x}}\" ]; then export {k}=\"$__kiln_old_{k}\"; else unset {k}; fi\n"
            ));
        }
        script.push_str(&format!(
            ". {} </dev/null\n__kiln_rc=$?\n{restore}rm -f {}\nprintf '%s %d\\n' {marker} \"$__kiln_rc\"\nprintf '%s\\n' {marker} >&2\n",
            quote(&cell.to_string_lossy()),
            quote(&cell.to_string_lossy()),
        ));
        self.stdin.write_all(script.as_bytes()).await?;
        self.stdin.flush().await?;
        let (mut rc, mut out_done, mut err_done) = (0, false, false);
        let mut stderr_text = String::new();
        let mut interrupted = false;
        let (mut oline, mut eline) = (Vec::new(), Vec::new());
        while !(out_done && err_done) {
            if out.is_closed() && !interrupted {
                interrupted = true;
                self.interrupt();
            }
            tokio::select! {
                n = self.stdout.read_until(b'\n', &mut oline), if !out_done => {
                    if n? == 0 { bail!("bash exited"); }
                    let line = String::from_utf8_lossy(&oline).into_owned();
                    oline.clear();
                    if let Some(at) = line.find(&marker) {
                        rc = line[at + marker.len()..].trim().parse().unwrap_or(1);
                        out_done = true;
                        if at > 0 {
                            let _ = out.send(Event::Stdout(line[..at].to_string())).await;
                        }
                    } else {
                        let _ = out.send(Event::Stdout(line)).await;
                    }
                }
                n = self.stderr.read_until(b'\n', &mut eline), if !err_done => {
                    if n? == 0 { bail!("bash exited"); }
                    let line = String::from_utf8_lossy(&eline).into_owned();
                    eline.clear();
                    let text = match line.find(&marker) {
                        Some(at) => { err_done = true; line[..at].to_string() }
                        None => line,
                    };
                    if !text.is_empty() {
                        stderr_text.push_str(&text);
                        let _ = out.send(Event::Stderr(text)).await;
                    }
                }
                _ = out.closed(), if !interrupted => {}
            }
        }
        if rc != 0 {
            let _ = out
                .send(Event::Error {
                    name: "BashError".into(),
                    value: format!("exit status {rc}"),
                    traceback: stderr_text,
                })
                .await;
        }
        Ok(Some(self.count))
    }

    /// Stop the shell and everything it started.
    pub async fn shutdown(mut self) {
        if let Some(pid) = self.child.id() {
            // SAFETY: kill(2) on the process group of a child we spawned as its group leader.
            unsafe { libc::kill(-(pid as i32), libc::SIGKILL) };
        }
        let _ = self.child.wait().await;
    }
}
