//! `kiln bench template`: the Template API of an in-process kiln server, each number beside a
//! raw baseline measured in the same run:
//!
//! - a cold build (`force`) of a 3-step template on a cached image (E2B's base image, kiln's
//!   `base`), beside the three steps' own run time in a sandbox;
//! - a rebuild with the last step changed (the first two cached; the step runs on the
//!   sandbox the previous build left standing on its parent layer), beside that step's own
//!   run time (target ≤ 1.2×);
//! - create → first command from a template with a start command (its running snapshot
//!   restored), beside the runtime's raw restore of the same snapshot's checkpoint into the
//!   sandbox just created (target ≤ 1.3×, see [`SandboxBaseline::restore_snapshot`]) and a
//!   cold boot of the base that runs the start command until ready;
//! - pulling a 3-layer image from a loopback docker-registry (MB/s, target ≥ 200) beside
//!   plain HTTP GETs of the same blobs.

use std::time::{Duration, Instant};

use anyhow::Context;
use kiln_driver::baseline::SandboxBaseline;

use super::stats::{percentiles, Percentiles};
use super::template_api::{noise, Api, Registry};

#[derive(clap::Args)]
pub struct Args {
    /// Cold builds and rebuilds measured (each).
    #[arg(long, default_value_t = 3)]
    builds: usize,
    /// Seconds the changed last step runs (`sleep`), so the rebuild's overhead shows as a ratio.
    #[arg(long, default_value_t = 5)]
    step_secs: u32,
    /// Creates from the started template (and cold boots beside them).
    #[arg(long, default_value_t = 5)]
    creates: usize,
    /// Pulls of the 3-layer image (each into an empty layer cache).
    #[arg(long, default_value_t = 5)]
    pulls: usize,
    /// MiB of each of the image's 3 layers.
    #[arg(long, default_value_t = 32)]
    layer_mib: usize,
    #[command(flatten)]
    rt: super::RuntimeArgs,
}

/// The start command of the started template: ready two seconds after it starts.
const START: &str = "sleep 2; touch /tmp/kiln-ready; sleep 100000";
const READY: &str = "test -f /tmp/kiln-ready";
/// The pause before each timed create or restore.
const SETTLE: Duration = Duration::from_secs(2);

pub fn run(a: Args) -> anyhow::Result<i32> {
    let sb = super::server_bench(&a.rt, "tpl")?;
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async move {
        let reg = Registry::start(sb.work.path())?;
        let mut setup =
            super::server_config(sb.work.path(), sb.driver.clone(), Default::default())?;
        setup.server.template_builds.gc_interval = None;
        setup.server.template_builds.registry_mirrors =
            kiln_template::oci::Mirrors::parse(&[format!("docker.io=http://{}", reg.addr)])?;
        // The server runs on the bench's own driver, whose runtime commands give the raw
        // restore of the same snapshot.
        let bench = sb.runtime.driver(&setup.driver, sb.work.path())?;
        let server =
            kiln_server::Server::prepare(setup.server, bench.driver, sb.templates.clone()).await?;
        let key = server
            .first_key
            .as_ref()
            .context("the bench's server made no API key")?
            .secret
            .clone();
        let (addr, manager) = (server.local_addr, server.manager.clone());
        let served = super::served::BackgroundServer::spawn(server);
        let api = Api {
            addr,
            key,
            http: reqwest::Client::new(),
        };
        let r = measure(&a, &api, &reg, sb.work.path(), &manager, bench.raw.as_ref()).await;
        served.end("bench template done").await;
        // The templates' layers stay mounted after the server (they are its state): the work
        // directory goes whole, with the registry that ran in it.
        drop(reg);
        super::stale::clear(sb.work.path());
        let r = r?;
        print(&a, &sb.runtime, &r);
        Ok(0)
    })
}

struct Report {
    cold: Percentiles,
    steps_raw: Percentiles,
    rebuild: Percentiles,
    /// Rebuilds whose step ran on the standing build sandbox.
    on_standing: usize,
    step_raw: Percentiles,
    from_snapshot: Percentiles,
    create_only: Percentiles,
    raw_restore: Percentiles,
    cold_boot: Percentiles,
    pull_mbs: Vec<f64>,
    raw_mbs: Vec<f64>,
    image_mb: f64,
}

async fn measure(
    a: &Args,
    api: &Api,
    reg: &Registry,
    work: &std::path::Path,
    manager: &kiln_server::manager::Manager,
    raw: &dyn SandboxBaseline,
) -> anyhow::Result<Report> {
    let first = ["echo one > ~/1".to_string(), "echo two > ~/2".to_string()];
    let last = |n: usize| format!("sleep {}; echo {n} > ~/3", a.step_secs);
    let steps = |n: usize| {
        let mut v = first.to_vec();
        v.push(last(n));
        v
    };
    // Warm-up: the base template booted once, the cache of the first two steps filled.
    api.build("bench-tpl", "base", &steps(0), None, false)
        .await?;

    // Each build starts on a quiet host, as a person's next build does: after the previous
    // one's standing build sandbox (of its last step's parent layer) has booted.
    let mut cold = Vec::new();
    for i in 0..a.builds {
        tokio::time::sleep(SETTLE).await;
        cold.push(
            api.build("bench-tpl", "base", &steps(1000 + i), None, true)
                .await?
                .took,
        );
    }
    let (mut rebuild, mut on_standing) = (Vec::new(), 0);
    for i in 0..a.builds {
        tokio::time::sleep(SETTLE).await;
        let b = api
            .build("bench-tpl", "base", &steps(2000 + i), None, false)
            .await?;
        rebuild.push(b.took);
        on_standing += usize::from(b.standing);
    }
    // The steps' own run time: the same commands in a sandbox of the base.
    let s = api.create("base").await?;
    let (mut steps_raw, mut step_raw) = (Vec::new(), Vec::new());
    for i in 0..a.builds {
        let t = Instant::now();
        for c in steps(3000 + i) {
            anyhow::ensure!(s.run(&c).await?, "step {c:?} failed in a sandbox");
        }
        steps_raw.push(t.elapsed());
        let t = Instant::now();
        anyhow::ensure!(s.run(&last(4000 + i)).await?, "the last step failed");
        step_raw.push(t.elapsed());
    }
    api.kill(&s).await;
    // The creates below start on a quiet host: without the rebuilds' standing sandbox.
    api.delete_template("bench-tpl").await?;

    // A template that starts already running, and the same start command booted cold.
    api.build(
        "bench-started",
        "base",
        &first[..1],
        Some((START, READY)),
        false,
    )
    .await?;
    let (mut from_snapshot, mut create_only, mut raw_restore, mut cold_boot) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..a.creates {
        // Each timed part starts on a quiet host: the base's warm pool refilled and the
        // sandboxes killed before torn down (on a small host, a boot beside a restore is
        // what the restore measures otherwise).
        tokio::time::sleep(SETTLE).await;
        let t = Instant::now();
        let s = api.create("bench-started").await?;
        create_only.push(t.elapsed());
        anyhow::ensure!(s.run(READY).await?, "the started template is not ready");
        from_snapshot.push(t.elapsed());
        // The snapshot the sandbox continues from: its alias is `<snapshot id>:<tag>`.
        let alias = manager.get(&s.id)?.alias.unwrap_or_default();
        let snap = alias.split(':').next().unwrap_or_default();
        anyhow::ensure!(
            kiln_server::manager::is_snapshot_id(snap),
            "the started template's sandbox names no snapshot ({alias:?})"
        );
        raw_restore.push(raw.restore_snapshot(&s.id, snap).await?);
        api.kill(&s).await;
        tokio::time::sleep(SETTLE).await;
        let t = Instant::now();
        let s = api.create("base").await?;
        s.run(&format!("nohup bash -c '{START}' >/dev/null 2>&1 &"))
            .await?;
        while !s.run(READY).await? {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        cold_boot.push(t.elapsed());
        api.kill(&s).await;
    }

    // Pulls of a 3-layer image into an empty layer cache each time.
    let layers: Vec<Vec<u8>> = (0..3)
        .map(|i| noise(a.layer_mib << 20, 0x9e37_79b9 + i))
        .collect();
    let digests = reg.push("library/kiln-bench", "3layers", &layers).await?;
    let bytes: usize = layers.iter().map(Vec::len).sum();
    let image_mb = bytes as f64 / 1e6;
    let opts = kiln_template::oci::PullOptions {
        mirrors: kiln_template::oci::Mirrors::parse(&[format!("docker.io=http://{}", reg.addr)])?,
        quiet: true,
        ..Default::default()
    };
    let (mut pull_mbs, mut raw_mbs) = (Vec::new(), Vec::new());
    for _ in 0..a.pulls {
        let dir = tempfile::Builder::new().prefix("blobs").tempdir_in(work)?;
        let blobs =
            kiln_template::oci::blobs::Blobs::open(dir.path().join("b"), dir.path().join("tmp"))?;
        let t = Instant::now();
        kiln_template::oci::registry::pull(&blobs, "kiln-bench:3layers", &opts).await?;
        pull_mbs.push(image_mb / t.elapsed().as_secs_f64());
        let t = Instant::now();
        let n = reg.fetch_raw("library/kiln-bench", &digests).await?;
        raw_mbs.push(n as f64 / 1e6 / t.elapsed().as_secs_f64());
    }
    Ok(Report {
        cold: percentiles(&cold),
        steps_raw: percentiles(&steps_raw),
        rebuild: percentiles(&rebuild),
        on_standing,
        step_raw: percentiles(&step_raw),
        from_snapshot: percentiles(&from_snapshot),
        create_only: percentiles(&create_only),
        raw_restore: percentiles(&raw_restore),
        cold_boot: percentiles(&cold_boot),
        pull_mbs,
        raw_mbs,
        image_mb,
    })
}

fn print(a: &Args, runtime: &crate::drivers::BenchRuntime, r: &Report) {
    let row = |name: &str, p: &Percentiles, base: Option<(&str, &Percentiles)>| {
        let ratio = base
            .map(|(what, b)| format!("{:>5.2}x {what}", p.p50_ms / b.p50_ms))
            .unwrap_or_default();
        println!(
            "{name:<44} n={:<3} p50 {:>8.1} ms   p99 {:>8.1} ms   {ratio}",
            p.n, p.p50_ms, p.p99_ms,
        );
    };
    println!(
        "kiln bench template ({}; last step `sleep {}`):",
        runtime.label(),
        a.step_secs
    );
    row("raw   the 3 steps run in a sandbox", &r.steps_raw, None);
    row("raw   the last step run in a sandbox", &r.step_raw, None);
    row(
        "kiln  cold build, 3 steps on `base` (force)",
        &r.cold,
        Some(("the steps' own run", &r.steps_raw)),
    );
    row(
        "kiln  rebuild, last step changed",
        &r.rebuild,
        Some(("the step's own run", &r.step_raw)),
    );
    println!(
        "      ({} of {} rebuilds ran their step on the standing build sandbox)",
        r.on_standing, r.rebuild.n
    );
    let tool = runtime.baseline().tool().to_string();
    row(
        &format!("raw   {tool} restore of the started tpl's checkpoint"),
        &r.raw_restore,
        None,
    );
    row(
        "base  cold boot + start cmd until ready",
        &r.cold_boot,
        None,
    );
    row(
        "kiln  create → first command, started tpl",
        &r.from_snapshot,
        Some(("cold boot + start cmd", &r.cold_boot)),
    );
    row(
        "kiln  create → first command, started tpl",
        &r.from_snapshot,
        Some((&format!("raw {tool} restore"), &r.raw_restore)),
    );
    row(
        "kiln  create alone (POST /sandboxes), started",
        &r.create_only,
        Some((&format!("raw {tool} restore"), &r.raw_restore)),
    );
    let mut pull = r.pull_mbs.clone();
    let mut raw = r.raw_mbs.clone();
    let (pull, raw) = (
        super::stats::median(&mut pull),
        super::stats::median(&mut raw),
    );
    println!(
        "kiln  pull of a 3-layer image ({:.0} MB) from loopback docker-registry: median {pull:>6.0} MB/s (n={})   {:>5.2}x raw HTTP GETs ({raw:.0} MB/s)",
        r.image_mb,
        r.pull_mbs.len(),
        pull / raw
    );
    println!(
        "  targets: rebuild <= 1.2x the step's own run; create from a started template <= 1.3x raw \
         {tool} restore of the same checkpoint; pull >= 200 MB/s"
    );
}
