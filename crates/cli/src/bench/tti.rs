//! `kiln bench tti`: ComputeSDK's time-to-interactive benchmark against a `kiln serve` of this
//! host, through the pinned `e2b` Python SDK (`tti.py`, run with `--python`/`$KILN_PYTHON`):
//! create → first `echo` in the sequential, staggered and burst modes, summarised and scored as
//! ComputeSDK does (`tti_stats.rs`) and written in its JSON shape (`--json`); then the SDK's
//! `commands.run("true")` round trip, pause → resume → first command, fork → child's first
//! command and idle MiB per sandbox, each beside its counterpart on the raw runtime
//! ([`kiln_driver::baseline::RawBaseline::interactive`]) measured in the same run; and a
//! sandbox at work while creates beside it make the warm pool refill, beside the same work
//! alone. The server is this binary's `kiln serve` with its defaults (warm pool included)
//! plus any `--serve-arg`.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::{json, Value};

use super::create_bench::{raw_image, EchoCommand};
use super::tti_stats::{r2, result_entry, summarize, Summary};
use crate::drivers::BenchRuntime;
use kiln_driver::baseline::{InteractiveReport, RawBaseline};
use kiln_server::templates::TemplateInfo;

#[derive(clap::Args)]
pub struct Args {
    /// Sandboxes per mode (ComputeSDK: 100).
    #[arg(long, default_value_t = 100)]
    n: usize,
    /// Modes to run, comma-separated: sequential, staggered, burst.
    #[arg(long, default_value = "sequential,staggered,burst")]
    modes: String,
    /// Milliseconds between two launches of the staggered mode.
    #[arg(long, default_value_t = 200.0)]
    stagger_ms: f64,
    /// Template the sandboxes start from.
    #[arg(long, default_value = "base")]
    template: String,
    /// `commands.run("true")` round trips (and raw execs).
    #[arg(long, default_value_t = 40)]
    runs: usize,
    /// Pause/resume and fork rounds (and raw checkpoint/restore rounds).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Idle sandboxes held while their memory is measured (0 skips it).
    #[arg(long, default_value_t = 10)]
    idle: usize,
    /// Seconds a sandbox runs a CPU task over and over alone, then as long again while other
    /// creates (two a second) make the warm pool refill beside it (0 skips it).
    #[arg(long, default_value_t = 15.0)]
    busy_secs: f64,
    /// Raw create → echo samples.
    #[arg(long, default_value_t = 10)]
    raw: usize,
    /// Write ComputeSDK's result JSON (plus kiln's other figures under "kiln") here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Python with the pinned e2b SDK installed.
    #[arg(long, env = "KILN_PYTHON", default_value = "python3")]
    python: PathBuf,
    /// Extra `kiln serve` flag for the measured server (repeatable), e.g. `--serve-arg=--pool-off`.
    #[arg(long = "serve-arg", allow_hyphen_values = true)]
    serve_args: Vec<String>,
    #[command(flatten)]
    rt: super::RuntimeArgs,
}

/// A `kiln serve` child; SIGTERM (then SIGKILL) when dropped.
struct Serve {
    child: Child,
    url: String,
    key: String,
}

impl Drop for Serve {
    fn drop(&mut self) {
        // SAFETY: kill(2) on the pid of a child this process spawned and has not reaped yet.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(30) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_serve(a: &Args, state: &Path, runtime: &BenchRuntime) -> anyhow::Result<Serve> {
    let log_path = state.with_extension("log");
    let log = std::fs::File::create(&log_path)?;
    let child = Command::new(std::env::current_exe()?)
        .args([
            "serve",
            "--no-prepare",
            "--listen",
            "127.0.0.1:0",
            "--state-dir",
        ])
        .arg(state)
        .args(&a.serve_args)
        .envs(runtime.serve_env())
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .context("starting kiln serve")?;
    let mut serve = Serve {
        child,
        url: String::new(),
        key: String::new(),
    };
    let t = Instant::now();
    loop {
        let text = std::fs::read_to_string(&log_path).unwrap_or_default();
        let after = |k: &str| {
            text.lines()
                .find_map(|l| l.split_once(k).map(|(_, v)| v.trim().to_string()))
        };
        if let (Some(url), Some(key), true) = (
            after("listening on "),
            after("first API key (shown once, store it now): "),
            text.contains("SDK settings"),
        ) {
            serve.url = url;
            serve.key = key;
            return Ok(serve);
        }
        if let Ok(Some(st)) = serve.child.try_wait() {
            bail!("kiln serve exited ({st}):\n{text}");
        }
        if t.elapsed() > Duration::from_secs(60) {
            bail!("kiln serve did not start within 60 s:\n{text}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Runs the SDK client; answers its idle-ready line with the kiln sandboxes' PSS per sandbox.
fn run_client(
    a: &Args,
    work: &Path,
    serve: &Serve,
    state: &Path,
    raw: &dyn RawBaseline,
) -> anyhow::Result<(Value, f64)> {
    let script = work.join("tti.py");
    std::fs::write(&script, include_str!("tti.py"))?;
    let mut child = Command::new(&a.python)
        .arg(&script)
        .env("E2B_API_URL", &serve.url)
        .env("E2B_SANDBOX_URL", &serve.url)
        .env("E2B_API_KEY", &serve.key)
        .env("TTI_N", a.n.to_string())
        .env("TTI_MODES", &a.modes)
        .env("TTI_STAGGER_MS", a.stagger_ms.to_string())
        .env("TTI_TEMPLATE", &a.template)
        .env("TTI_RUNS", a.runs.to_string())
        .env("TTI_ROUNDS", a.rounds.to_string())
        .env("TTI_IDLE", a.idle.to_string())
        .env("TTI_BUSY_S", a.busy_secs.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {} (the e2b SDK's python)", a.python.display()))?;
    let stdout = std::io::BufReader::new(child.stdout.take().context("client stdout")?);
    let (mut last, mut idle_mib) = (String::new(), f64::NAN);
    for line in stdout.lines() {
        let line = line?;
        if line.starts_with("idle-ready ") {
            std::thread::sleep(Duration::from_secs(1));
            let u = raw.usage(state);
            let sandboxes = crate::drivers::sandboxes_on_disk(state);
            if sandboxes > 0 {
                idle_mib = u.pss_kib as f64 / 1024.0 / sandboxes as f64;
            }
            eprintln!(
                "idle: {sandboxes} sandboxes (held and pooled), {:.0} MiB PSS in all",
                u.pss_kib as f64 / 1024.0
            );
            if let Some(stdin) = child.stdin.as_mut() {
                writeln!(stdin)?;
            }
        } else if !line.trim().is_empty() {
            last = line;
        }
    }
    let st = child.wait()?;
    if !st.success() {
        bail!("the SDK client failed ({st})");
    }
    let v: Value = serde_json::from_str(&last).context("the SDK client's result")?;
    Ok((v, idle_mib))
}

/// The raw runtime's create → echo samples (ms), then its counterparts of the other figures
/// on one idle container, in `work`.
fn raw_counterparts(
    a: &Args,
    raw: &dyn RawBaseline,
    tpl: &TemplateInfo,
    work: &Path,
) -> (Vec<f64>, InteractiveReport) {
    let image = raw_image(tpl);
    let mut tti = Vec::new();
    let mut errors = Vec::new();
    for i in 0..a.raw {
        match raw.first_line(
            work,
            &image,
            &EchoCommand::LoginShell.argv(),
            "kiln-bench",
            i,
        ) {
            Ok(d) => tti.push(d.as_secs_f64() * 1000.0),
            Err(e) => errors.push(format!("raw create → echo: {e}")),
        }
    }
    let login_true = ["/bin/bash", "-l", "-c", "true"].map(String::from);
    let mut r = raw.interactive(work, &image, &login_true, a.runs, a.rounds);
    errors.append(&mut r.errors);
    r.errors = errors;
    (tti, r)
}

/// A mode's host CPU per successful sandbox, from the client's `cpu` report.
struct CpuCost {
    /// Host busy time outside the SDK client, ms per sandbox (server, runtime, sandboxes).
    server_ms: f64,
    /// The SDK client's own, ms per sandbox (on ComputeSDK's runs, another machine's).
    client_ms: f64,
    cores: usize,
}

impl CpuCost {
    /// Sandboxes a second the host's cores can make at this cost.
    fn per_second(&self) -> f64 {
        self.cores as f64 * 1000.0 / self.server_ms
    }

    /// About when a burst of `n` has its first half done: n/2 sandboxes' CPU spread over every
    /// core (the client's own CPU not counted).
    fn median_floor_ms(&self, n: usize) -> f64 {
        (n as f64 / 2.0) * self.server_ms / self.cores as f64
    }
}

fn cpu_per_sandbox(mode: &Value, ok: usize) -> Option<CpuCost> {
    let (busy, client) = (
        mode["cpu"]["hostBusyS"].as_f64()?,
        mode["cpu"]["clientS"].as_f64()?,
    );
    if ok == 0 {
        return None;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    Some(CpuCost {
        server_ms: (busy - client).max(0.0) * 1000.0 / ok as f64,
        client_ms: client * 1000.0 / ok as f64,
        cores,
    })
}

fn ms_list(v: &Value) -> Vec<f64> {
    v.as_array()
        .map(|a| a.iter().filter_map(Value::as_f64).collect())
        .unwrap_or_default()
}

fn line(what: &str, kiln: &Summary, raw: &Summary) {
    println!(
        "{what:<34} p50 {:>8.1} ms  p99 {:>8.1} ms   raw p50 {:>8.1} ms  p99 {:>8.1} ms   {:.2}x",
        kiln.median,
        kiln.p99,
        raw.median,
        raw.p99,
        kiln.median / raw.median
    );
}

/// Percentiles without ComputeSDK's trimming (for the side figures).
fn plain(v: &[f64]) -> Summary {
    let mut s = summarize(v.len(), v);
    let sorted = super::stats::sorted(v);
    s.median = super::stats::quantile(&sorted, 0.5);
    s.p95 = super::stats::quantile(&sorted, 0.95);
    s.p99 = super::stats::quantile(&sorted, 0.99);
    s
}

fn pjson(s: &Summary) -> Value {
    json!({"n": s.ok, "min": r2(s.min), "median": r2(s.median), "p95": r2(s.p95),
           "p99": r2(s.p99), "max": r2(s.max)})
}

pub fn run(a: Args) -> anyhow::Result<i32> {
    let runtime = a.rt.resolve()?;
    let baseline = runtime.baseline();
    let store = kiln_template::Store::open_default().context("opening the template store")?;
    let tpl = kiln_server::templates::Templates::lookup(&store, &a.template)?
        .with_context(|| format!("template {:?} is not built", a.template))?;
    let work = a.rt.work("tti")?;
    let state = work.path().join("s");
    let (client, kiln_idle) = {
        let serve = start_serve(&a, &state, &runtime)?;
        eprintln!("kiln serve at {} ({})", serve.url, runtime.platform());
        run_client(&a, work.path(), &serve, &state, baseline.as_ref())?
    };
    eprintln!("raw {} counterparts …", baseline.tool());
    let (tti, raw) = raw_counterparts(&a, baseline.as_ref(), &tpl, work.path());
    for e in &raw.errors {
        eprintln!("raw: {e}");
    }

    let raw_tti = plain(&tti);
    let (mut results, mut cpu_json) = (Vec::new(), Vec::new());
    println!("create → first echo through the e2b SDK (ComputeSDK TTI; 5 % trimmed each end)");
    for m in client["modes"].as_array().cloned().unwrap_or_default() {
        let (entry, s) = result_entry(&m, a.n, a.stagger_ms);
        println!(
            "{:<11} {:>3}/{:<3} ok ({:>5.1} %)  min {:>7.1}  median {:>7.1}  p95 {:>7.1}  \
             p99 {:>7.1} ms  composite {:>5.2}  (raw {} p50 {:.1} ms: {:.2}x)",
            m["mode"].as_str().unwrap_or(""),
            s.ok,
            s.n,
            s.success_rate * 100.0,
            s.min,
            s.median,
            s.p95,
            s.p99,
            s.composite,
            baseline.tool(),
            raw_tti.median,
            s.median / raw_tti.median
        );
        results.push(entry);
        if let Some(c) = cpu_per_sandbox(&m, s.ok) {
            println!(
                "{:<11} host CPU per sandbox {:.1} ms outside the client (+{:.1} ms in it): \
                 {} cores make about {:.0}/s at this cost (a burst of {}: about {:.0} ms \
                 for its first half)",
                "",
                c.server_ms,
                c.client_ms,
                c.cores,
                c.per_second(),
                a.n,
                c.median_floor_ms(a.n)
            );
            cpu_json.push(
                json!({"mode": m["mode"], "serverMsPerSandbox": r2(c.server_ms),
                                 "clientMsPerSandbox": r2(c.client_ms)}),
            );
        }
    }
    let (run_true, resume, fork) = (
        plain(&ms_list(&client["runTrueMs"])),
        plain(&ms_list(&client["resumeMs"])),
        plain(&ms_list(&client["forkMs"])),
    );
    let (raw_exec, raw_resume, raw_fork) = (plain(&raw.exec), plain(&raw.resume), plain(&raw.fork));
    line("commands.run(\"true\") round trip", &run_true, &raw_exec);
    line("pause → resume → first command", &resume, &raw_resume);
    line("fork → child's first command", &fork, &raw_fork);
    let busy = &client["busy"];
    let (alone, refill) = (
        plain(&ms_list(&busy["aloneMs"])),
        plain(&ms_list(&busy["refillMs"])),
    );
    if alone.ok > 0 && refill.ok > 0 {
        println!(
            "{:<34} p50 {:>8.1} ms  p99 {:>8.1} ms   alone p50 {:>6.1} ms  p99 {:>8.1} ms   \
             {:.2}x ({} creates beside it)",
            "a sandbox at work, pool refilling",
            refill.median,
            refill.p99,
            alone.median,
            alone.p99,
            refill.median / alone.median,
            busy["creates"].as_u64().unwrap_or(0)
        );
    }
    let raw_idle = raw.idle_mib.unwrap_or(f64::NAN);
    println!(
        "{:<34} {kiln_idle:>8.1} MiB          raw {raw_idle:>8.1} MiB   {:.2}x",
        "idle PSS per sandbox",
        kiln_idle / raw_idle
    );

    if let Some(path) = &a.json {
        let mut environment = json!({"client": "e2b python SDK", "platform": std::env::consts::OS,
                                     "arch": std::env::consts::ARCH});
        if let (Some(e), Some(r)) = (
            environment.as_object_mut(),
            runtime.environment().as_object(),
        ) {
            e.extend(r.clone());
        }
        let out = json!({
            "version": "1.1",
            "timestamp": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            "environment": environment,
            "config": {"iterations": a.n, "timeoutMs": 120000},
            "results": results,
            "kiln": {
                "rawCreateToEchoMs": pjson(&raw_tti),
                "runTrueMs": pjson(&run_true), "rawExecMs": pjson(&raw_exec),
                "resumeToFirstCommandMs": pjson(&resume),
                "rawRestoreToFirstCommandMs": pjson(&raw_resume),
                "forkToChildFirstCommandMs": pjson(&fork),
                "rawForkToFirstCommandMs": pjson(&raw_fork),
                "busyAloneMs": pjson(&alone), "busyWhileRefillingMs": pjson(&refill),
                "idleMiBPerSandbox": r2(kiln_idle), "rawIdleMiB": r2(raw_idle),
                "rawErrors": raw.errors,
                "cpuPerSandbox": cpu_json,
            },
        });
        std::fs::write(path, serde_json::to_string_pretty(&out)?)
            .with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(0)
}
