//! `kiln bench create`'s run, on its own driver and manager: sandbox create → first `echo`
//! output, sequential and concurrent, against the raw floor measured in the same run (the
//! runtime's raw run of the same rootfs printing `echo`, see [`RawBaseline::first_line`]).

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kiln_driver::baseline::{RawBaseline, RawImage};
use kiln_server::manager::{CreateParams, LifecycleConfig, Manager};
use kiln_server::store::SqliteStore;
use kiln_server::templates::{TemplateInfo, Templates};

use super::stats::{median, percentiles, Percentiles};
use crate::drivers::BenchRuntime;

#[derive(Debug, Clone)]
pub struct CreateBenchOptions {
    pub template: String,
    /// Sequential creates.
    pub sequential: usize,
    /// Concurrent creates (one wave).
    pub concurrency: usize,
    /// Raw samples.
    pub raw: usize,
    /// Rounds of the in-sandbox workload per variant (0: skip the workload part).
    pub workload_rounds: usize,
    /// Disk quota of the bench's sandboxes, MiB (0: no quota, the writable layer on the host's
    /// filesystem), as `kiln serve --disk-mb`.
    pub disk_mb: u32,
}

/// The runtime variants the workload runs under, by name (see
/// [`BenchRuntime::workload_variants`]).
pub type Variants = Vec<(&'static str, Arc<dyn RawBaseline>)>;

/// What a sandbox runs for the measured output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EchoCommand {
    /// `/bin/bash -l -c "echo kiln-bench"` as the template's user: what the e2b SDK's
    /// `commands.run("echo kiln-bench")` sends.
    LoginShell,
    /// `/bin/echo kiln-bench` executed directly (no shell start-up).
    Exec,
}

impl EchoCommand {
    pub(crate) fn argv(self) -> Vec<String> {
        match self {
            EchoCommand::LoginShell => vec![
                "/bin/bash".into(),
                "-l".into(),
                "-c".into(),
                "echo kiln-bench".into(),
            ],
            EchoCommand::Exec => vec!["/bin/echo".into(), "kiln-bench".into()],
        }
    }
}

#[derive(Debug, Clone)]
pub struct CreateBenchReport {
    /// Raw floor, login shell: the runtime's raw run → first output line.
    pub raw_shell: Percentiles,
    /// Raw floor, direct exec.
    pub raw_exec: Percentiles,
    /// kiln create → first output of the login-shell echo (the SDK path), sequential.
    pub sequential: Percentiles,
    /// kiln create → first output of the directly executed echo, sequential.
    pub sequential_exec: Percentiles,
    /// kiln create → first output of the login-shell echo, all at once.
    pub concurrent: Percentiles,
    /// Killing a running sandbox (sequential part).
    pub kill: Percentiles,
    /// The in-sandbox workload under each runtime variant.
    pub workload: Vec<WorkloadResult>,
}

/// Creates a sandbox and runs `what` in it through the agent; returns the time from the create
/// call to the first stdout bytes, and the sandbox id.
async fn create_and_echo(
    m: &Manager,
    template: &str,
    what: EchoCommand,
) -> Result<(Duration, String), String> {
    use kiln_proto::process::{self as pb, process_event};
    use prost::Message;
    let t = Instant::now();
    let rec = m
        .create(CreateParams {
            template_id: template.to_string(),
            timeout_secs: Some(600),
            secure: true,
            ..Default::default()
        })
        .await
        .map_err(|e| e.to_string())?;
    let route = m.route(&rec.id).ok_or("sandbox vanished")?;
    let agent = m.agent(&rec.id, route.envd_token.clone());
    let mut argv = what.argv();
    let cmd = argv.remove(0);
    let req = pb::StartRequest {
        process: Some(pb::ProcessConfig {
            cmd,
            args: argv,
            envs: Default::default(),
            cwd: None,
        }),
        pty: None,
        tag: None,
        stdin: Some(false),
    };
    let mut stream = agent
        .server_stream(
            "/process.Process/Start",
            &req,
            None,
            route.envd_token.as_deref(),
            Some(Duration::from_secs(60)),
        )
        .await
        .map_err(|e| format!("echo in {}: {e}", rec.id))?;
    let mut first = None;
    let mut stdout = Vec::new();
    loop {
        let msg = stream
            .next_message()
            .await
            .map_err(|e| format!("echo in {}: {e}", rec.id))?
            .ok_or_else(|| format!("echo in {}: stream ended without an end event", rec.id))?;
        let resp = pb::StartResponse::decode(msg).map_err(|e| e.to_string())?;
        match resp.event.and_then(|e| e.event) {
            Some(process_event::Event::Data(d)) => {
                if let Some(process_event::data_event::Output::Stdout(b)) = d.output {
                    first.get_or_insert_with(|| t.elapsed());
                    stdout.extend_from_slice(&b);
                }
            }
            Some(process_event::Event::End(_)) => break,
            _ => {}
        }
    }
    if stdout != b"kiln-bench\n" {
        return Err(format!(
            "unexpected echo output {:?}",
            String::from_utf8_lossy(&stdout)
        ));
    }
    Ok((first.unwrap_or_else(|| t.elapsed()), rec.id))
}

/// The template's rootfs as the raw baseline boots it.
pub(crate) fn raw_image(tpl: &TemplateInfo) -> RawImage {
    RawImage {
        rootfs: tpl.rootfs.clone(),
        user: tpl.user.clone(),
        workdir: tpl.workdir.clone(),
    }
}

/// Runs the benchmark on `runtime` in `work` (a fresh directory), printing progress to
/// stderr. Raw and kiln samples are interleaved so both see the same machine load.
pub async fn create_bench(
    opts: &CreateBenchOptions,
    runtime: &BenchRuntime,
    variants: Variants,
    work: &Path,
    templates: Arc<dyn Templates>,
) -> Result<CreateBenchReport, String> {
    let tpl = templates
        .lookup(&opts.template)
        .map_err(|e| e.to_string())?
        .ok_or_else(|| format!("template {:?} is not built", opts.template))?;
    let store = Arc::new(SqliteStore::open(&work.join("kiln.db")).map_err(|e| e.to_string())?);
    let driver = runtime
        .driver(&runtime.driver_config(), work)
        .map_err(|e| e.to_string())?
        .driver;
    let baseline = runtime.baseline();
    let image = raw_image(&tpl);
    let lifecycle = LifecycleConfig {
        default_disk_mb: opts.disk_mb,
        ..LifecycleConfig::default()
    };
    let manager = Manager::new(lifecycle, store, driver, templates);

    let raw = |what: EchoCommand, i: usize| {
        let (b, w, img) = (baseline.clone(), work.to_path_buf(), image.clone());
        async move {
            tokio::task::spawn_blocking(move || {
                b.first_line(&w, &img, &what.argv(), "kiln-bench", i)
                    .map_err(|e| e.to_string())
            })
            .await
            .map_err(|e| e.to_string())?
        }
    };

    let result = async {
        // Warm-up (page cache, binaries), not counted.
        let (_, id) = create_and_echo(&manager, &opts.template, EchoCommand::LoginShell).await?;
        let _ = manager.kill(&id, "bench").await;
        raw(EchoCommand::LoginShell, 0).await?;

        eprintln!(
            "sequential: {} × kiln create → echo (login shell and direct exec), interleaved with \
             {} × raw {} run …",
            opts.sequential,
            opts.raw,
            baseline.tool()
        );
        let (mut seq, mut seq_exec, mut kill) = (Vec::new(), Vec::new(), Vec::new());
        let (mut raw_shell, mut raw_exec) = (Vec::new(), Vec::new());
        for i in 0..opts.sequential.max(opts.raw) {
            if i < opts.raw {
                raw_shell.push(raw(EchoCommand::LoginShell, 2 * i + 1).await?);
                raw_exec.push(raw(EchoCommand::Exec, 2 * i + 2).await?);
            }
            if i < opts.sequential {
                for (what, samples) in [
                    (EchoCommand::LoginShell, &mut seq),
                    (EchoCommand::Exec, &mut seq_exec),
                ] {
                    let (d, id) = create_and_echo(&manager, &opts.template, what).await?;
                    samples.push(d);
                    // What `DELETE /sandboxes/{id}` does: answer, tear down in the background.
                    let t = Instant::now();
                    let _ = manager.kill_detached(&id, "bench").await;
                    kill.push(t.elapsed());
                }
            }
        }

        eprintln!("concurrent: {} creates at once …", opts.concurrency);
        let m = manager.clone();
        let futs = (0..opts.concurrency).map(|_| {
            let m = m.clone();
            let t = opts.template.clone();
            async move { create_and_echo(&m, &t, EchoCommand::LoginShell).await }
        });
        let results = futures::future::join_all(futs).await;
        let mut conc = Vec::new();
        let mut first_err = None;
        for r in results {
            match r {
                Ok((d, id)) => {
                    conc.push(d);
                    let _ = manager.kill(&id, "bench").await;
                }
                Err(e) => first_err = first_err.or(Some(e)),
            }
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        let workload = if opts.workload_rounds > 0 {
            let (w, r, n) = (work.to_path_buf(), tpl.rootfs.clone(), opts.workload_rounds);
            tokio::task::spawn_blocking(move || workload_bench(&variants, &w, &r, n))
                .await
                .map_err(|e| e.to_string())??
        } else {
            Vec::new()
        };
        Ok(CreateBenchReport {
            workload,
            raw_shell: percentiles(&raw_shell),
            raw_exec: percentiles(&raw_exec),
            sequential: percentiles(&seq),
            sequential_exec: percentiles(&seq_exec),
            concurrent: percentiles(&conc),
            kill: percentiles(&kill),
        })
    }
    .await;
    manager.kill_all("bench done").await;
    manager.shutdown_driver().await;
    result
}

/// The in-sandbox workload: a fork+exec loop and Python start-ups, timed inside the sandbox
/// (`date +%s%N` around each part), so sandbox start-up is not part of the number.
const FORK_EXEC_LOOPS: u32 = 200;
const PYTHON_STARTS: u32 = 5;

pub(crate) fn workload_script() -> String {
    format!(
        "date +%s%N; i=0; while [ $i -lt {FORK_EXEC_LOOPS} ]; do /bin/true; i=$((i+1)); done; \
         date +%s%N; j=0; while [ $j -lt {PYTHON_STARTS} ]; do python3 -c 'import json'; \
         j=$((j+1)); done; date +%s%N"
    )
}

/// One runtime variant of the workload: medians over the rounds.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkloadResult {
    /// `new` (kiln's runtime) or `old` (the comparison binary).
    pub variant: String,
    /// The runtime's tool, its version and its platform.
    pub tool: String,
    pub version: String,
    pub platform: String,
    /// Median wall time of [`FORK_EXEC_LOOPS`] fork+exec of `/bin/true`, ms.
    pub fork_exec_ms: f64,
    /// Median wall time of [`PYTHON_STARTS`] `python3 -c 'import json'`, ms.
    pub python_ms: f64,
    pub rounds: usize,
}

/// Runs the workload once under `raw` on `rootfs` (read-only) under `shell` (`/bin/sh` or
/// `/bin/bash`: a fork in bash costs about three times one in dash in a sandbox, so compare
/// like with like); returns (fork+exec ms, python ms).
pub(crate) fn workload_once(
    raw: &dyn RawBaseline,
    work: &Path,
    rootfs: &Path,
    shell: &str,
    i: usize,
) -> Result<(f64, f64), String> {
    let out = raw
        .script(work, rootfs, shell, &workload_script(), i)
        .map_err(|e| format!("workload: {e}"))?;
    let stamps: Vec<u128> = String::from_utf8_lossy(&out)
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    if stamps.len() != 3 {
        return Err(format!(
            "workload under {} {} --platform={} printed {:?}",
            raw.tool(),
            raw.version(),
            raw.platform(),
            String::from_utf8_lossy(&out)
        ));
    }
    Ok(workload_times(&stamps))
}

/// (fork+exec ms, python ms) from the three stamps (ns) [`workload_script`] prints.
pub(crate) fn workload_times(stamps: &[u128]) -> (f64, f64) {
    let ms = |a: u128, b: u128| b.saturating_sub(a) as f64 / 1e6;
    (ms(stamps[0], stamps[1]), ms(stamps[1], stamps[2]))
}

/// The workload under each variant; rounds are interleaved across variants so all see the
/// same machine load.
pub fn workload_bench(
    variants: &Variants,
    work: &Path,
    rootfs: &Path,
    rounds: usize,
) -> Result<Vec<WorkloadResult>, String> {
    eprintln!(
        "workload: {rounds} round(s) × {} variant(s) of {FORK_EXEC_LOOPS} fork+exec and \
         {PYTHON_STARTS} python3 starts …",
        variants.len()
    );
    let mut samples: Vec<(Vec<f64>, Vec<f64>)> = vec![(Vec::new(), Vec::new()); variants.len()];
    for round in 0..rounds {
        for (k, (_, raw)) in variants.iter().enumerate() {
            let (f, p) = workload_once(raw.as_ref(), work, rootfs, "/bin/sh", round * 10 + k)?;
            samples[k].0.push(f);
            samples[k].1.push(p);
        }
    }
    Ok(variants
        .iter()
        .zip(samples)
        .map(|((name, raw), (mut f, mut p))| WorkloadResult {
            variant: name.to_string(),
            tool: raw.tool().to_string(),
            version: raw.version(),
            platform: raw.platform().to_string(),
            fork_exec_ms: median(&mut f),
            python_ms: median(&mut p),
            rounds,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workload_script_prints_three_stamps_outside_a_sandbox() {
        let out = std::process::Command::new("/bin/sh")
            .args(["-c", &workload_script()])
            .output()
            .unwrap();
        assert!(out.status.success());
        let stamps: Vec<u128> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect();
        assert_eq!(stamps.len(), 3, "{out:?}");
        assert!(stamps[0] <= stamps[1] && stamps[1] <= stamps[2]);
    }
}
