//! A JavaScript context: one persistent `node` running `driver.js`, which evaluates cells in a
//! single V8 context and answers with JSON lines. Interrupt: SIGINT (the driver runs cells with
//! `breakOnSigint`, so the cell fails and the context lives on).

use std::path::Path;
use std::process::Stdio;

use anyhow::{bail, Context as _};
use serde_json::{json, Map, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};
use tokio::sync::mpsc;

use super::output::{result_from_bundle, Event};

const DRIVER: &str = include_str!("driver.js");

/// A running JavaScript context.
pub struct Js {
    child: Child,
    stdin: ChildStdin,
    stdout: Lines<BufReader<ChildStdout>>,
    count: i64,
}

impl Js {
    /// Start `node` in `cwd`.
    pub async fn start(node: &Path, cwd: &Path) -> anyhow::Result<Js> {
        let mut cmd = Command::new(node);
        super::end_with_service(&mut cmd);
        let mut child = cmd
            .args(["-e", DRIVER])
            .current_dir(cwd)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("start {}", node.display()))?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            bail!("node without pipes");
        };
        Ok(Js {
            child,
            stdin,
            stdout: BufReader::new(stdout).lines(),
            count: 0,
        })
    }

    fn interrupt(&self) {
        if let Some(pid) = self.child.id() {
            // SAFETY: kill(2) on the pid of a child we spawned and have not reaped.
            unsafe { libc::kill(pid as i32, libc::SIGINT) };
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
        let mut line = json!({"code": code, "env": env}).to_string();
        line.push('\n');
        self.stdin.write_all(line.as_bytes()).await?;
        self.stdin.flush().await?;
        let mut interrupted = false;
        loop {
            if out.is_closed() && !interrupted {
                interrupted = true;
                self.interrupt();
            }
            let l = tokio::select! {
                l = self.stdout.next_line() => l?,
                _ = out.closed(), if !interrupted => continue,
            };
            let Some(l) = l else { bail!("node exited") };
            let Ok(Value::Object(m)) = serde_json::from_str::<Value>(&l) else {
                // Something wrote to stdout directly: pass it through.
                let _ = out.send(Event::Stdout(format!("{l}\n"))).await;
                continue;
            };
            let ev = if let Some(t) = m.get("stdout").and_then(Value::as_str) {
                Event::Stdout(t.into())
            } else if let Some(t) = m.get("stderr").and_then(Value::as_str) {
                Event::Stderr(t.into())
            } else if let Some(t) = m.get("result") {
                let mut bundle = Map::new();
                bundle.insert("text/plain".into(), t.clone());
                Event::Result(result_from_bundle(&bundle, true))
            } else if let Some(e) = m.get("error") {
                let s = |k: &str| e[k].as_str().unwrap_or_default().to_string();
                Event::Error {
                    name: s("name"),
                    value: s("value"),
                    traceback: s("traceback"),
                }
            } else if m.contains_key("done") {
                return Ok(Some(self.count));
            } else {
                continue;
            };
            let _ = out.send(ev).await;
        }
    }

    /// Stop node.
    pub async fn shutdown(mut self) {
        let _ = self.child.kill().await;
    }
}
