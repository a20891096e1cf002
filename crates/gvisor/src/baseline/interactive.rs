//! The raw counterparts of an interactive sandbox's figures, on one idle container (`sleep`
//! in a bundle of the image):
//! - exec round trip: `runsc exec` of the given command in the running container;
//! - pause → resume → first command: `runsc checkpoint`, then `runsc restore` + `runsc exec
//!   true` (the restore and first command timed, as kiln's resume is);
//! - fork → child's first command: `runsc checkpoint --leave-running` + `runsc restore` under a
//!   new id + `runsc exec true`;
//! - idle MiB: the PSS of the idle container's runsc processes.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use kiln_driver::baseline::{InteractiveReport, RawImage};

use super::{write_bundle, GvisorBaseline};

struct Raw<'a> {
    base: &'a GvisorBaseline,
    root: PathBuf,
}

impl Raw<'_> {
    fn cmd(&self) -> Command {
        self.base.command(&self.root)
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

    /// Checkpoints container `id` into a fresh `image` and restores it from there, then runs
    /// a first command in it. A fork leaves `id` running and restores as `child`, timed from
    /// the checkpoint; otherwise `id` is deleted and restored under its own id, timed from the
    /// restore. Either way until the first command's end.
    fn cycle(
        &self,
        id: &str,
        image: &Path,
        bundle: &str,
        fork: Option<&str>,
    ) -> Result<Duration, String> {
        std::fs::create_dir_all(image).map_err(|e| e.to_string())?;
        let img = image.to_string_lossy().into_owned();
        if let Some(child) = fork {
            let t = Instant::now();
            self.run(&["checkpoint", "--leave-running", "--image-path", &img, id])?;
            let restored = self
                .detach(&restore(&img, bundle, child))
                .and_then(|()| self.exec_true(child));
            let took = t.elapsed();
            self.delete(child);
            let _ = std::fs::remove_dir_all(image);
            restored.map(|()| took)
        } else {
            self.run(&["checkpoint", "--image-path", &img, id])?;
            self.delete(id);
            let t = Instant::now();
            self.detach(&restore(&img, bundle, id))?;
            self.exec_true(id)?;
            let took = t.elapsed();
            let _ = std::fs::remove_dir_all(image);
            Ok(took)
        }
    }
}

fn restore<'a>(img: &'a str, bundle: &'a str, id: &'a str) -> [&'a str; 7] {
    [
        "restore",
        "--detach",
        "--image-path",
        img,
        "--bundle",
        bundle,
        id,
    ]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Measures the raw counterparts on one idle container under `work` (removed by the caller).
pub(super) fn measure(
    base: &GvisorBaseline,
    work: &Path,
    image: &RawImage,
    exec_argv: &[String],
    runs: usize,
    rounds: usize,
) -> InteractiveReport {
    let mut r = InteractiveReport::default();
    let raw = Raw {
        base,
        root: work.join("raw-runsc-root"),
    };
    let id = format!("kiln-tti-raw-{}", std::process::id());
    let bundle = work.join("raw-idle");
    let sleep = ["/bin/sleep".to_string(), "3600".to_string()];
    let b = bundle.to_string_lossy().into_owned();
    let started = write_bundle(&bundle, image, &sleep)
        .map_err(|e| e.to_string())
        .and_then(|()| raw.detach(&["run", "--detach", "--bundle", &b, &id]));
    if let Err(e) = started {
        r.errors.push(format!("raw idle container: {e}"));
        return r;
    }
    if let Err(e) = exec_and_idle(&raw, &id, exec_argv, runs, &mut r) {
        r.errors.push(e);
    }
    let fork = (0..rounds).try_for_each(|i| {
        let took = raw.cycle(
            &id,
            &work.join(format!("raw-fork-{i}")),
            &b,
            Some(&format!("{id}-c{i}")),
        )?;
        r.fork.push(ms(took));
        Ok::<_, String>(())
    });
    if let Err(e) = fork {
        r.errors.push(format!("raw fork: {e}"));
    }
    let resume = (0..rounds).try_for_each(|i| {
        let took = raw.cycle(&id, &work.join(format!("raw-ckpt-{i}")), &b, None)?;
        r.resume.push(ms(took));
        Ok::<_, String>(())
    });
    if let Err(e) = resume {
        r.errors.push(format!("raw checkpoint/restore: {e}"));
    }
    raw.delete(&id);
    r
}

fn exec_and_idle(
    raw: &Raw<'_>,
    id: &str,
    exec_argv: &[String],
    runs: usize,
    r: &mut InteractiveReport,
) -> Result<(), String> {
    let mut args = vec!["exec", id];
    args.extend(exec_argv.iter().map(String::as_str));
    raw.run(&args)?; // warm-up
    for _ in 0..runs {
        let t = Instant::now();
        raw.run(&args)?;
        r.exec.push(ms(t.elapsed()));
    }
    std::thread::sleep(Duration::from_secs(1));
    let u = super::runsc_usage(&raw.root);
    if u.processes > 0 {
        r.idle_mib = Some(u.pss_kib as f64 / 1024.0);
    }
    Ok(())
}
