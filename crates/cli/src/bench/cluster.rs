//! `kiln bench cluster`: a cluster's own costs, on an etcd the bench starts (127.0.0.1, a
//! temporary data directory). The placement decision of a control replica with simulated
//! nodes and sandboxes in etcd ([`super::cluster_place`]), beside a bare etcd read; a create
//! through a control replica vs straight on the node, and an envd call through the gateway vs
//! straight through a tunnel into the node ([`super::cluster_gateway`]); with an
//! S3-compatible bucket (`--s3-endpoint`), a paused sandbox's resume on another node (its
//! checkpoint fetched from the bucket) vs on its own node ([`super::cluster_resume`]). Bounded by
//! `--max-minutes`; etcd, the node, the control replica and every sandbox are stopped on every
//! way out (the end, an error, the bound, Ctrl-C), and the work directory is cleared.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use serde_json::json;

use super::cluster_gateway::{self as gateway, GatewayOptions, GatewayReport};
use super::cluster_place::{self as place, PlaceOptions, PlaceReport};
use super::cluster_proc::Etcd;
use super::cluster_resume::{self as resume, ResumeOptions, ResumeReport};
use super::stats::Percentiles;

#[derive(clap::Args)]
pub struct Args {
    /// Simulated nodes registered in etcd for the placement part.
    #[arg(long, default_value_t = 50)]
    nodes: usize,
    /// Simulated sandboxes published in etcd (spread over the simulated nodes).
    #[arg(long, default_value_t = 10_000)]
    sandboxes: usize,
    /// Teams the simulated sandboxes belong to.
    #[arg(long, default_value_t = 20)]
    teams: usize,
    /// Placement decisions timed (each with and without a team quota).
    #[arg(long, default_value_t = 1000)]
    decisions: usize,
    /// Creates of each kind (through the control, straight on the node); 0 skips the gateway
    /// part.
    #[arg(long, default_value_t = 10)]
    creates: usize,
    /// envd calls of each kind (through the gateway, straight to the node).
    #[arg(long, default_value_t = 200)]
    execs: usize,
    /// An S3-compatible endpoint (`http://host:port`) for the resume part: two nodes share
    /// its bucket; credentials from KILN_S3_ACCESS_KEY_ID / KILN_S3_SECRET_ACCESS_KEY. Without
    /// it the resume part is not measured.
    #[arg(long)]
    s3_endpoint: Option<String>,
    /// The bucket of the resume part (it must exist).
    #[arg(long, default_value = "kiln-bench")]
    s3_bucket: String,
    /// Paused sandboxes resumed on their node and on the other (the resume part).
    #[arg(long, default_value_t = 5)]
    resumes: usize,
    /// MiB of random bytes each of them holds in memory before its pause.
    #[arg(long, default_value_t = 32)]
    resume_mib: u64,
    /// Template the real node's sandboxes start from.
    #[arg(long, default_value = "base")]
    template: String,
    /// The etcd binary (Debian's etcd-server).
    #[arg(long, default_value = "etcd")]
    etcd_bin: PathBuf,
    /// The bench stops (and cleans up) after this many minutes, printing what it measured.
    #[arg(long, default_value_t = 15.0)]
    max_minutes: f64,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    #[command(flatten)]
    rt: super::RuntimeArgs,
}

#[derive(Default)]
struct Results {
    place: Option<PlaceReport>,
    gateway: Option<GatewayReport>,
    resume: Option<ResumeReport>,
}

/// The roles each part started, whose sandboxes are killed on every way out.
#[derive(Default)]
struct Started {
    gateway: Option<Arc<gateway::Roles>>,
    resume: Option<Arc<resume::Roles>>,
}

pub fn run(a: Args) -> anyhow::Result<i32> {
    anyhow::ensure!(a.nodes > 0, "--nodes must be at least 1");
    let runtime = a.rt.resolve()?;
    let work = a.rt.work("cl")?;
    let rt = tokio::runtime::Runtime::new()?;
    let results = Arc::new(Mutex::new(Results::default()));
    let limit = Duration::from_secs_f64(a.max_minutes.max(0.1) * 60.0);
    let outcome = rt.block_on(async {
        let etcd = Etcd::start(&a.etcd_bin, work.path()).await?;
        let secret = format!("kiln-bench-{}", nonce());
        let roles: Arc<Mutex<Started>> = Default::default();
        let run = Run {
            a: &a,
            etcd: &etcd.url,
            dir: work.path(),
            runtime: &runtime,
            secret: &secret,
            results: &results,
            roles: &roles,
        };
        let body = measure(&run);
        let r = tokio::select! {
            r = tokio::time::timeout(limit, body) => r.unwrap_or_else(|_| {
                Err(anyhow::anyhow!("stopped at the bound of {} minute(s)", a.max_minutes))
            }),
            _ = kiln_server::stop_signal() => Err(anyhow::anyhow!("interrupted")),
        };
        let started = std::mem::take(&mut *roles.lock().unwrap_or_else(|p| p.into_inner()));
        if let Some(roles) = started.gateway {
            roles.kill_all().await;
        }
        if let Some(roles) = started.resume {
            roles.kill_all().await;
        }
        r
    });
    // The processes left (node, control, etcd) stop as they are dropped; then nothing under
    // the work directory may be left running or mounted.
    rt.shutdown_timeout(Duration::from_secs(30));
    super::stale::clear(work.path());
    let r = results.lock().unwrap_or_else(|p| p.into_inner());
    print(&a, &runtime.label(), &r);
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&to_json(&r))?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    match outcome {
        Ok(_) => Ok(0),
        Err(e) => {
            eprintln!("kiln bench cluster: {e:#}");
            Ok(1)
        }
    }
}

fn nonce() -> String {
    use std::time::{SystemTime, UNIX_EPOCH};
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    format!("{:x}{:x}", t.as_nanos(), std::process::id())
}

/// What every part of a run shares: the arguments, etcd, the work directory, the runtime,
/// the cluster secret, where reports go and the roles started.
struct Run<'a> {
    a: &'a Args,
    etcd: &'a str,
    dir: &'a std::path::Path,
    runtime: &'a crate::drivers::BenchRuntime,
    secret: &'a str,
    results: &'a Mutex<Results>,
    roles: &'a Mutex<Started>,
}

/// Every part; each stores its report as soon as it has it.
async fn measure(run: &Run<'_>) -> anyhow::Result<()> {
    let a = run.a;
    let o = PlaceOptions {
        nodes: a.nodes,
        sandboxes: a.sandboxes,
        teams: a.teams,
        decisions: a.decisions,
    };
    // On a runtime of its own, dropped after it: the replica's view it loads keeps following
    // etcd in the background, which must not run on beside the gateway part.
    let url = run.etcd.to_string();
    let p = tokio::task::spawn_blocking(move || -> anyhow::Result<PlaceReport> {
        let rt = tokio::runtime::Runtime::new()?;
        let r = rt.block_on(place::run(&url, &o));
        rt.shutdown_timeout(Duration::from_secs(5));
        r
    })
    .await??;
    run.results.lock().unwrap_or_else(|p| p.into_inner()).place = Some(p);
    if a.creates > 0 {
        measure_gateway(run).await?;
    }
    if let Some(endpoint) = &a.s3_endpoint {
        measure_resume(run, endpoint).await?;
    }
    Ok(())
}

/// The resume part: two nodes on the bucket at `endpoint` and a control replica.
async fn measure_resume(run: &Run<'_>, endpoint: &str) -> anyhow::Result<()> {
    let a = run.a;
    eprintln!("resume: starting two kiln nodes on the bucket and a kiln control …");
    let o = ResumeOptions {
        template: a.template.clone(),
        samples: a.resumes.max(1),
        mib: a.resume_mib,
        s3_endpoint: endpoint.to_string(),
        s3_bucket: a.s3_bucket.clone(),
    };
    let started = Arc::new(resume::start(run.etcd, run.dir, run.runtime, run.secret, &o).await?);
    run.roles.lock().unwrap_or_else(|p| p.into_inner()).resume = Some(started.clone());
    match resume::run(&started, &o).await {
        Ok(r) => run.results.lock().unwrap_or_else(|p| p.into_inner()).resume = Some(r),
        Err(e) => {
            eprintln!("{}", started.tail());
            anyhow::bail!("{e:#}");
        }
    }
    Ok(())
}

/// The gateway part: a real node and a control replica.
async fn measure_gateway(run: &Run<'_>) -> anyhow::Result<()> {
    let a = run.a;
    eprintln!("gateway: starting a kiln node and a kiln control …");
    let started = Arc::new(gateway::start(run.etcd, run.dir, run.runtime, run.secret).await?);
    run.roles.lock().unwrap_or_else(|p| p.into_inner()).gateway = Some(started.clone());
    let o = GatewayOptions {
        template: a.template.clone(),
        creates: a.creates,
        execs: a.execs,
    };
    let g = gateway::run(&started, &o).await;
    if let Err(e) = &g {
        eprintln!(
            "---- node log (tail) ----\n{}\n---- control log (tail) ----\n{}\n---- control \
             --audit off log (tail) ----\n{}",
            started.node.tail(),
            started.control.tail(),
            started.quiet.tail()
        );
        anyhow::bail!("{e:#}");
    }
    run.results
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .gateway = g.ok();
    Ok(())
}

fn row(name: &str, p: &Percentiles, base: Option<&Percentiles>) {
    let ratio = base
        .map(|b| format!("{:>6.2}x", p.p50_ms / b.p50_ms))
        .unwrap_or_else(|| "      -".into());
    println!(
        "  {name:<52} n={:<5} p50 {:>8.2} ms   p99 {:>8.2} ms   p50 vs base {ratio}",
        p.n, p.p50_ms, p.p99_ms
    );
}

fn verdict(ok: bool) -> &'static str {
    if ok {
        "met"
    } else {
        "NOT met"
    }
}

fn print(a: &Args, label: &str, r: &Results) {
    println!("kiln bench cluster ({label}; etcd on 127.0.0.1, one member):");
    match &r.place {
        Some(p) => {
            println!(
                "placement: {} simulated sandboxes ({} teams, 1 in 10 paused) on {} simulated \
                 nodes, published in {:.1} s; the replica's view loaded in {:.0} ms",
                p.sandboxes, p.teams, p.nodes, p.load_secs, p.view_ms
            );
            println!(
                "  base = one etcd read of one key; decision = ClusterService::decide (team \
                 quota and seats read from etcd, the team's live sandboxes counted, best of 2)"
            );
            row("base  etcd get", &p.etcd_get, None);
            row("decision, team quota set", &p.with_quota, Some(&p.etcd_get));
            row(
                "decision, no team quota",
                &p.without_quota,
                Some(&p.etcd_get),
            );
            println!(
                "  target: decision p99 <= 20 ms: {}",
                verdict(p.with_quota.p99_ms <= 20.0 && p.without_quota.p99_ms <= 20.0),
            );
        }
        None => println!("placement: not measured"),
    }
    match &r.gateway {
        Some(g) => {
            println!(
                "gateway: one kiln node (template {}, no warm pool) and one kiln control; \
                 {} creates each way, interleaved",
                a.template, g.creates
            );
            // Each kind: what its base is, then the direct side and the gateway's beside it.
            for (base, straight, through, direct, gateway) in [
                (
                    "POST /internal/v1/sandboxes on the node (what the control forwards), \
                     request → 201",
                    "base  create straight on the node",
                    "create through the control (POST /sandboxes)",
                    &g.direct_create,
                    &g.gateway_create,
                ),
                (
                    "envd Process.Start of `bash -l -c true` through a tunnel straight into \
                     the node, start → end event",
                    "base  exec straight to the node",
                    "exec through the control's gateway",
                    &g.direct_exec,
                    &g.gateway_exec,
                ),
                (
                    "envd Process.Start of `/bin/true` (no shell) through a tunnel straight \
                     into the node, start → end event",
                    "base  bare exec straight to the node",
                    "bare exec through the control's gateway",
                    &g.direct_bare,
                    &g.gateway_bare,
                ),
                (
                    "envd Process.Start of `/bin/true` (no shell) through a tunnel straight \
                     into the node, start → end event",
                    "base  bare exec straight to the node",
                    "bare exec through a replica run with --audit off",
                    &g.quiet_direct_bare,
                    &g.quiet_bare,
                ),
                (
                    "envd GET /health (no process started) through a tunnel straight into the \
                     node",
                    "base  health straight to the node",
                    "health through the control's gateway",
                    &g.direct_health,
                    &g.gateway_health,
                ),
            ] {
                println!("  base = {base}");
                row(straight, direct, None);
                row(through, gateway, Some(direct));
            }
            println!(
                "  the gateway's extra time, median of paired differences (each gateway sample \
                 less the direct one beside it), 95% CI:"
            );
            for (what, h) in [
                ("login-shell exec", &g.exec_hop),
                ("bare exec", &g.bare_hop),
                ("bare, audit off", &g.quiet_bare_hop),
                ("health", &g.health_hop),
            ] {
                println!(
                    "    {what:<18} n={:<5} {:>6.2} ms  ({:.2} to {:.2} ms)",
                    h.n, h.median_ms, h.ci_ms.0, h.ci_ms.1
                );
            }
            let ratio = g.gateway_create.p50_ms / g.direct_create.p50_ms;
            let (hop, quiet) = (g.bare_hop.median_ms, g.quiet_bare_hop.median_ms);
            println!(
                "  target: create through the gateway <= 1.1x: {ratio:.2}x {}; a proxied exec's \
                 extra hop <= 1 ms p50 (bare exec, median of pairs): {hop:.2} ms {} with the \
                 audit tap, {quiet:.2} ms {} without",
                verdict(ratio <= 1.1),
                verdict(hop <= 1.0),
                verdict(quiet <= 1.0)
            );
        }
        None => println!("gateway: not measured"),
    }
    match &r.resume {
        Some(m) => print_resume(m),
        None => println!("resume: not measured (give --s3-endpoint and a bucket)"),
    }
}

fn print_resume(m: &ResumeReport) {
    println!(
        "resume: two kiln nodes sharing a bucket, one kiln control; {} paused sandboxes with \
         {} MiB in memory",
        m.samples, m.mib
    );
    println!("  base = connect on the sandbox's own node (no copy), request → first command's end");
    row(
        "pause (the checkpoint uploaded before the answer)",
        &m.pause,
        None,
    );
    row("base  resume on its own node", &m.same_node, None);
    row(
        "resume on the other node (fetched from the bucket)",
        &m.other_node,
        Some(&m.same_node),
    );
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    println!(
        "  the fetch: median {:.1} MiB from the bucket at {:.1} MB/s (the rest from the chunk \
         cache or repeated chunks)",
        median(&m.fetched_mib),
        median(&m.fetch_mb_s)
    );
}

fn pj(p: &Percentiles) -> serde_json::Value {
    json!({"n": p.n, "p50_ms": p.p50_ms, "p99_ms": p.p99_ms})
}

fn to_json(r: &Results) -> serde_json::Value {
    json!({
        "placement": r.place.as_ref().map(|p| json!({
            "nodes": p.nodes, "sandboxes": p.sandboxes, "teams": p.teams,
            "publish_secs": p.load_secs, "view_load_ms": p.view_ms,
            "etcd_get": pj(&p.etcd_get), "decision_with_quota": pj(&p.with_quota),
            "decision_without_quota": pj(&p.without_quota),
        })),
        "gateway": r.gateway.as_ref().map(|g| json!({
            "create_direct": pj(&g.direct_create), "create_through_control": pj(&g.gateway_create),
            "create_ratio_p50": g.gateway_create.p50_ms / g.direct_create.p50_ms,
            "exec_direct": pj(&g.direct_exec), "exec_through_gateway": pj(&g.gateway_exec),
            "exec_extra_hop_p50_ms": g.exec_hop.median_ms,
            "exec_extra_hop_ci_ms": [g.exec_hop.ci_ms.0, g.exec_hop.ci_ms.1],
            "bare_exec_direct": pj(&g.direct_bare), "bare_exec_through_gateway": pj(&g.gateway_bare),
            "bare_exec_extra_hop_p50_ms": g.bare_hop.median_ms,
            "bare_exec_extra_hop_ci_ms": [g.bare_hop.ci_ms.0, g.bare_hop.ci_ms.1],
            "bare_exec_audit_off_direct": pj(&g.quiet_direct_bare),
            "bare_exec_through_gateway_audit_off": pj(&g.quiet_bare),
            "bare_exec_audit_off_extra_hop_p50_ms": g.quiet_bare_hop.median_ms,
            "bare_exec_audit_off_extra_hop_ci_ms": [g.quiet_bare_hop.ci_ms.0, g.quiet_bare_hop.ci_ms.1],
            "health_extra_hop_p50_ms": g.health_hop.median_ms,
            "health_extra_hop_ci_ms": [g.health_hop.ci_ms.0, g.health_hop.ci_ms.1],
            "health_direct": pj(&g.direct_health), "health_through_gateway": pj(&g.gateway_health),
        })),
        "resume": r.resume.as_ref().map(|m| json!({
            "samples": m.samples, "memory_mib": m.mib, "pause": pj(&m.pause),
            "same_node": pj(&m.same_node), "other_node": pj(&m.other_node),
            "ratio_p50": m.other_node.p50_ms / m.same_node.p50_ms,
            "fetched_mib": m.fetched_mib, "fetch_mb_s": m.fetch_mb_s,
        })),
    })
}
