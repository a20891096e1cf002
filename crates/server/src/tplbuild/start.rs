//! A built template's start command (step `finalize`): a fresh build sandbox boots on the
//! last layer, the start command runs in the background as the last USER in the last WORKDIR
//! with the build's ENV, the ready command is tried every [`READY_EVERY`] until it exits 0
//! (E2B's defaults: `sleep 20` when none is given), and the running sandbox is snapshotted
//! with its memory — sandboxes of the template restore it, the start command already up.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kiln_envd::{bash_request, ProcessEvent, RunOptions};

use super::Builds;

/// How often the ready command is tried.
pub const READY_EVERY: Duration = Duration::from_secs(1);
/// How long the ready command may take to succeed.
pub const READY_LIMIT: Duration = Duration::from_secs(600);
/// E2B's ready command when a start command has none.
pub const DEFAULT_READY: &str = "sleep 20";

/// Starts `start` in sandbox `sid`, waits for `ready`, and returns the memory snapshot's id.
#[allow(clippy::too_many_arguments)]
pub(super) async fn capture_running(
    b: &Arc<Builds>,
    team: &str,
    build: &str,
    sid: &str,
    start: &str,
    ready: &str,
    user: &str,
    workdir: &str,
    env: &super::Env,
) -> Result<String, String> {
    let agent = b.manager.agent(sid, None);
    let mut req = bash_request(
        start,
        env.clone().into_iter().collect(),
        Some(workdir.into()),
        None,
    );
    req.stdin = Some(false);
    req.tag = Some("kiln-start-cmd".into());
    let mut stream = agent
        .start(&req, Some(user))
        .await
        .map_err(|e| format!("starting the start command as {user:?}: {e}"))?;
    b.log(
        build,
        "info",
        Some("finalize"),
        format!("start command: {start}"),
    )
    .await;
    // The start command's output goes to the build log; its end (an error) is watched.
    let (ended_tx, mut ended) = tokio::sync::watch::channel(None::<i32>);
    let (logger, bid) = (b.clone(), build.to_string());
    tokio::spawn(async move {
        while let Ok(Some(ev)) = stream.next_event().await {
            match ev {
                ProcessEvent::Stdout(d) | ProcessEvent::Stderr(d) | ProcessEvent::Pty(d) => {
                    for line in String::from_utf8_lossy(&d).lines() {
                        logger
                            .log(&bid, "info", Some("finalize"), line.to_string())
                            .await;
                    }
                }
                ProcessEvent::Exited { code, .. } => {
                    let _ = ended_tx.send(Some(code));
                    return;
                }
                ProcessEvent::Started { .. } => {}
            }
        }
    });
    let t = Instant::now();
    loop {
        if let Some(code) = *ended.borrow_and_update() {
            if code != 0 {
                return Err(format!("the start command exited with code {code}"));
            }
        }
        let opts = RunOptions {
            user: Some(user.to_string()),
            cwd: Some(workdir.to_string()),
            envs: env.clone().into_iter().collect(),
            timeout: Some(Duration::from_secs(60)),
            ..Default::default()
        };
        match agent.run(ready, opts).await {
            Ok(out) if out.exit_code == 0 => break,
            Ok(_) | Err(_) if t.elapsed() < READY_LIMIT => {}
            Ok(out) => {
                return Err(format!(
                    "the ready command {ready:?} did not succeed within {}s (exit code {}): {}",
                    READY_LIMIT.as_secs(),
                    out.exit_code,
                    String::from_utf8_lossy(&out.stderr).trim()
                ))
            }
            Err(e) => return Err(format!("the ready command {ready:?}: {e}")),
        }
        tokio::time::sleep(READY_EVERY).await;
    }
    b.log(
        build,
        "info",
        Some("finalize"),
        format!("ready after {:.1}s: {ready}", t.elapsed().as_secs_f64()),
    )
    .await;
    let snap = b
        .manager
        .snapshot_with(sid, team, None, true)
        .await
        .map_err(|e| format!("snapshotting the running sandbox: {e}"))?;
    Ok(snap.id)
}
