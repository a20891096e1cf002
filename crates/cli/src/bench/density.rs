//! `kiln bench density`: how many idle sandboxes one host holds, and what each costs. Creates
//! idle sandboxes in steps (through the same Server/Manager `kiln serve` runs, admission control
//! included) and prints per step the runtime's host processes' RSS and threads per sandbox (from
//! /proc), create p50/p99, exec round-trip p50 (against the first step's), host CPU idle, and
//! the idle CPU each sandbox costs (its host cgroup's CPU time, and the server's, per
//! sandbox-second: load-independent, see [`super::idle_cpu`]); then the restart time with every
//! sandbox alive and the kill throughput.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::stats::{percentiles, Percentiles};
use anyhow::Context;
use kiln_server::manager::CreateParams;
use kiln_server::Manager;

use crate::drivers::ServerSetup;
use kiln_driver::baseline::{HostUsage, RawBaseline};

#[derive(clap::Args)]
pub struct Args {
    /// Template the sandboxes start from.
    #[arg(long, default_value = "base")]
    template: String,
    /// Sandboxes to reach (the bench stops earlier when admission control refuses).
    #[arg(long, default_value_t = 1000)]
    count: usize,
    /// Sandboxes added per step.
    #[arg(long, default_value_t = 100)]
    step: usize,
    /// Creates in flight at once.
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// Sandboxes killed at once at the end.
    #[arg(long, default_value_t = 8)]
    kill_concurrency: usize,
    /// Exec round trips measured per step (spread over the sandboxes).
    #[arg(long, default_value_t = 20)]
    exec_samples: usize,
    /// Seconds over which each step measures idle CPU (host idle and per-sandbox CPU time).
    #[arg(long, default_value_t = 5.0)]
    idle_window: f64,
    #[command(flatten)]
    rt: super::RuntimeArgs,
    /// Timer slack (ms) of the sandboxes' host tasks, as `kiln serve --sentry-timer-slack-ms`.
    #[arg(long)]
    timer_slack_ms: Option<f64>,
    /// Seconds of quiet after which a sandbox is hinted idle, as `kiln serve
    /// --idle-hint-after` (its host tasks get --idle-timer-slack-ms of timer slack);
    /// default: no hints. Each step then measures idle CPU once the hints are given.
    #[arg(long)]
    idle_hint_after: Option<f64>,
    /// Timer slack (ms) of a sandbox hinted idle, as `kiln serve --idle-timer-slack-ms`.
    #[arg(long, default_value_t = 50.0)]
    idle_timer_slack_ms: f64,
}

pub fn run(a: Args) -> anyhow::Result<i32> {
    let super::ServerBench {
        templates,
        work,
        mut driver,
        runtime,
    } = super::server_bench(&a.rt, "d")?;
    let busy_slack = a
        .timer_slack_ms
        .filter(|ms| ms.is_finite() && *ms > 0.0)
        .map(|ms| Duration::from_secs_f64(ms / 1000.0));
    let hint_after = a
        .idle_hint_after
        .filter(|s| s.is_finite() && *s > 0.0)
        .map(Duration::from_secs_f64);
    let idle_slack = hint_after
        .map(|_| Duration::from_secs_f64(a.idle_timer_slack_ms.clamp(0.001, 1000.0) / 1000.0));
    driver.set_timer_slack(busy_slack, idle_slack);
    let mut cfg = super::server_config(work.path(), driver, Default::default())?;
    cfg.server.lifecycle.idle_hint_after = hint_after;
    println!(
        "kiln bench density ({}, template {}, up to {} idle sandboxes \
         in steps of {}, {} creates at once, sentry timer slack {}, idle hints {}):",
        runtime.label(),
        a.template,
        a.count,
        a.step,
        a.concurrency,
        a.timer_slack_ms
            .map_or("the kernel's".to_string(), |ms| format!("{ms} ms")),
        hint_after.map_or("off".to_string(), |d| format!(
            "after {:.1} s quiet ({} ms slack)",
            d.as_secs_f64(),
            a.idle_timer_slack_ms
        ))
    );
    let host = Host {
        root: work.path().to_path_buf(),
        raw: runtime.baseline(),
    };
    println!(
        "  per sandbox: RSS (shared pages counted in each process), PSS (shared pages split) and \
         threads of every {} process of this bench, summed, / sandboxes; exec = `/bin/echo` through the agent ({} sandboxes per step)",
        host.raw.tool(),
        a.exec_samples
    );
    println!(
        "  idle CPU over {:.0} s, in % of one host core per sandbox: sbx% = its host cgroup \
         (sentry, gofer, stubs), srv% = this process (the server) / sandboxes",
        a.idle_window
    );
    let rt = tokio::runtime::Runtime::new()?;
    let code = rt.block_on(async move {
        let server = cfg.clone().prepare(templates.clone()).await?;
        let m = server.manager.clone();
        // What `kiln serve` runs beside the API: the metrics sampler and the dead-runtime
        // watcher (whose upkeep also applies --timer-slack-ms), so their cost is measured.
        let mut upkeep = vec![m.spawn_sampler(), m.spawn_watcher()];
        upkeep.extend(m.spawn_idle_tick());
        let r = steps(&a, &m, &host).await;
        upkeep.iter().for_each(|h| h.abort());
        drop(server);
        let r = match r {
            Ok(()) => restart_and_kill(&a, m, cfg, templates, &host).await,
            Err(e) => {
                m.kill_all("bench density failed").await;
                Err(e)
            }
        };
        r.map(|()| 0)
    })?;
    Ok(code)
}

/// Creates the sandboxes step by step, printing a row per step.
async fn steps(a: &Args, m: &Arc<Manager>, host: &Host) -> anyhow::Result<()> {
    println!(
        "  {:>6} {:>6} {:>7} {:>8} {:>8} {:>8} {:>11} {:>11} {:>10} {:>9} {:>6} {:>6} {:>6}",
        "count",
        "failed",
        "refused",
        "RSS/sbx",
        "PSS/sbx",
        "thr/sbx",
        "create p50",
        "create p99",
        "exec p50",
        "vs first",
        "idle%",
        "sbx%",
        "srv%"
    );
    let mut first_exec: Option<f64> = None;
    let (mut failed_total, mut refused_total) = (0, 0);
    while m.list().len() < a.count {
        let want = (m.list().len() + a.step).min(a.count) - m.list().len();
        let (times, failures) = create_many(m, &a.template, want, a.concurrency).await;
        refused_total += failures.iter().filter(|f| f.refused).count();
        failed_total += failures.iter().filter(|f| !f.refused).count();
        for f in failures.iter().take(3) {
            eprintln!("  create failed: {}", f.message);
        }
        // Let the new sandboxes settle to idle before measuring.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let live = m.list().len();
        let usage = host.usage();
        let exec = exec_round_trips(m, a.exec_samples).await?;
        let ids: Vec<String> = m.list().into_iter().map(|r| r.id).collect();
        if let Some(after) = m.config().idle_hint_after {
            // The exec'd sandboxes were used just now: measure once they are hinted again.
            tokio::time::sleep(after + Duration::from_secs(2)).await;
            println!(
                "  ({} of {} sandboxes hinted idle)",
                m.idle_hinted_count(),
                ids.len()
            );
        }
        let window = Duration::from_secs_f64(a.idle_window.max(0.5));
        let (idle, cost) =
            tokio::join!(cpu_idle_pct(window), super::idle_cpu::measure(&ids, window));
        let c = percentiles(&times);
        let first = *first_exec.get_or_insert(exec.p50_ms);
        println!(
            "  {:>6} {:>6} {:>7} {:>4.1} MiB {:>4.1} MiB {:>8.1} {:>8.0} ms {:>8.0} ms {:>7.1} ms \
             {:>8.2}x {:>6.1} {:>6.3} {:>6.3}",
            live,
            failures.iter().filter(|f| !f.refused).count(),
            failures.iter().filter(|f| f.refused).count(),
            usage.rss_kib as f64 / 1024.0 / live.max(1) as f64,
            usage.pss_kib as f64 / 1024.0 / live.max(1) as f64,
            usage.threads as f64 / live.max(1) as f64,
            c.p50_ms,
            c.p99_ms,
            exec.p50_ms,
            exec.p50_ms / first,
            idle,
            cost.per_sandbox * 100.0,
            cost.server_per_sandbox * 100.0
        );
        if cost.measured < ids.len() {
            println!(
                "  (sbx%: the host cgroups of {} of {} sandboxes could not be read)",
                ids.len() - cost.measured,
                ids.len()
            );
        }
        if failures.len() == want {
            println!("  stopping: no create of this step succeeded");
            break;
        }
        if failures.iter().any(|f| f.refused) {
            println!("  stopping: admission control refused creates (host capacity reached)");
            break;
        }
    }
    println!(
        "  {} idle sandboxes, {failed_total} failed create(s), {refused_total} refused by \
         admission control",
        m.list().len()
    );
    Ok(())
}

/// A create that did not succeed.
struct Failure {
    /// Refused up front by admission control (capacity or the sandbox limit).
    refused: bool,
    message: String,
}

/// `n` creates, `concurrency` at a time: the durations of those that succeeded, and the
/// errors of the others.
async fn create_many(
    m: &Arc<Manager>,
    template: &str,
    n: usize,
    concurrency: usize,
) -> (Vec<Duration>, Vec<Failure>) {
    let next = Arc::new(AtomicUsize::new(0));
    let out = Arc::new(Mutex::new((Vec::new(), Vec::new())));
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..concurrency.max(1) {
        let (m, next, out, template) = (m.clone(), next.clone(), out.clone(), template.to_string());
        workers.spawn(async move {
            while next.fetch_add(1, Ordering::SeqCst) < n {
                let t = Instant::now();
                let r = m
                    .create(CreateParams {
                        template_id: template.clone(),
                        timeout_secs: Some(3600),
                        secure: true,
                        ..Default::default()
                    })
                    .await;
                let mut o = out.lock().unwrap_or_else(|p| p.into_inner());
                match r {
                    Ok(_) => o.0.push(t.elapsed()),
                    Err(e) => o.1.push(Failure {
                        refused: matches!(e, kiln_server::Error::Capacity { .. }),
                        message: e.to_string(),
                    }),
                }
            }
        });
    }
    while workers.join_next().await.is_some() {}
    let mut o = out.lock().unwrap_or_else(|p| p.into_inner());
    (std::mem::take(&mut o.0), std::mem::take(&mut o.1))
}

/// Sequential `/bin/echo` round trips through the agents of up to `samples` sandboxes spread
/// over the running ones.
async fn exec_round_trips(m: &Manager, samples: usize) -> anyhow::Result<Percentiles> {
    use kiln_proto::process as pb;
    let all = m.list();
    let every = (all.len() / samples.max(1)).max(1);
    let mut times = Vec::new();
    for rec in all.iter().step_by(every).take(samples) {
        let agent = m.agent(&rec.id, rec.envd_token.clone());
        let req = pb::StartRequest {
            process: Some(pb::ProcessConfig {
                cmd: "/bin/echo".into(),
                args: vec!["kiln-density".into()],
                envs: Default::default(),
                cwd: None,
            }),
            pty: None,
            tag: None,
            stdin: Some(false),
        };
        let t = Instant::now();
        // As a proxied request would: a sandbox hinted idle is told otherwise first.
        let _use = m.use_sandbox(&rec.id, "bench").await?;
        let mut stream = agent
            .start(&req, None)
            .await
            .with_context(|| format!("exec in {}", rec.id))?;
        let mut out = Vec::new();
        loop {
            match stream.next_event().await? {
                Some(kiln_envd::ProcessEvent::Stdout(b)) => out.extend(b),
                Some(kiln_envd::ProcessEvent::Exited { .. }) => break,
                Some(_) => {}
                None => anyhow::bail!("exec in {}: no end event", rec.id),
            }
        }
        times.push(t.elapsed());
        anyhow::ensure!(
            out == b"kiln-density\n",
            "exec in {}: unexpected output {:?}",
            rec.id,
            String::from_utf8_lossy(&out)
        );
    }
    Ok(percentiles(&times))
}

/// Restarts the server with every sandbox alive (listen time, time until all are adopted),
/// then kills them all, `kill_concurrency` at a time.
async fn restart_and_kill(
    a: &Args,
    old: Arc<Manager>,
    cfg: ServerSetup,
    templates: Arc<dyn kiln_server::templates::Templates>,
    host: &Host,
) -> anyhow::Result<()> {
    let live = old.list().len();
    drop(old);
    let t = Instant::now();
    let server = cfg.prepare(templates).await?;
    let listening = t.elapsed();
    let report = server.recovery.done().await.map_err(anyhow::Error::msg)?;
    let adopted = t.elapsed();
    println!(
        "  restart with {live} live sandboxes: listening after {:.0} ms, {} adopted after {:.1} s \
         ({} cleaned up)",
        listening.as_secs_f64() * 1000.0,
        report.adopted.len(),
        adopted.as_secs_f64(),
        report.cleaned.len()
    );
    let m = server.manager.clone();
    let exec = exec_round_trips(&m, a.exec_samples).await?;
    println!("  exec p50 after the restart: {:.1} ms", exec.p50_ms);
    let ids: Vec<String> = m.list().into_iter().map(|r| r.id).collect();
    let n = ids.len();
    let queue = Arc::new(Mutex::new(ids));
    let t = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..a.kill_concurrency.max(1) {
        let (m, queue) = (m.clone(), queue.clone());
        workers.spawn(async move {
            loop {
                let id = queue.lock().unwrap_or_else(|p| p.into_inner()).pop();
                let Some(id) = id else { break };
                if let Err(e) = m.kill(&id, "bench density done").await {
                    eprintln!("  kill {id}: {e}");
                }
            }
        });
    }
    while workers.join_next().await.is_some() {}
    let took = t.elapsed();
    println!(
        "  kill: {n} adopted sandboxes in {:.1} s ({} at once) = {:.1} kills/s",
        took.as_secs_f64(),
        a.kill_concurrency,
        n as f64 / took.as_secs_f64().max(1e-9)
    );
    let left = host.usage();
    anyhow::ensure!(
        left.processes == 0,
        "{} {} processes left after killing every sandbox",
        left.processes,
        host.raw.tool()
    );
    Ok(())
}

/// The runtime's host processes of this bench: those whose command line names `root`.
struct Host {
    root: PathBuf,
    raw: Arc<dyn RawBaseline>,
}

impl Host {
    fn usage(&self) -> HostUsage {
        self.raw.usage(&self.root)
    }
}

/// Share of CPU time the host spent idle over `window` (from /proc/stat).
async fn cpu_idle_pct(window: Duration) -> f64 {
    fn sample() -> Option<(u64, u64)> {
        let s = std::fs::read_to_string("/proc/stat").ok()?;
        let line = s.lines().next()?;
        let v: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .filter_map(|x| x.parse().ok())
            .collect();
        // user nice system idle iowait irq softirq steal
        let idle = v.get(3)? + v.get(4).copied().unwrap_or(0);
        Some((idle, v.iter().take(8).sum()))
    }
    let a = sample();
    tokio::time::sleep(window).await;
    match (a, sample()) {
        (Some((i0, t0)), Some((i1, t1))) if t1 > t0 => (i1 - i0) as f64 / (t1 - t0) as f64 * 100.0,
        _ => f64::NAN,
    }
}
