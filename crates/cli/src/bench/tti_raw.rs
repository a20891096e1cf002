//! The raw runsc counterparts of `kiln bench tti`'s figures, on the template's rootfs with the
//! same runsc and platform (bundles from [`super::create_bench::raw_bundle`]; no overlay, no
//! cgroup limits, no agent, no network):
//! - create → first echo: `runsc run` of `bash -l -c 'echo …'` until its first line;
//! - exec round trip: `runsc exec` of `bash -l -c true` in a running container;
//! - pause → resume → first command: `runsc checkpoint`, then `runsc restore` + `runsc exec true`
//!   (the restore and first command timed, as kiln's resume is);
//! - fork → child's first command: `runsc checkpoint --leave-running` + `runsc restore` under a
//!   new id + `runsc exec true`;
//! - idle MiB: the PSS of one idle container's runsc processes.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::create_bench::{raw_bundle, raw_runsc_echo, EchoCommand};
use kiln_server::templates::TemplateInfo;

/// The raw samples (milliseconds; MiB for `idle_mib`).
#[derive(Debug, Default)]
pub struct RawReport {
    pub tti: Vec<f64>,
    pub exec: Vec<f64>,
    pub resume: Vec<f64>,
    pub fork: Vec<f64>,
    pub idle_mib: Option<f64>,
    /// What could not be measured, and why.
    pub errors: Vec<String>,
}

struct Raw<'a> {
    runsc: &'a Path,
    root: PathBuf,
    platform: &'a str,
}

impl Raw<'_> {
    fn cmd(&self) -> Command {
        let mut c = Command::new(self.runsc);
        c.arg(format!("--root={}", self.root.display()))
            .arg(format!("--platform={}", self.platform))
            .arg("--network=none")
            .stdin(Stdio::null());
        c
    }

    /// Runs runsc with `args`; its output, or what went wrong.
    fn run(&self, args: &[&str]) -> Result<Vec<u8>, String> {
        let out = self
            .cmd()
            .args(args)
            .output()
            .map_err(|e| format!("running runsc: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "runsc {}: {}",
                args.first().unwrap_or(&""),
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(out.stdout)
    }

    /// Runs a detaching runsc command (`run --detach`, `restore --detach`): the container
    /// keeps the standard streams it is given, so they go to a log file, not to pipes.
    fn detach(&self, args: &[&str]) -> Result<(), String> {
        let log_path = self.root.with_extension("log");
        let log = std::fs::File::create(&log_path).map_err(|e| e.to_string())?;
        let err = log.try_clone().map_err(|e| e.to_string())?;
        let st = self
            .cmd()
            .args(args)
            .stdout(log)
            .stderr(err)
            .status()
            .map_err(|e| format!("running runsc: {e}"))?;
        if !st.success() {
            let text = std::fs::read_to_string(&log_path).unwrap_or_default();
            return Err(format!(
                "runsc {}: {}",
                args.first().unwrap_or(&""),
                text.trim()
            ));
        }
        Ok(())
    }

    fn exec_true(&self, id: &str) -> Result<(), String> {
        self.run(&["exec", id, "/bin/true"]).map(drop)
    }

    fn delete(&self, id: &str) {
        let _ = self.run(&["delete", "--force", id]);
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Measures every raw counterpart: `tti` runs of create → echo, `runs` exec round trips,
/// `rounds` checkpoint/restore and fork rounds, in `work` (removed by the caller).
pub fn measure(
    runsc: &Path,
    platform: &str,
    tpl: &TemplateInfo,
    work: &Path,
    tti: usize,
    runs: usize,
    rounds: usize,
) -> RawReport {
    let mut r = RawReport::default();
    for i in 0..tti {
        match raw_runsc_echo(runsc, work, tpl, platform, EchoCommand::LoginShell, i) {
            Ok(d) => r.tti.push(ms(d)),
            Err(e) => r.errors.push(format!("raw create → echo: {e}")),
        }
    }
    let raw = Raw {
        runsc,
        root: work.join("raw-runsc-root"),
        platform,
    };
    let id = format!("kiln-tti-raw-{}", std::process::id());
    let bundle = work.join("raw-idle");
    let sleep = vec!["/bin/sleep".to_string(), "3600".to_string()];
    let started = raw_bundle(&bundle, tpl, sleep).and_then(|()| {
        let b = bundle.to_string_lossy().into_owned();
        raw.detach(&["run", "--detach", "--bundle", &b, &id])
    });
    if let Err(e) = started {
        r.errors.push(format!("raw idle container: {e}"));
        return r;
    }
    if let Err(e) = exec_and_idle(&raw, &id, runs, &mut r) {
        r.errors.push(e);
    }
    if let Err(e) = fork_rounds(&raw, &id, &bundle, work, rounds, &mut r) {
        r.errors.push(format!("raw fork: {e}"));
    }
    if let Err(e) = resume_rounds(&raw, &id, &bundle, work, rounds, &mut r) {
        r.errors.push(format!("raw checkpoint/restore: {e}"));
    }
    raw.delete(&id);
    r
}

fn exec_and_idle(raw: &Raw<'_>, id: &str, runs: usize, r: &mut RawReport) -> Result<(), String> {
    raw.run(&["exec", id, "/bin/bash", "-l", "-c", "true"])?; // warm-up
    for _ in 0..runs {
        let t = Instant::now();
        raw.run(&["exec", id, "/bin/bash", "-l", "-c", "true"])?;
        r.exec.push(ms(t.elapsed()));
    }
    std::thread::sleep(Duration::from_secs(1));
    let u = super::density::runsc_usage(&raw.root);
    if u.processes > 0 {
        r.idle_mib = Some(u.pss_kib as f64 / 1024.0);
    }
    Ok(())
}

fn fork_rounds(
    raw: &Raw<'_>,
    id: &str,
    bundle: &Path,
    work: &Path,
    rounds: usize,
    r: &mut RawReport,
) -> Result<(), String> {
    let b = bundle.to_string_lossy().into_owned();
    for i in 0..rounds {
        let image = work.join(format!("raw-fork-{i}"));
        std::fs::create_dir_all(&image).map_err(|e| e.to_string())?;
        let img = image.to_string_lossy().into_owned();
        let child = format!("{id}-c{i}");
        let t = Instant::now();
        raw.run(&["checkpoint", "--leave-running", "--image-path", &img, id])?;
        let restored = raw
            .detach(&[
                "restore",
                "--detach",
                "--image-path",
                &img,
                "--bundle",
                &b,
                &child,
            ])
            .and_then(|()| raw.exec_true(&child));
        let took = t.elapsed();
        raw.delete(&child);
        let _ = std::fs::remove_dir_all(&image);
        restored?;
        r.fork.push(ms(took));
    }
    Ok(())
}

fn resume_rounds(
    raw: &Raw<'_>,
    id: &str,
    bundle: &Path,
    work: &Path,
    rounds: usize,
    r: &mut RawReport,
) -> Result<(), String> {
    let b = bundle.to_string_lossy().into_owned();
    for i in 0..rounds {
        let image = work.join(format!("raw-ckpt-{i}"));
        std::fs::create_dir_all(&image).map_err(|e| e.to_string())?;
        let img = image.to_string_lossy().into_owned();
        raw.run(&["checkpoint", "--image-path", &img, id])?;
        raw.delete(id);
        let t = Instant::now();
        raw.detach(&[
            "restore",
            "--detach",
            "--image-path",
            &img,
            "--bundle",
            &b,
            id,
        ])?;
        raw.exec_true(id)?;
        r.resume.push(ms(t.elapsed()));
        let _ = std::fs::remove_dir_all(&image);
    }
    Ok(())
}
