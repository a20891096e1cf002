//! `kiln bench create`'s run, on its own gVisor driver and manager: sandbox create → first `echo` output, sequential and concurrent, against
//! the raw floor measured in the same run (`runsc run` of the same rootfs printing `echo`).

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kiln_gvisor::{GvisorConfig, GvisorDriver};
use kiln_server::manager::{CreateParams, LifecycleConfig, Manager};
use kiln_server::store::SqliteStore;
use kiln_server::templates::Templates;

use super::stats::{median, percentiles, Percentiles};

#[derive(Debug, Clone)]
pub struct CreateBenchOptions {
    pub template: String,
    /// Sequential creates.
    pub sequential: usize,
    /// Concurrent creates (one wave).
    pub concurrency: usize,
    /// Raw `runsc run` samples.
    pub raw: usize,
    pub platform: String,
    /// Where the bench keeps its sandboxes (a fresh temp dir inside it).
    pub work_dir: std::path::PathBuf,
    /// runsc binary (default: what [`GvisorConfig::new`] finds).
    pub runsc: Option<std::path::PathBuf>,
    /// An older runsc to compare the workload with (e.g. the host's 2022 `/usr/bin/runsc`).
    pub old_runsc: Option<std::path::PathBuf>,
    /// Rounds of the in-sandbox workload per variant (0: skip the workload part).
    pub workload_rounds: usize,
    /// Disk quota of the bench's sandboxes, MiB (0: no quota, the writable layer on the host's
    /// filesystem), as `kiln serve --disk-mb`.
    pub disk_mb: u32,
}

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
    fn argv(self) -> Vec<String> {
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
    /// Raw floor, login shell: `runsc run` → first output line.
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
    /// The in-sandbox workload under each runsc/platform variant.
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

/// uid, gid and home of `user` in the rootfs's /etc/passwd.
fn passwd_entry(rootfs: &Path, user: &str) -> Option<(u32, u32, String)> {
    let text = std::fs::read_to_string(rootfs.join("etc/passwd")).ok()?;
    text.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        (f.len() >= 6 && f[0] == user)
            .then(|| Some((f[2].parse().ok()?, f[3].parse().ok()?, f[5].to_string())))?
    })
}

/// Writes an OCI bundle at `bundle` running `argv` on `tpl`'s rootfs (read-only, no overlay,
/// no cgroup limits, no agent) as the template's user in its workdir: the raw runsc baseline.
pub(crate) fn raw_bundle(
    bundle: &Path,
    tpl: &kiln_server::templates::TemplateInfo,
    argv: Vec<String>,
) -> Result<(), String> {
    std::fs::create_dir_all(bundle).map_err(|e| e.to_string())?;
    let (uid, gid, home) =
        passwd_entry(&tpl.rootfs, &tpl.user).unwrap_or((0, 0, "/root".to_string()));
    let spec = serde_json::json!({
        "ociVersion": "1.0.2",
        "process": {"terminal": false, "user": {"uid": uid, "gid": gid},
                    "args": argv,
                    "env": ["PATH=/usr/local/bin:/usr/bin:/bin", format!("HOME={home}"),
                            format!("USER={}", tpl.user)],
                    "cwd": tpl.workdir},
        "root": {"path": tpl.rootfs, "readonly": true},
        "hostname": "raw",
        "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"}],
        "linux": {"namespaces": [{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}, {"type": "network"}]}
    });
    std::fs::write(bundle.join("config.json"), spec.to_string()).map_err(|e| e.to_string())
}

/// Raw floor: `runsc run` (same runsc, platform and network flags as kiln) of the template's
/// rootfs (read-only, no overlay, no cgroup limits, no agent) running `what` as the template's
/// user in its workdir; timed from spawning runsc to the first stdout line (the container's
/// teardown after that is not timed, as kiln's is not either).
pub(crate) fn raw_runsc_echo(
    runsc: &Path,
    work: &Path,
    tpl: &kiln_server::templates::TemplateInfo,
    platform: &str,
    what: EchoCommand,
    i: usize,
) -> Result<Duration, String> {
    use std::io::BufRead;
    let bundle = work.join(format!("raw-{i}"));
    raw_bundle(&bundle, tpl, what.argv())?;
    let root = work.join("raw-runsc-root");
    let id = format!("kiln-bench-raw-{}-{i}", std::process::id());
    let t = Instant::now();
    let mut child = std::process::Command::new(runsc)
        .arg(format!("--root={}", root.display()))
        .arg(format!("--platform={platform}"))
        .arg("--network=none")
        .args(["run", "--bundle"])
        .arg(&bundle)
        .arg(&id)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| format!("running runsc: {e}"))?;
    let mut line = String::new();
    let read = std::io::BufReader::new(child.stdout.take().expect("piped")).read_line(&mut line);
    let took = t.elapsed();
    let out = child
        .wait_with_output()
        .map_err(|e| format!("waiting for runsc: {e}"))?;
    if read.is_err() || line.trim() != "kiln-bench" {
        return Err(format!(
            "raw runsc run printed {line:?} (stderr {:?})",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(took)
}

/// Runs the benchmark, printing progress to stderr. Raw and kiln samples are interleaved so
/// both see the same machine load.
pub async fn create_bench(
    opts: &CreateBenchOptions,
    templates: Arc<dyn Templates>,
) -> Result<CreateBenchReport, String> {
    let tpl = templates
        .lookup(&opts.template)
        .map_err(|e| e.to_string())?
        .ok_or_else(|| format!("template {:?} is not built", opts.template))?;
    std::fs::create_dir_all(&opts.work_dir).map_err(|e| e.to_string())?;
    // Short names: agent socket paths under the work dir must fit in 108 bytes.
    let work = tempfile::Builder::new()
        .prefix("b")
        .rand_bytes(4)
        .tempdir_in(&opts.work_dir)
        .map_err(|e| e.to_string())?;
    let store =
        Arc::new(SqliteStore::open(&work.path().join("kiln.db")).map_err(|e| e.to_string())?);
    let mut gcfg = GvisorConfig::new(work.path());
    gcfg.platform = opts.platform.clone();
    if let Some(r) = &opts.runsc {
        gcfg.runsc = r.clone();
    }
    let runsc = gcfg.runsc.clone();
    let driver = Arc::new(GvisorDriver::new(gcfg).map_err(|e| e.to_string())?);
    let lifecycle = LifecycleConfig {
        default_disk_mb: opts.disk_mb,
        ..LifecycleConfig::default()
    };
    let manager = Manager::new(lifecycle, store, driver, templates);

    let raw = |what: EchoCommand, i: usize| {
        let (r, w, t, p) = (
            runsc.clone(),
            work.path().to_path_buf(),
            tpl.clone(),
            opts.platform.clone(),
        );
        async move {
            tokio::task::spawn_blocking(move || raw_runsc_echo(&r, &w, &t, &p, what, i))
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
             {} × raw runsc run …",
            opts.sequential, opts.raw
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
            let (r, o, w, t, n) = (
                runsc.clone(),
                opts.old_runsc.clone(),
                work.path().to_path_buf(),
                tpl.clone(),
                opts.workload_rounds,
            );
            tokio::task::spawn_blocking(move || workload_bench(&r, o.as_deref(), &w, &t, n))
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

/// One runsc/platform variant of the workload: medians over the rounds.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkloadResult {
    /// `new` (kiln's runsc) or `old` (the comparison binary).
    pub runsc: String,
    pub version: String,
    pub platform: String,
    /// Median wall time of [`FORK_EXEC_LOOPS`] fork+exec of `/bin/true`, ms.
    pub fork_exec_ms: f64,
    /// Median wall time of [`PYTHON_STARTS`] `python3 -c 'import json'`, ms.
    pub python_ms: f64,
    pub rounds: usize,
}

/// Runs the workload once with `runsc`/`platform` on the template rootfs (read-only) under
/// `shell` (`/bin/sh` or `/bin/bash`: a fork in bash costs about three times one in dash under
/// gVisor, so compare like with like); returns (fork+exec ms, python ms).
pub(crate) fn workload_once(
    runsc: &Path,
    platform: &str,
    work: &Path,
    tpl: &kiln_server::templates::TemplateInfo,
    shell: &str,
    i: usize,
) -> Result<(f64, f64), String> {
    let bundle = work.join(format!("workload-{i}"));
    std::fs::create_dir_all(&bundle).map_err(|e| e.to_string())?;
    let spec = serde_json::json!({
        "ociVersion": "1.0.2",
        "process": {"terminal": false, "user": {"uid": 0, "gid": 0},
                    "args": [shell, "-c", workload_script()],
                    "env": ["PATH=/usr/local/bin:/usr/bin:/bin"], "cwd": "/"},
        "root": {"path": tpl.rootfs, "readonly": true},
        "hostname": "workload",
        "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"},
                   {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs"}],
        "linux": {"namespaces": [{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}, {"type": "network"}]}
    });
    std::fs::write(bundle.join("config.json"), spec.to_string()).map_err(|e| e.to_string())?;
    let out = std::process::Command::new(runsc)
        .arg(format!("--root={}", work.join("workload-root").display()))
        .arg(format!("--platform={platform}"))
        .args(["--network=none", "--ignore-cgroups", "run", "--bundle"])
        .arg(&bundle)
        .arg(format!("kiln-bench-wl-{}-{i}", std::process::id()))
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| format!("running {}: {e}", runsc.display()))?;
    let _ = std::fs::remove_dir_all(&bundle);
    let stamps: Vec<u128> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    if !out.status.success() || stamps.len() != 3 {
        return Err(format!(
            "workload under {} --platform={platform} failed ({}): stdout {:?} stderr {:?}",
            runsc.display(),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(workload_times(&stamps))
}

/// (fork+exec ms, python ms) from the three stamps (ns) [`workload_script`] prints.
pub(crate) fn workload_times(stamps: &[u128]) -> (f64, f64) {
    let ms = |a: u128, b: u128| b.saturating_sub(a) as f64 / 1e6;
    (ms(stamps[0], stamps[1]), ms(stamps[1], stamps[2]))
}

/// The workload under kiln's runsc with systrap and ptrace, and under `old` with ptrace when
/// given; rounds are interleaved across variants so all see the same machine load.
pub fn workload_bench(
    runsc: &Path,
    old: Option<&Path>,
    work: &Path,
    tpl: &kiln_server::templates::TemplateInfo,
    rounds: usize,
) -> Result<Vec<WorkloadResult>, String> {
    let version = |p: &Path| {
        kiln_host::runsc::probe_version(p)
            .map(|(v, _)| v.to_string())
            .unwrap_or_else(|e| e.to_string())
    };
    let mut variants = vec![
        ("new", runsc.to_path_buf(), "systrap"),
        ("new", runsc.to_path_buf(), "ptrace"),
    ];
    if let Some(o) = old {
        variants.push(("old", o.to_path_buf(), "ptrace"));
    }
    eprintln!(
        "workload: {rounds} round(s) × {} variant(s) of {FORK_EXEC_LOOPS} fork+exec and \
         {PYTHON_STARTS} python3 starts …",
        variants.len()
    );
    let mut samples: Vec<(Vec<f64>, Vec<f64>)> = vec![(Vec::new(), Vec::new()); variants.len()];
    for round in 0..rounds {
        for (k, (_, bin, platform)) in variants.iter().enumerate() {
            let (f, p) = workload_once(bin, platform, work, tpl, "/bin/sh", round * 10 + k)?;
            samples[k].0.push(f);
            samples[k].1.push(p);
        }
    }
    Ok(variants
        .into_iter()
        .zip(samples)
        .map(|((name, bin, platform), (mut f, mut p))| WorkloadResult {
            runsc: name.to_string(),
            version: version(&bin),
            platform: platform.to_string(),
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
