//! `kiln bench exec`: what a command costs inside a kiln sandbox beside the runtime's raw run of
//! the same rootfs in the same run — 200 fork+exec of `/bin/true` and 5 `python3` starts under
//! `/bin/sh` and under `/bin/bash` (a bash fork costs about three times a dash fork in a
//! sandbox, so each shell is compared with itself), a login shell's start-up against a plain
//! one, the `commands.run("true")` round trip (`/bin/bash -l -c true` through the agent, as the
//! SDK sends it), and the kill as `DELETE /sandboxes/{id}` answers it. See docs/speed.md.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::anyhow;
use kiln_envd::RunOptions;
use kiln_server::manager::{CreateParams, LifecycleConfig, Manager};
use kiln_server::store::SqliteStore;

use super::create_bench::{workload_once, workload_script, workload_times};
use super::stats::{median, percentiles};

#[derive(clap::Args)]
pub struct Args {
    /// Template to start sandboxes from.
    #[arg(long, default_value = "base")]
    template: String,
    /// Rounds of the workload (kiln and raw interleaved), per shell.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// `commands.run("true")` round trips.
    #[arg(long, default_value_t = 100)]
    runs: usize,
    /// Sandboxes created and killed for the kill latency.
    #[arg(long, default_value_t = 10)]
    kills: usize,
    #[command(flatten)]
    rt: super::RuntimeArgs,
}

/// Timed inside the sandbox: `n` login shells, then `n` plain ones (ns stamps).
const LOGIN_STARTS: u32 = 20;
fn login_script() -> String {
    format!(
        "date +%s%N; i=0; while [ $i -lt {LOGIN_STARTS} ]; do /bin/bash -l -c true; i=$((i+1)); \
         done; date +%s%N; i=0; while [ $i -lt {LOGIN_STARTS} ]; do /bin/bash -c true; \
         i=$((i+1)); done; date +%s%N"
    )
}

fn stamps(out: &[u8]) -> Vec<u128> {
    String::from_utf8_lossy(out)
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

pub fn run(a: Args) -> anyhow::Result<i32> {
    let sb = super::server_bench(&a.rt, "x")?;
    let tpl = sb
        .templates
        .lookup(&a.template)?
        .ok_or_else(|| anyhow!("template {:?} is not built", a.template))?;
    let driver = sb.runtime.driver(&sb.driver, sb.work.path())?.driver;
    let baseline = sb.runtime.baseline();
    let store = Arc::new(SqliteStore::open(&sb.work.path().join("kiln.db"))?);
    let manager = Manager::new(LifecycleConfig::default(), store, driver, sb.templates);
    let rt = tokio::runtime::Runtime::new()?;
    let work = sb.work.path().to_path_buf();
    let result = rt.block_on(async {
        let create = || async {
            manager
                .create(CreateParams {
                    template_id: a.template.clone(),
                    timeout_secs: Some(600),
                    secure: true,
                    ..Default::default()
                })
                .await
                .map_err(|e| anyhow!("create: {e}"))
        };
        let rec = create().await?;
        let agent = manager.agent(&rec.id, rec.envd_token.clone());
        let run = |cmd: String, envs: HashMap<String, String>| {
            let agent = agent.clone();
            async move {
                let opts = RunOptions {
                    envs,
                    timeout: Some(Duration::from_secs(300)),
                    ..Default::default()
                };
                let out = agent
                    .run(&cmd, opts)
                    .await
                    .map_err(|e| anyhow!("{cmd}: {e}"))?;
                if out.exit_code != 0 {
                    return Err(anyhow!("{cmd}: exit {}", out.exit_code));
                }
                anyhow::Ok(out.stdout)
            }
        };
        let _ = run("true".into(), HashMap::new()).await?;

        eprintln!(
            "workload: {} round(s) × /bin/sh and /bin/bash, kiln and raw {} interleaved …",
            a.rounds,
            baseline.tool()
        );
        let mut work_ms: HashMap<(&str, &str), Vec<(f64, f64)>> = HashMap::new();
        for round in 0..a.rounds {
            for shell in ["/bin/sh", "/bin/bash"] {
                let (b, w, r, s) = (baseline.clone(), work.clone(), tpl.rootfs.clone(), shell);
                let raw = tokio::task::spawn_blocking(move || {
                    workload_once(b.as_ref(), &w, &r, s, round * 10 + s.len())
                })
                .await?
                .map_err(|e| anyhow!(e))?;
                work_ms.entry(("raw", shell)).or_default().push(raw);
                let envs = HashMap::from([("KILN_BENCH_W".to_string(), workload_script())]);
                let out = run(format!("exec {shell} -c \"$KILN_BENCH_W\""), envs).await?;
                let st = stamps(&out);
                if st.len() != 3 {
                    return Err(anyhow!(
                        "workload printed {:?}",
                        String::from_utf8_lossy(&out)
                    ));
                }
                work_ms
                    .entry(("kiln", shell))
                    .or_default()
                    .push(workload_times(&st));
            }
        }

        let out = run(login_script(), HashMap::new()).await?;
        let st = stamps(&out);
        if st.len() != 3 {
            return Err(anyhow!(
                "login script printed {:?}",
                String::from_utf8_lossy(&out)
            ));
        }
        let per = |a: u128, b: u128| b.saturating_sub(a) as f64 / 1e6 / f64::from(LOGIN_STARTS);
        let (login, plain) = (per(st[0], st[1]), per(st[1], st[2]));

        eprintln!("round trip: {} × commands.run(\"true\") …", a.runs);
        let mut trips = Vec::new();
        for _ in 0..a.runs {
            let t = Instant::now();
            run("true".into(), HashMap::new()).await?;
            trips.push(t.elapsed());
        }
        // The same round trip without a shell: the agent's spawn and the stream alone.
        let direct = kiln_proto::process::StartRequest {
            process: Some(kiln_proto::process::ProcessConfig {
                cmd: "/bin/true".into(),
                ..Default::default()
            }),
            stdin: Some(false),
            ..Default::default()
        };
        let mut direct_trips = Vec::new();
        for _ in 0..a.runs {
            let t = Instant::now();
            let mut events = agent.start(&direct, None).await?;
            while let Some(ev) = events.next_event().await? {
                if matches!(ev, kiln_envd::ProcessEvent::Exited { .. }) {
                    break;
                }
            }
            direct_trips.push(t.elapsed());
        }
        // The transport alone: a request that starts nothing.
        let mut health_trips = Vec::new();
        for _ in 0..a.runs {
            let t = Instant::now();
            agent.health().await?;
            health_trips.push(t.elapsed());
        }
        let _ = manager.kill(&rec.id, "bench").await;

        eprintln!("kill: {} sandboxes …", a.kills);
        let (mut kills, mut teardowns) = (Vec::new(), Vec::new());
        for _ in 0..a.kills {
            let r = create().await?;
            let t = Instant::now();
            manager.kill_detached(&r.id, "bench").await?;
            kills.push(t.elapsed());
            manager.teardowns_done(Duration::from_secs(60)).await;
            teardowns.push(t.elapsed());
        }
        anyhow::Ok((
            work_ms,
            login,
            plain,
            trips,
            direct_trips,
            health_trips,
            kills,
            teardowns,
        ))
    });
    rt.block_on(async {
        manager.kill_all("bench done").await;
        manager.shutdown_driver().await;
    });
    let (work_ms, login, plain, trips, direct_trips, health_trips, kills, teardowns) = result?;

    println!(
        "kiln bench exec ({}, template {}):",
        sb.runtime.label(),
        a.template
    );
    println!(
        "  workload = 200 × fork+exec /bin/true, 5 × python3 -c 'import json', timed inside; \
         raw = `{} run` of the template rootfs; kiln = through the agent; median of {} rounds",
        baseline.tool(),
        a.rounds
    );
    for shell in ["/bin/sh", "/bin/bash"] {
        let m = |who: &str, f: fn(&(f64, f64)) -> f64| {
            let mut v: Vec<f64> = work_ms
                .get(&(who, shell))
                .map(|v| v.iter().map(f).collect())
                .unwrap_or_default();
            median(&mut v)
        };
        let (rf, kf) = (m("raw", |x| x.0), m("kiln", |x| x.0));
        let (rp, kp) = (m("raw", |x| x.1), m("kiln", |x| x.1));
        println!(
            "  {shell:<9} fork+exec raw {rf:>7.0} ms  kiln {kf:>7.0} ms  {:>5.2}x   \
             python raw {rp:>6.0} ms  kiln {kp:>6.0} ms  {:>5.2}x",
            kf / rf,
            kp / rp
        );
    }
    println!(
        "  inside: bash -l -c true {login:.1} ms, bash -c true {plain:.1} ms: {:.2}x",
        login / plain
    );
    let p = percentiles(&trips);
    println!(
        "  commands.run(\"true\") through the agent: n={} p50 {:.1} ms  p99 {:.1} ms",
        p.n, p.p50_ms, p.p99_ms
    );
    let p = percentiles(&direct_trips);
    println!(
        "  /bin/true started directly (no shell) through the agent: n={} p50 {:.1} ms  p99 {:.1} ms",
        p.n, p.p50_ms, p.p99_ms
    );
    let p = percentiles(&health_trips);
    println!(
        "  GET /health through the agent (the transport alone): n={} p50 {:.1} ms  p99 {:.1} ms",
        p.n, p.p50_ms, p.p99_ms
    );
    let (k, t) = (percentiles(&kills), percentiles(&teardowns));
    println!(
        "  kill (answer): n={} p50 {:.1} ms  p99 {:.1} ms;  teardown done: p50 {:.1} ms",
        k.n, k.p50_ms, k.p99_ms, t.p50_ms
    );
    Ok(0)
}
