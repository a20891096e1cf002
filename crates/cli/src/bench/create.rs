//! `kiln bench create`: sandbox create → first `echo` output (sequential and concurrent) vs the
//! raw `runsc run` floor, in the same run.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use kiln_server::bench::{create_bench, CreateBenchOptions};

#[derive(clap::Args)]
pub struct Args {
    /// Template to start sandboxes from.
    #[arg(long, default_value = "base")]
    template: String,
    /// Sequential creates.
    #[arg(long, default_value_t = 50)]
    n: usize,
    /// Concurrent creates (one wave).
    #[arg(long, default_value_t = 20)]
    concurrency: usize,
    /// Raw `runsc run` samples.
    #[arg(long, default_value_t = 20)]
    raw: usize,
    /// gVisor platform.
    #[arg(long, default_value = "ptrace")]
    platform: String,
    /// Directory for the bench's temporary state (default: the kiln state dir).
    #[arg(long)]
    work_dir: Option<PathBuf>,
    /// Extra template made of a bare rootfs directory, NAME=DIR.
    #[arg(long = "template-dir", value_name = "NAME=DIR")]
    template_dirs: Vec<String>,
}

pub fn run(a: Args) -> anyhow::Result<i32> {
    let store = kiln_template::Store::open_default().context("opening the template store")?;
    let mut extra = Vec::new();
    for spec in &a.template_dirs {
        let (name, dir) = spec
            .split_once('=')
            .with_context(|| format!("--template-dir {spec:?}: expected NAME=DIR"))?;
        extra.push(kiln_server::templates::from_dir(name, &PathBuf::from(dir)));
    }
    let templates = Arc::new(kiln_server::templates::Chain(
        store,
        kiln_server::templates::FixedTemplates(extra),
    ));
    let opts = CreateBenchOptions {
        template: a.template,
        sequential: a.n,
        concurrency: a.concurrency,
        raw: a.raw,
        platform: a.platform,
        work_dir: a
            .work_dir
            .unwrap_or_else(|| kiln_host::paths::state_dir().join("bench")),
    };
    let rt = tokio::runtime::Runtime::new()?;
    let r = rt
        .block_on(create_bench(&opts, templates))
        .map_err(|e| anyhow::anyhow!(e))?;
    let row = |name: &str, p: &kiln_server::bench::Percentiles| {
        println!(
            "{name:<34} n={:<3} p50 {:>8.1} ms   p99 {:>8.1} ms   p50 ratio vs raw {:>5.2}x",
            p.n,
            p.p50_ms,
            p.p99_ms,
            p.p50_ms / r.raw.p50_ms
        );
    };
    println!("kiln bench create (gVisor, platform {}):", opts.platform);
    row("raw floor: runsc run echo", &r.raw);
    row("create → first echo, sequential", &r.sequential);
    row(
        &format!("create → first echo, {} concurrent", opts.concurrency),
        &r.concurrent,
    );
    Ok(0)
}
