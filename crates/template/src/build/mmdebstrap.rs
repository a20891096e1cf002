//! Stage 1 of a build: `mmdebstrap` of the recipe's Debian suite and packages, each recipe step
//! run as a customize hook, with the output streamed into the log and the progress display.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

use kiln_host::apt_sources;

use super::progress::{Log, Ui};
use super::BuildOptions;
use crate::recipe::{Recipe, Step};
use crate::{io_err, Result};

/// Line a step's hook prints first, so the output tells which step is running.
const STEP_MARKER: &str = "kiln-step:";

/// Single-quotes `s` for `sh`.
pub(super) fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The apt sources given to mmdebstrap: the option, else `KILN_DEBIAN_MIRROR`, else the host's
/// own Debian sources file (see [`kiln_host::apt_sources`]).
pub(super) fn default_mirror(opts: &BuildOptions) -> Option<String> {
    opts.mirror
        .clone()
        .or_else(apt_sources::mirror_override)
        .or_else(|| apt_sources::host_debian_sources_file().map(|p| p.display().to_string()))
}

/// Writes the per-step scripts and runs mmdebstrap with one customize hook per step.
pub(super) fn run_mmdebstrap(
    recipe: &Recipe,
    opts: &BuildOptions,
    staging: &Path,
    ui: &Ui,
    log: &mut Log,
) -> Result<()> {
    let steps_dir = staging.join("steps");
    std::fs::create_dir_all(&steps_dir).map_err(io_err("creating step dir"))?;
    let rootfs = staging.join("rootfs");

    let mut hooks: Vec<String> = Vec::new();
    let mut env: BTreeMap<String, String> = BTreeMap::new();
    let mut user = "root".to_string();
    let mut workdir = "/".to_string();
    for (i, step) in recipe.steps.iter().enumerate() {
        let n = i + 1;
        let marker = format!("echo {STEP_MARKER}{n}");
        let hook = match step {
            Step::Run(cmd) => {
                let mut script = String::from("set -e\n");
                for (k, v) in &env {
                    script.push_str(&format!("export {k}={}\n", sh_quote(v)));
                }
                script.push_str(&format!("cd {}\n{cmd}\n", sh_quote(&workdir)));
                let file = steps_dir.join(format!("step-{n}.sh"));
                std::fs::write(&file, script).map_err(io_err("writing step script"))?;
                let run_as = if user == "root" {
                    String::new()
                } else {
                    format!("runuser -u {} -- ", sh_quote(&user))
                };
                format!(
                    "{marker}; mkdir -p \"$1/.kiln-build\" && cp {} \"$1/.kiln-build/step.sh\" && chmod 0755 \"$1/.kiln-build\" \"$1/.kiln-build/step.sh\" && chroot \"$1\" {run_as}/bin/sh -e /.kiln-build/step.sh",
                    sh_quote(&file.display().to_string())
                )
            }
            Step::File(f) => {
                let file = steps_dir.join(format!("file-{n}"));
                std::fs::write(&file, &f.content).map_err(io_err("writing file step"))?;
                format!(
                    "{marker}; install -D -m {} {} \"$1\"{}",
                    f.mode.as_deref().unwrap_or("0644"),
                    sh_quote(&file.display().to_string()),
                    sh_quote(&f.path)
                )
            }
            Step::Env(e) => {
                env.extend(e.clone());
                marker
            }
            Step::User(u) => {
                user = u.clone();
                format!("{marker}; chroot \"$1\" id -u {} >/dev/null", sh_quote(u))
            }
            Step::Workdir(w) => {
                workdir = w.clone();
                format!("{marker}; mkdir -p \"$1\"{}", sh_quote(w))
            }
        };
        hooks.push(hook);
    }
    hooks.push("rm -rf \"$1/.kiln-build\"".into());

    let mut cmd = Command::new("mmdebstrap");
    cmd.arg(format!("--variant={}", recipe.from.variant));
    if !recipe.from.packages.is_empty() {
        cmd.arg(format!("--include={}", recipe.from.packages.join(",")));
    }
    for h in &hooks {
        cmd.arg(format!("--customize-hook={h}"));
    }
    cmd.arg(&recipe.from.debian).arg(&rootfs);
    if let Some(m) = default_mirror(opts) {
        cmd.arg(m);
    }
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    log.line(&format!("$ {cmd:?}"));

    let total = recipe.steps.len();
    let mut phase = ui.phase(&format!(
        "mmdebstrap {} ({}, {} packages)",
        recipe.from.debian,
        recipe.from.variant,
        recipe.from.packages.len()
    ));
    let mut current = format!("mmdebstrap of {} with its packages", recipe.from.debian);
    let mut child = cmd.spawn().map_err(io_err("starting mmdebstrap"))?;
    // Merge stdout and stderr into one ordered stream via a channel.
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let mut readers = Vec::new();
    for stream in [
        child
            .stdout
            .take()
            .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
        child
            .stderr
            .take()
            .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
    ]
    .into_iter()
    .flatten()
    {
        let tx = tx.clone();
        readers.push(std::thread::spawn(move || {
            for line in BufReader::new(stream).lines().map_while(|l| l.ok()) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        }));
    }
    drop(tx);
    for line in rx {
        log.line(&line);
        if let Some(n) = line.strip_prefix(STEP_MARKER) {
            if let Ok(n) = n.trim().parse::<usize>() {
                phase.done();
                let desc = recipe.steps[n - 1].describe();
                current = format!("step {n}/{total}: {desc}");
                phase = ui.phase(&current);
            }
        } else {
            phase.message(&line);
        }
    }
    for r in readers {
        let _ = r.join();
    }
    let status = child.wait().map_err(io_err("waiting for mmdebstrap"))?;
    if !status.success() {
        phase.fail();
        log.line(&format!("mmdebstrap exited with {status}"));
        return Err(log.failure(&current, &log.path.clone()));
    }
    phase.done();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sh_quote_survives_quotes() {
        assert_eq!(sh_quote("a'b"), r"'a'\''b'");
        let out = Command::new("sh")
            .arg("-c")
            .arg(format!("printf %s {}", sh_quote("it's $HOME `x`")))
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout), "it's $HOME `x`");
    }
}
