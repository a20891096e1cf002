//! `kiln bench density`: how many idle sandboxes one host holds, and what each costs. Creates
//! idle sandboxes in steps (through the same Server/Manager `kiln serve` runs, admission control
//! included) and prints per step the runtime's host processes' RSS and threads per sandbox (from
//! /proc), create p50/p99, exec round-trip p50 (against the first step's), host CPU idle, and
//! the idle CPU each sandbox costs (its host cgroup's CPU time, and the server's, per
//! sandbox-second: load-independent, see [`super::idle_cpu`]); then the restart time with every
//! sandbox alive and the kill throughput.
//!
//! With `--active N`, N sandboxes run commands in a loop the whole time (`density_active.rs`)
//! and each step prints their exec p50 against the same loop measured with only the active
//! sandboxes alive (at least 20).
//! With `--standby-after SECS` the server puts idle sandboxes in standby (`density_standby.rs`):
//! each step then waits for them and prints what a sandbox in standby still costs the host, and
//! the end measures wake → first command against the runtime's raw restore + first command.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::density_active::{self, exec_round_trips, ActiveLoop};
use super::density_end::{kill_everything, restart_and_kill, wake, RawWakeSetup};
use super::density_host::{self, cpu_idle_pct, Host};
use super::density_standby::{self, DISK_RESERVE};
use super::idle_cpu;
use super::stats::percentiles;
use kiln_server::Manager;

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
    /// Seconds after its hint at which a sandbox still hinted idle gets
    /// --deep-idle-timer-slack-ms, as `kiln serve --deep-idle-after`; default: no deep tier.
    /// Each step then measures idle CPU once that time has passed too.
    #[arg(long)]
    deep_idle_after: Option<f64>,
    /// Timer slack (ms) of a sandbox idle long, as `kiln serve --deep-idle-timer-slack-ms`.
    #[arg(long, default_value_t = 500.0)]
    deep_idle_timer_slack_ms: f64,
    /// Sandboxes kept busy by an exec loop the whole run (one worker each); their exec p50
    /// is printed against the same loop with only them alive (at least 20 sandboxes).
    #[arg(long, default_value_t = 0)]
    active: usize,
    /// Pause (ms) of each active worker between two commands.
    #[arg(long, default_value_t = 500)]
    active_pause_ms: u64,
    /// Seconds the active loop is measured over per step (and for its baseline).
    #[arg(long, default_value_t = 15.0)]
    active_window: f64,
    /// Seconds of quiet after which a sandbox goes to standby, as `kiln serve
    /// --standby-after`; default: no standby.
    #[arg(long)]
    standby_after: Option<f64>,
    /// Sandboxes in standby woken at the end (each after a raw restore of the baseline's).
    #[arg(long, default_value_t = 20)]
    wake_samples: usize,
    /// Minutes after which no further step starts (the run then restarts and cleans up).
    #[arg(long, default_value_t = 120.0)]
    max_minutes: f64,
    /// Paces the creates by what the host can hold awake: a create waits while this many
    /// idle sandboxes (not the active ones) are awake or being created, until standby takes
    /// some of them. Default: no pacing.
    #[arg(long)]
    max_awake: Option<usize>,
}

/// Sandboxes alive at least while the active loop's baseline is measured.
const BASELINE_ALIVE: usize = 20;

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
    let deep_after = a
        .deep_idle_after
        .filter(|s| s.is_finite() && *s > 0.0 && hint_after.is_some())
        .map(Duration::from_secs_f64);
    driver.set_deep_idle(deep_after.map(|after| {
        let ms = a.deep_idle_timer_slack_ms.clamp(0.001, 5000.0);
        (after, Duration::from_secs_f64(ms / 1000.0))
    }));
    let standby_after = a
        .standby_after
        .filter(|s| s.is_finite() && *s > 0.0)
        .map(Duration::from_secs_f64);
    let driver_cfg = driver.clone();
    let mut cfg = super::server_config(work.path(), driver, Default::default())?;
    cfg.server.lifecycle.idle_hint_after = hint_after;
    cfg.server.lifecycle.standby_after = standby_after;
    println!(
        "kiln bench density ({}, template {}, up to {} sandboxes \
         in steps of {}, {} creates at once, sentry timer slack {}, idle hints {}, {} active \
         (a command every {} ms each), standby {}, creates paced to {}):",
        runtime.label(),
        a.template,
        a.count,
        a.step,
        a.concurrency,
        a.timer_slack_ms
            .map_or("the kernel's".to_string(), |ms| format!("{ms} ms")),
        hint_after.map_or("off".to_string(), |d| format!(
            "after {:.1} s quiet ({} ms slack{})",
            d.as_secs_f64(),
            a.idle_timer_slack_ms,
            deep_after.map_or(String::new(), |deep| format!(
                ", {} ms {:.1} s later",
                a.deep_idle_timer_slack_ms,
                deep.as_secs_f64()
            ))
        )),
        a.active,
        a.active_pause_ms,
        standby_after.map_or("off".to_string(), |d| format!(
            "after {:.1} s quiet",
            d.as_secs_f64()
        )),
        a.max_awake.map_or("no limit".to_string(), |n| format!(
            "{n} awake idle sandboxes"
        ))
    );
    let host = Host {
        root: work.path().to_path_buf(),
        raw: runtime.baseline(),
        started: Instant::now(),
        rss0_kib: 0,
    };
    let raw_wake = RawWakeSetup {
        runtime,
        driver: driver_cfg,
        work_root: a.rt.work_root()?,
    };
    println!(
        "  per sandbox: RSS (shared pages counted in each process), PSS (shared pages split) and \
         threads of every {} process of this bench, summed, / sandboxes; exec = `/bin/echo` through the agent ({} sandboxes per step)",
        host.raw.tool(),
        a.exec_samples
    );
    println!(
        "  idle CPU over {:.0} s, in % of one host core per sandbox: sbx% = its host cgroup \
         (sentry, gofer, stubs; awake idle sandboxes, and `stby` for those in standby), srv% = \
         this process (the server, the active loop's clients included) / sandboxes alive",
        a.idle_window
    );
    let rt = tokio::runtime::Runtime::new()?;
    let code = rt.block_on(async move {
        let mut host = host;
        let server = cfg.clone().prepare(templates.clone()).await?;
        let m = server.manager.clone();
        let state = work.path().to_path_buf();
        // Disk first: one sandbox's checkpoint measured, a run that does not fit refused.
        let (awake, asleep) =
            super::density_standby::probe_checkpoint(&m, &a.template, &state).await?;
        let per = if standby_after.is_some() {
            asleep
        } else {
            awake
        };
        let free = super::density_standby::check_disk(&state, a.count, per)?;
        println!(
            "  disk: a sandbox's state {:.1} MB awake, {:.1} MB paused with its memory \
             (standby); {} × {:.1} MB of {:.1} GB free",
            awake as f64 / 1e6,
            asleep as f64 / 1e6,
            a.count,
            per as f64 / 1e6,
            free as f64 / 1e9
        );
        host.rss0_kib = density_host::own_rss_kib();
        // What `kiln serve` runs beside the API: the metrics sampler and the dead-runtime
        // watcher (whose upkeep also applies --timer-slack-ms), so their cost is measured.
        let mut upkeep = vec![m.spawn_sampler(), m.spawn_watcher()];
        upkeep.extend(m.spawn_idle_tick());
        let measured = async {
            steps(&a, &m, &host, per).await?;
            // (The server's upkeep goes on while sandboxes are woken, as in `kiln serve`.)
            if standby_after.is_some() && m.standby_count() > 0 {
                wake(
                    &a.template,
                    a.wake_samples,
                    &m,
                    &raw_wake,
                    templates.clone(),
                )
                .await?;
            }
            Ok(())
        };
        // Ctrl-C ends the run as a failure does: every sandbox of it is killed below.
        let r = tokio::select! {
            r = measured => r,
            _ = tokio::signal::ctrl_c() => {
                println!("  interrupted: killing every sandbox of the run");
                Err(anyhow::anyhow!("interrupted"))
            }
        };
        upkeep.iter().for_each(|h| h.abort());
        drop(server);
        let r = match r {
            Ok(()) => {
                restart_and_kill(a.exec_samples, a.kill_concurrency, m, cfg, templates, &host).await
            }
            Err(e) => {
                kill_everything(m, cfg, templates).await;
                Err(e)
            }
        };
        r.map(|()| 0)
    })?;
    Ok(code)
}

/// Creates the sandboxes step by step, printing a row per step.
async fn steps(a: &Args, m: &Arc<Manager>, host: &Host, disk_per: u64) -> anyhow::Result<()> {
    println!(
        "  {:>5} {:>4} {:>4} {:>5} {:>5} {:>8} {:>8} {:>6} {:>7} {:>7} {:>8} {:>6} {:>5} {:>6} \
         {:>6} {:>6} {:>8} {:>8}",
        "count",
        "fail",
        "refd",
        "awake",
        "stby",
        "RSS/awk",
        "PSS/awk",
        "thr",
        "cr p50",
        "cr p99",
        "exec p50",
        "vs bas",
        "idle%",
        "sbx%",
        "stby%",
        "srv%",
        "srvRSS",
        "disk/stb"
    );
    let pause = Duration::from_millis(a.active_pause_ms);
    let window = Duration::from_secs_f64(a.active_window.max(1.0));
    let mut base_exec: Option<f64> = None;
    let mut active: Option<ActiveLoop> = None;
    let (mut failed_total, mut refused_total) = (0, 0);
    let deadline = host.started + Duration::from_secs_f64(a.max_minutes.max(1.0) * 60.0);
    let r = async {
        while m.list().len() < a.count {
            let live0 = m.list().len();
            // With an active loop, the first step stops at its baseline: the active sandboxes
            // alone (at least 20).
            let base_alive = BASELINE_ALIVE.max(a.active);
            let to = if a.active > 0 && live0 < base_alive {
                base_alive
            } else {
                live0 + a.step
            };
            let want = to.min(a.count) - live0;
            let pace = a.max_awake.map(|max_awake| Pace {
                max_awake,
                active: a.active,
                until: deadline,
            });
            let (times, failures) = create_many(m, &a.template, want, a.concurrency, pace).await;
            refused_total += failures.iter().filter(|f| f.refused).count();
            failed_total += failures.iter().filter(|f| !f.refused).count();
            for f in failures.iter().take(3) {
                eprintln!("  create failed: {}", f.message);
            }
            // Let the new sandboxes settle to idle before measuring.
            tokio::time::sleep(Duration::from_secs(3)).await;
            let all = m.list();
            let live = all.len();
            let busy: HashSet<String> = all.iter().take(a.active).map(|r| r.id.clone()).collect();
            if let Some(after) = m.config().idle_hint_after {
                // Measured once the new sandboxes are hinted idle (and idle long, with a
                // deep tier; the driver's housekeeping gives it within a watcher tick).
                let deep = a
                    .deep_idle_after
                    .filter(|s| s.is_finite() && *s > 0.0)
                    .map_or(Duration::ZERO, |s| Duration::from_secs_f64(s + 2.0));
                tokio::time::sleep(after + deep + Duration::from_secs(2)).await;
                println!(
                    "  ({} of {live} sandboxes hinted idle)",
                    m.idle_hinted_count()
                );
            }
            // Awake idle sandboxes (before standby, when it comes later than this).
            let idle_window = Duration::from_secs_f64(a.idle_window.max(0.5));
            let ids: Vec<String> = m
                .list()
                .into_iter()
                .map(|r| r.id)
                .filter(|id| !busy.contains(id) && m.standby_since(id).is_none())
                .collect();
            let (idle, cost) = tokio::join!(
                cpu_idle_pct(idle_window),
                idle_cpu::measure(&ids, idle_window)
            );
            let mut srv = cost.server_per_sandbox * ids.len() as f64 / live.max(1) as f64;
            if let Some(after) = m.config().standby_after {
                let want = live.saturating_sub(busy.len());
                let limit = after + Duration::from_secs(60) + Duration::from_secs(2) * want as u32;
                let n = density_standby::wait_standby(m, want, limit).await;
                if n < want {
                    println!(
                        "  ({n} of {want} idle sandboxes in standby after {:.0} s)",
                        limit.as_secs_f64()
                    );
                }
            }
            if a.active > 0 && base_exec.is_none() {
                let ids: Vec<_> = all
                    .iter()
                    .map(|r| (r.id.clone(), r.envd_token.clone()))
                    .collect();
                let (t, errs, first) =
                    density_active::measure_for(m, &ids, a.active, pause, window).await;
                let p = percentiles(&t);
                println!(
                    "  baseline: {} workers on {live} sandboxes alive: exec p50 {:.1} ms, \
                     p99 {:.1} ms ({} round trips, {errs} failed{})",
                    a.active,
                    p.p50_ms,
                    p.p99_ms,
                    p.n,
                    first.map(|e| format!(": {e}")).unwrap_or_default()
                );
                base_exec = Some(p.p50_ms);
            }
            if a.active > 0 && active.is_none() && live >= a.active.min(a.count) {
                let ids: Vec<_> = all
                    .iter()
                    .take(a.active)
                    .map(|r| (r.id.clone(), r.envd_token.clone()))
                    .collect();
                let l = ActiveLoop::start(m, &ids, ids.len(), pause);
                l.warm_up(density_active::WARM_UP).await;
                active = Some(l);
            }
            // In the steady state: the active loop's round trips, and what the sandboxes in
            // standby cost meanwhile.
            let asleep: Vec<String> = m
                .list()
                .into_iter()
                .map(|r| r.id)
                .filter(|id| m.standby_since(id).is_some())
                .collect();
            let loop_window = async {
                match &active {
                    Some(l) => {
                        l.take();
                        tokio::time::sleep(window).await;
                        let (t, errs, first) = l.take();
                        if errs > 0 {
                            eprintln!(
                                "  active loop: {errs} failed: {}",
                                first.unwrap_or_default()
                            );
                        }
                        Ok(percentiles(&t))
                    }
                    None => exec_round_trips(m, a.exec_samples).await,
                }
            };
            let (exec, stby) = tokio::join!(loop_window, idle_cpu::measure(&asleep, idle_window));
            let exec = exec?;
            // A sandbox in standby has no host cgroup left: it costs nothing.
            let stby_cpu = stby.per_sandbox * stby.measured as f64 / asleep.len().max(1) as f64;
            if !asleep.is_empty() {
                srv = stby.server_per_sandbox * asleep.len() as f64 / live.max(1) as f64;
            }
            let keep = density_standby::standby_keep(&host.root, &asleep);
            let usage = host.usage();
            let awake = live - keep.count;
            let c = percentiles(&times);
            let rss_growth = density_host::own_rss_kib().saturating_sub(host.rss0_kib);
            // No round trip when every sandbox is in standby and no loop runs.
            let (exec_p50, vs_base) = if exec.n == 0 {
                ("-".to_string(), "-".to_string())
            } else {
                let base = *base_exec.get_or_insert(exec.p50_ms);
                (
                    format!("{:.1} ms", exec.p50_ms),
                    format!("{:.2}x", exec.p50_ms / base),
                )
            };
            println!(
                "  {:>5} {:>4} {:>4} {:>5} {:>5} {:>4.1} MiB {:>4.1} MiB {:>6.1} {:>4.0} ms \
                 {:>4.0} ms {:>8} {:>6} {:>5.1} {:>6} {:>6} {:>6.3} {:>4.0} KiB \
                 {:>5.1} MB",
                live,
                failures.iter().filter(|f| !f.refused).count(),
                failures.iter().filter(|f| f.refused).count(),
                awake,
                keep.count,
                usage.rss_kib as f64 / 1024.0 / awake.max(1) as f64,
                usage.pss_kib as f64 / 1024.0 / awake.max(1) as f64,
                usage.threads as f64 / awake.max(1) as f64,
                c.p50_ms,
                c.p99_ms,
                exec_p50,
                vs_base,
                idle,
                pct(cost.per_sandbox, cost.measured),
                pct(stby_cpu, keep.count),
                srv * 100.0,
                rss_growth as f64 / live.max(1) as f64,
                keep.per(keep.disk_bytes) / 1e6
            );
            if cost.measured < ids.len() {
                println!(
                    "  (sbx%: {} of {} awake idle sandboxes went to standby or could not be read)",
                    ids.len() - cost.measured,
                    ids.len()
                );
            }
            if keep.count > 0 {
                println!(
                    "  standby keeps per sandbox: {:.2} processes, {:.0} KiB in its memory cgroup, \
                     {:.1} mounts, {:.1} MB on disk; server RSS +{:.1} MiB since the start",
                    keep.per(keep.processes as u64),
                    keep.per(keep.cgroup_bytes) / 1024.0,
                    keep.per(keep.mounts as u64),
                    keep.per(keep.disk_bytes) / 1e6,
                    rss_growth as f64 / 1024.0
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
            let left = a.count.saturating_sub(live);
            let free = density_host::free_bytes(&host.root)?;
            // Sandboxes that ran hold more than the probe's fresh one: the larger counts.
            let per = disk_per.max(keep.per(keep.disk_bytes) as u64);
            if density_host::disk_refusal(left.min(a.step), per, free, DISK_RESERVE).is_some() {
                println!("  stopping: another step would leave less than 10 GB of disk free");
                break;
            }
            if Instant::now() > deadline {
                println!("  stopping: --max-minutes reached");
                break;
            }
        }
        anyhow::Ok(())
    }
    .await;
    if let Some(l) = active {
        l.stop().await;
    }
    println!(
        "  {} sandboxes ({} in standby), {failed_total} failed create(s), {refused_total} \
         refused by admission control",
        m.list().len(),
        m.standby_count()
    );
    r
}

/// `cores` in % of one core with three decimals, or `-` when no sandbox was measured.
fn pct(cores: f64, measured: usize) -> String {
    if measured == 0 {
        "-".into()
    } else {
        format!("{:.3}", cores * 100.0)
    }
}

/// A create that did not succeed.
struct Failure {
    /// Refused up front by admission control (capacity or the sandbox limit).
    refused: bool,
    message: String,
}

/// Creates held back while the host holds enough awake idle sandboxes (`--max-awake`).
#[derive(Clone, Copy)]
struct Pace {
    max_awake: usize,
    /// Sandboxes of the active loop (never idle, never counted).
    active: usize,
    /// No create waits past this: the run's deadline.
    until: Instant,
}

impl Pace {
    /// Waits until one more create keeps the awake idle sandboxes (with the creates in
    /// flight) under the limit; false when the run's deadline came first.
    async fn admit(&self, m: &Manager, in_flight: &AtomicUsize) -> bool {
        loop {
            let live = m.list().len();
            let awake_idle = live
                .saturating_sub(m.standby_count())
                .saturating_sub(self.active.min(live));
            if awake_idle + in_flight.load(Ordering::SeqCst) < self.max_awake {
                return true;
            }
            if Instant::now() > self.until {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

/// `n` creates, `concurrency` at a time (and, with a pace, only while few idle sandboxes are
/// awake): the durations of those that succeeded, and the errors of the others.
async fn create_many(
    m: &Arc<Manager>,
    template: &str,
    n: usize,
    concurrency: usize,
    pace: Option<Pace>,
) -> (Vec<Duration>, Vec<Failure>) {
    let next = Arc::new(AtomicUsize::new(0));
    let in_flight = Arc::new(AtomicUsize::new(0));
    let out = Arc::new(Mutex::new((Vec::new(), Vec::new())));
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..concurrency.max(1) {
        let (m, next, out, template) = (m.clone(), next.clone(), out.clone(), template.to_string());
        let in_flight = in_flight.clone();
        workers.spawn(async move {
            while next.fetch_add(1, Ordering::SeqCst) < n {
                if let Some(p) = pace {
                    if !p.admit(&m, &in_flight).await {
                        return;
                    }
                }
                in_flight.fetch_add(1, Ordering::SeqCst);
                let t = Instant::now();
                let r = m.create(density_standby::params(&template)).await;
                in_flight.fetch_sub(1, Ordering::SeqCst);
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
