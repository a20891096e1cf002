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
    /// Raw `runsc run` samples (of each variant).
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
    let row = |name: &str,
               p: &kiln_server::bench::Percentiles,
               base: Option<&kiln_server::bench::Percentiles>| {
        let ratio = base
            .map(|b| format!("{:>5.2}x", p.p50_ms / b.p50_ms))
            .unwrap_or_else(|| "     -".into());
        println!(
            "{name:<44} n={:<3} p50 {:>8.1} ms   p99 {:>8.1} ms   p50 vs raw {ratio}",
            p.n, p.p50_ms, p.p99_ms,
        );
    };
    println!(
        "kiln bench create (gVisor, platform {}, template {}):",
        opts.platform, opts.template
    );
    println!(
        "  raw   = `runsc run` of the template rootfs (read-only, no overlay/cgroups/agent), \
         spawn → first stdout line"
    );
    println!(
        "  kiln  = Manager::create (overlay, bundle, runsc, agent ready, /init) + Process.Start \
         through the agent, create call → first stdout bytes"
    );
    println!(
        "  shell = `/bin/bash -l -c 'echo kiln-bench'` as the template user (what the SDK sends); \
         exec = `/bin/echo kiln-bench`"
    );
    row("raw   runsc run, shell", &r.raw_shell, None);
    row("raw   runsc run, exec", &r.raw_exec, None);
    row(
        "kiln  create → first echo, shell, sequential",
        &r.sequential,
        Some(&r.raw_shell),
    );
    row(
        "kiln  create → first echo, exec, sequential",
        &r.sequential_exec,
        Some(&r.raw_exec),
    );
    row(
        &format!(
            "kiln  create → first echo, shell, {} concurrent",
            opts.concurrency
        ),
        &r.concurrent,
        Some(&r.raw_shell),
    );
    row("kiln  kill (running sandbox)", &r.kill, None);
    Ok(0)
}
