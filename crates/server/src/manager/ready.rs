//! The template's ready command (E2B's `readyCmd`): after the start command began, a create
//! (or a reboot) returns only once this command exits 0, so the first SDK call after `create`
//! finds the template's service up. It is retried every [`READY_INTERVAL`] for at most the
//! lifecycle's `start_ready_timeout`; a template that never gets ready fails the create with
//! the command's last answer.

use std::time::{Duration, Instant};

use kiln_envd::ProcessEvent;
use kiln_proto::process as pb;

use super::Manager;
use crate::error::{Error, Result};
use crate::store::SandboxRecord;
use crate::templates::TemplateInfo;

/// Pause between two tries of a failing ready command.
pub const READY_INTERVAL: Duration = Duration::from_millis(50);
/// One try may take at most this long (a hung check is abandoned and tried again).
const TRY_TIMEOUT: Duration = Duration::from_secs(10);
/// Output kept from a failing try for the error message.
const OUTPUT_TAIL: usize = 512;

/// What one try of the ready command ended with.
enum Try {
    Ready,
    NotYet(String),
}

impl Manager {
    /// Runs `cmd` (`/bin/bash -c`, as the template's user, in its workdir) until it exits 0.
    pub(super) async fn wait_start_ready(
        &self,
        record: &SandboxRecord,
        tpl: &TemplateInfo,
        cmd: &str,
    ) -> Result<()> {
        let started = Instant::now();
        let budget = self.cfg.start_ready_timeout;
        let mut tries = 0u32;
        // The last answer the command gave; a try cut short by the deadline does not replace it.
        let mut last = String::from("no try finished");
        loop {
            tries += 1;
            let limit = TRY_TIMEOUT.min(budget.saturating_sub(started.elapsed()));
            match tokio::time::timeout(limit, self.ready_try(record, tpl, cmd)).await {
                Ok(Try::Ready) => return Ok(()),
                Ok(Try::NotYet(why)) => last = why,
                Err(_) if limit == TRY_TIMEOUT => {
                    last = format!("a try did not finish within {}s", TRY_TIMEOUT.as_secs())
                }
                Err(_) => {}
            }
            if started.elapsed() + READY_INTERVAL >= budget {
                return Err(Error::internal(format!(
                    "the template's ready command `{cmd}` did not succeed within {}s \
                     ({tries} tries; last: {last}); check the template's start command in \
                     the sandbox logs",
                    budget.as_secs()
                )));
            }
            tokio::time::sleep(READY_INTERVAL).await;
        }
    }

    async fn ready_try(&self, record: &SandboxRecord, tpl: &TemplateInfo, cmd: &str) -> Try {
        let req = pb::StartRequest {
            process: Some(pb::ProcessConfig {
                cmd: "/bin/bash".into(),
                args: vec!["-c".into(), cmd.into()],
                envs: Default::default(),
                cwd: Some(tpl.workdir.clone()),
            }),
            pty: None,
            tag: Some("kiln-ready-cmd".into()),
            stdin: Some(false),
        };
        let agent = self.agent(&record.id, record.envd_token.clone());
        let mut stream = match agent.start(&req, Some(&tpl.user)).await {
            Ok(s) => s,
            Err(e) => return Try::NotYet(e.to_string()),
        };
        let mut output = Vec::new();
        loop {
            match stream.next_event().await {
                Ok(Some(ProcessEvent::Exited { code: 0, .. })) => return Try::Ready,
                Ok(Some(ProcessEvent::Exited { code, error })) => {
                    let text = String::from_utf8_lossy(&output);
                    let text = text.trim();
                    let mut why = format!("exit code {code}");
                    if let Some(e) = error.filter(|e| !e.is_empty()) {
                        why.push_str(&format!(" ({e})"));
                    }
                    if !text.is_empty() {
                        why.push_str(&format!(", output: {text}"));
                    }
                    return Try::NotYet(why);
                }
                Ok(Some(
                    ProcessEvent::Stdout(b) | ProcessEvent::Stderr(b) | ProcessEvent::Pty(b),
                )) => {
                    output.extend_from_slice(&b);
                    if output.len() > OUTPUT_TAIL {
                        output.drain(..output.len() - OUTPUT_TAIL);
                    }
                }
                Ok(Some(ProcessEvent::Started { .. })) => {}
                Ok(None) => return Try::NotYet("the command's stream ended early".into()),
                Err(e) => return Try::NotYet(e.to_string()),
            }
        }
    }
}
