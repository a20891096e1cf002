//! The template's start command: started in the background through the agent once the
//! sandbox is up; its output lines become `start_cmd` events, which the logs endpoints show.

use super::Manager;
use crate::error::Result;
use crate::store::SandboxRecord;
use crate::templates::TemplateInfo;

/// Event kind of the template start command's output lines in the sandbox logs.
pub const START_CMD_EVENT: &str = "start_cmd";
/// At most this many output lines of a start command are recorded (the rest is counted).
const START_CMD_MAX_LINES: usize = 1000;
const START_CMD_MAX_LINE: usize = 4096;

impl Manager {
    /// Starts the template's start command in the background through the agent (as the
    /// template's user, in its workdir) and records its output in the sandbox's events, which
    /// `GET /sandboxes/{id}/logs` shows.
    pub(super) async fn start_cmd(
        &self,
        record: &SandboxRecord,
        tpl: &TemplateInfo,
        cmd: &str,
    ) -> Result<()> {
        use kiln_proto::process::{self as pb, process_event};
        use prost::Message;
        let req = pb::StartRequest {
            process: Some(pb::ProcessConfig {
                cmd: "/bin/bash".into(),
                args: vec!["-l".into(), "-c".into(), cmd.into()],
                envs: Default::default(),
                cwd: Some(tpl.workdir.clone()),
            }),
            pty: None,
            tag: Some("kiln-start-cmd".into()),
            stdin: Some(false),
        };
        let agent = self.agent(&record.id, record.envd_token.clone());
        let mut stream = agent
            .server_stream(
                "/process.Process/Start",
                &req,
                Some(&tpl.user),
                record.envd_token.as_deref(),
                None,
            )
            .await?;
        self.event(&record.id, START_CMD_EVENT, format!("started: {cmd}"))
            .await;
        let (outlets, id) = (self.outlets.clone(), record.id.clone());
        // Output lines are recorded in order by one task fed through a channel.
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
        tokio::spawn(async move {
            while let Some(detail) = rx.recv().await {
                outlets.note(&id, START_CMD_EVENT, detail).await;
            }
        });
        let ev = move |detail: String| {
            let _ = tx.send(detail);
        };
        tokio::spawn(async move {
            let mut lines = 0usize;
            let mut dropped = 0usize;
            let mut partial: [Vec<u8>; 2] = [Vec::new(), Vec::new()];
            let emit = |which: usize, line: &[u8], lines: &mut usize, dropped: &mut usize| {
                if *lines >= START_CMD_MAX_LINES {
                    *dropped += 1;
                    return;
                }
                *lines += 1;
                let text = String::from_utf8_lossy(&line[..line.len().min(START_CMD_MAX_LINE)]);
                let src = if which == 0 { "stdout" } else { "stderr" };
                ev(format!("{src}: {}", text.trim_end_matches(['\r', '\n'])));
            };
            loop {
                let msg = match stream.next_message().await {
                    Ok(Some(m)) => m,
                    Ok(None) => break,
                    Err(e) => {
                        // The sandbox went away (killed) or the agent closed the stream.
                        tracing::debug!(error = %e, "start command output stream ended");
                        return;
                    }
                };
                let Ok(resp) = pb::StartResponse::decode(msg) else {
                    break;
                };
                match resp.event.and_then(|e| e.event) {
                    Some(process_event::Event::Data(d)) => {
                        let (which, bytes) = match d.output {
                            Some(process_event::data_event::Output::Stdout(b)) => (0, b),
                            Some(process_event::data_event::Output::Stderr(b)) => (1, b),
                            Some(process_event::data_event::Output::Pty(b)) => (0, b),
                            None => continue,
                        };
                        partial[which].extend_from_slice(&bytes);
                        while let Some(nl) = partial[which].iter().position(|b| *b == b'\n') {
                            let line: Vec<u8> = partial[which].drain(..=nl).collect();
                            emit(which, &line, &mut lines, &mut dropped);
                        }
                        if partial[which].len() > START_CMD_MAX_LINE {
                            let line = std::mem::take(&mut partial[which]);
                            emit(which, &line, &mut lines, &mut dropped);
                        }
                    }
                    Some(process_event::Event::End(end)) => {
                        for (which, buf) in partial.iter_mut().enumerate() {
                            if !buf.is_empty() {
                                let line = std::mem::take(buf);
                                emit(which, &line, &mut lines, &mut dropped);
                            }
                        }
                        if dropped > 0 {
                            ev(format!("{dropped} more output lines not recorded"));
                        }
                        let status = if end.status.is_empty() {
                            format!("exit code {}", end.exit_code)
                        } else {
                            end.status
                        };
                        ev(format!("exited: {status}"));
                        return;
                    }
                    _ => {}
                }
            }
        });
        Ok(())
    }
}
