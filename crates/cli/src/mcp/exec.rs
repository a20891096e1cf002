//! `run_command`: a shell command in a sandbox (bash -l -c), its output and exit code; output
//! arrives as progress notifications while it runs when the caller asked for progress.

use std::collections::BTreeMap;
use std::time::Duration;

use kiln_envd::ProcessEvent;
use rmcp::model::CallToolResult;
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::json;

use super::args::{non_empty, ToolError, ToolResult};
use super::ctx::Ctx;
use super::lifecycle::done;
use crate::client::ExecOptions;

/// Output kept per stream; more is cut from the middle (the model sees both ends).
const MAX_OUTPUT: usize = 256 << 10;
/// Default and largest command timeout.
const DEFAULT_TIMEOUT_SECS: u64 = 120;
const MAX_TIMEOUT_SECS: u64 = 3600;

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RunArgs {
    /// The sandbox's id.
    sandbox_id: String,
    /// The command line, run by `bash -l -c`.
    command: String,
    /// Working directory (default: the user's home).
    #[serde(default)]
    cwd: Option<String>,
    /// Extra environment variables.
    #[serde(default)]
    env: Option<BTreeMap<String, String>>,
    /// Run as this user (default: the template's, `user`; `root` for root).
    #[serde(default)]
    user: Option<String>,
    /// Seconds before the command is abandoned (default 120, at most 3600).
    #[serde(default)]
    timeout_secs: Option<u64>,
}

/// Collected output of one stream, keeping the head and tail when it grows too large.
#[derive(Default)]
struct Capture {
    head: Vec<u8>,
    tail: Vec<u8>,
    dropped: usize,
}

impl Capture {
    fn push(&mut self, d: &[u8]) {
        let half = MAX_OUTPUT / 2;
        let room = half.saturating_sub(self.head.len());
        let (h, rest) = d.split_at(room.min(d.len()));
        self.head.extend_from_slice(h);
        self.tail.extend_from_slice(rest);
        if self.tail.len() > half {
            let cut = self.tail.len() - half;
            self.tail.drain(..cut);
            self.dropped += cut;
        }
    }

    fn text(&self) -> String {
        let mut s = String::from_utf8_lossy(&self.head).into_owned();
        if self.dropped > 0 {
            s.push_str(&format!("\n[… {} bytes left out …]\n", self.dropped));
        }
        s.push_str(&String::from_utf8_lossy(&self.tail));
        s
    }
}

pub async fn run(ctx: &Ctx, a: RunArgs) -> ToolResult<CallToolResult> {
    non_empty("command", &a.command)?;
    if let Some(cwd) = &a.cwd {
        super::args::abs_path("cwd", cwd)?;
    }
    let secs = a.timeout_secs.unwrap_or(DEFAULT_TIMEOUT_SECS);
    super::args::in_range("timeout_secs", secs, MAX_TIMEOUT_SECS)?;
    let sbx = ctx.sandbox(&a.sandbox_id).await?;
    let opts = ExecOptions {
        user: a.user,
        cwd: a.cwd,
        envs: a.env.unwrap_or_default(),
        pty: None,
    };
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    let mut out = Capture::default();
    let mut err = Capture::default();
    let mut pid = None;
    let exec = async {
        // Owns the sender: the forwarder below ends when the command does.
        let tx = tx;
        ctx.client
            .exec(&sbx, &a.command, &opts, |ev| match ev {
                ProcessEvent::Started { pid: p } => pid = Some(p),
                ProcessEvent::Stdout(d) | ProcessEvent::Pty(d) => {
                    let _ = tx.send(String::from_utf8_lossy(&d).into_owned());
                    out.push(&d);
                }
                ProcessEvent::Stderr(d) => {
                    let _ = tx.send(String::from_utf8_lossy(&d).into_owned());
                    err.push(&d);
                }
                ProcessEvent::Exited { .. } => {}
            })
            .await
    };
    // Output goes out as progress while the command runs.
    let forward = async {
        while let Some(chunk) = rx.recv().await {
            ctx.progress(chunk).await;
        }
    };
    let timed = tokio::time::timeout(Duration::from_secs(secs), async {
        tokio::join!(exec, forward).0
    })
    .await;
    let code = match timed {
        Ok(r) => r?,
        Err(_) => {
            if let Some(p) = pid {
                kill(ctx, &sbx, p, opts.user.as_deref()).await;
            }
            return Err(ToolError::failed(format!(
                "the command did not finish within {secs} s (timeout_secs) and was killed"
            )));
        }
    };
    let (stdout, stderr) = (out.text(), err.text());
    let mut text = format!("exit code {code}");
    if !stdout.is_empty() {
        text.push_str(&format!("\n--- stdout ---\n{stdout}"));
    }
    if !stderr.is_empty() {
        text.push_str(&format!("\n--- stderr ---\n{stderr}"));
    }
    Ok(done(
        text,
        json!({"exit_code": code, "stdout": stdout, "stderr": stderr}),
    ))
}

/// SIGKILL to a command that ran out of time.
async fn kill(ctx: &Ctx, sbx: &crate::client::SandboxRef, pid: u32, user: Option<&str>) {
    let r = match ctx.client.envd(sbx).await {
        Ok(envd) => envd.kill(pid, user).await.map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    if let Err(e) = r {
        tracing::debug!("killing a command past its timeout: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capture_keeps_both_ends() {
        let mut c = Capture::default();
        c.push(b"hello ");
        c.push(b"world");
        assert_eq!(c.text(), "hello world");
        let mut c = Capture::default();
        c.push(&vec![b'a'; MAX_OUTPUT]);
        c.push(&[b'b'; 10]);
        let t = c.text();
        assert!(t.starts_with("aaa") && t.ends_with("bbbbbbbbbb"));
        assert!(
            t.contains("[… 10 bytes left out …]"),
            "{}",
            &t[MAX_OUTPUT / 2 - 5..]
        );
    }
}
