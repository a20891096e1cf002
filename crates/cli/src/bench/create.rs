//! `kiln bench create`: sandbox create → first `echo` output (sequential and concurrent) vs the
//! runtime's raw run, the floor, in the same run.

use std::path::PathBuf;
use std::sync::Arc;

use super::create_bench::{create_bench, CreateBenchOptions};
use anyhow::Context;

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
    /// Raw run samples (of each variant).
    #[arg(long, default_value_t = 20)]
    raw: usize,
    #[command(flatten)]
    rt: super::RuntimeArgs,
    #[command(flatten)]
    compare: crate::drivers::CompareFlags,
    /// Rounds of the in-sandbox workload (fork+exec loop, python starts) per variant; 0 skips it.
    #[arg(long, default_value_t = 5)]
    workload_rounds: usize,
    /// Disk quota of each sandbox, MiB, as `kiln serve --disk-mb` (0: none; compare the two to
    /// see what the quota costs a create).
    #[arg(long, default_value_t = 2048)]
    disk_mb: u32,
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
    let runtime = a.rt.resolve()?;
    let variants = runtime.workload_variants(&a.compare);
    let work = a.rt.work("b")?;
    let opts = CreateBenchOptions {
        workload_rounds: a.workload_rounds,
        disk_mb: a.disk_mb,
        template: a.template,
        sequential: a.n,
        concurrency: a.concurrency,
        raw: a.raw,
    };
    let rt = tokio::runtime::Runtime::new()?;
    let r = rt
        .block_on(create_bench(
            &opts,
            &runtime,
            variants,
            work.path(),
            templates,
        ))
        .map_err(|e| anyhow::anyhow!(e))?;
    let tool = runtime.baseline().tool().to_string();
    let row =
        |name: &str, p: &super::stats::Percentiles, base: Option<&super::stats::Percentiles>| {
            let ratio = base
                .map(|b| format!("{:>5.2}x", p.p50_ms / b.p50_ms))
                .unwrap_or_else(|| "     -".into());
            println!(
                "{name:<44} n={:<3} p50 {:>8.1} ms   p99 {:>8.1} ms   p50 vs raw {ratio}",
                p.n, p.p50_ms, p.p99_ms,
            );
        };
    println!(
        "kiln bench create ({}, template {}):",
        runtime.label(),
        opts.template
    );
    println!(
        "  raw   = `{tool} run` of the template rootfs (read-only, no overlay/cgroups/agent), \
         spawn → first stdout line"
    );
    println!(
        "  kiln  = Manager::create (overlay, bundle, {tool}, agent ready, /init) + Process.Start \
         through the agent, create call → first stdout bytes"
    );
    println!(
        "  shell = `/bin/bash -l -c 'echo kiln-bench'` as the template user (what the SDK sends); \
         exec = `/bin/echo kiln-bench`"
    );
    row(&format!("raw   {tool} run, shell"), &r.raw_shell, None);
    row(&format!("raw   {tool} run, exec"), &r.raw_exec, None);
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
    print_workload(&r.workload);
    Ok(0)
}

fn print_workload(w: &[super::create_bench::WorkloadResult]) {
    if w.is_empty() {
        return;
    }
    println!(
        "workload inside the sandbox (raw `{} run`, median of {} rounds): \
         200 × fork+exec /bin/true; 5 × python3 -c 'import json'",
        w[0].tool, w[0].rounds
    );
    for x in w {
        println!(
            "  {:<3} {} {:<16} {:<8} fork+exec {:>8.1} ms   python {:>8.1} ms",
            x.variant, x.tool, x.version, x.platform, x.fork_exec_ms, x.python_ms
        );
    }
    let find = |r: &str, p: &str| w.iter().find(|x| x.variant == r && x.platform == p);
    let ratio = |name: &str,
                 a: Option<&super::create_bench::WorkloadResult>,
                 b: Option<&super::create_bench::WorkloadResult>| {
        if let (Some(a), Some(b)) = (a, b) {
            println!(
                "  ratio {name:<34} fork+exec {:>5.2}x   python {:>5.2}x",
                a.fork_exec_ms / b.fork_exec_ms,
                a.python_ms / b.python_ms
            );
        }
    };
    ratio(
        "new systrap / new ptrace",
        find("new", "systrap"),
        find("new", "ptrace"),
    );
    ratio(
        "new ptrace / old ptrace",
        find("new", "ptrace"),
        find("old", "ptrace"),
    );
    ratio(
        "new systrap / old ptrace",
        find("new", "systrap"),
        find("old", "ptrace"),
    );
}
