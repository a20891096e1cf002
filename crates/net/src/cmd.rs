//! Running the host's network tools (`ip`, `nft`) with their output captured.

use std::process::Stdio;

use tokio::io::AsyncWriteExt;
use tokio::process::Command;

use crate::{io_err, NetError, Result};

/// Runs `program args…`, feeding `stdin` if given; fails with its output on a non-zero exit.
pub async fn run(program: &str, args: &[&str], stdin: Option<&str>) -> Result<String> {
    let mut c = Command::new(program);
    c.args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let mut child = c.spawn().map_err(io_err(format!("running {program}")))?;
    if let Some(text) = stdin {
        let mut w = child.stdin.take().expect("piped stdin");
        w.write_all(text.as_bytes())
            .await
            .map_err(io_err(format!("writing to {program}")))?;
        drop(w);
    }
    let out = child
        .wait_with_output()
        .await
        .map_err(io_err(format!("waiting for {program}")))?;
    if !out.status.success() {
        return Err(NetError::Command {
            command: format!("{program} {}", args.join(" ")),
            output: format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )
            .trim()
            .to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `ip [-n ns] -batch -`: several `ip` commands in one process.
pub async fn ip_batch(netns: Option<&str>, commands: &[String]) -> Result<()> {
    let mut args = Vec::new();
    if let Some(ns) = netns {
        args.extend(["-n", ns]);
    }
    args.extend(["-batch", "-"]);
    let text = commands.join("\n") + "\n";
    run("ip", &args, Some(&text)).await.map(drop)
}

/// `nft -f -` inside network namespace `netns` (the host's when `None`): one atomic
/// transaction.
pub async fn nft(netns: Option<&str>, ruleset: &str) -> Result<()> {
    match netns {
        Some(ns) => {
            run(
                "ip",
                &["netns", "exec", ns, "nft", "-f", "-"],
                Some(ruleset),
            )
            .await
        }
        None => run("nft", &["-f", "-"], Some(ruleset)).await,
    }
    .map(drop)
}
