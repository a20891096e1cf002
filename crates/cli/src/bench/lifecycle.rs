//! `kiln bench lifecycle`: pause, resume, fork (1 and 5 children) and create from a warm pool
//! (sequential and 10 at once), beside the runtime's raw checkpoint and restore of the same
//! sandbox measured in the same run.

use std::sync::Arc;

use super::lifecycle_bench::{lifecycle_bench, LifecycleBenchOptions};
use super::stats::Percentiles;
use anyhow::Context;

#[derive(clap::Args)]
pub struct Args {
    /// Template to start sandboxes from.
    #[arg(long, default_value = "base")]
    template: String,
    /// Pause/resume rounds (each also measures a raw checkpoint and restore).
    #[arg(long, default_value_t = 20)]
    rounds: usize,
    /// Forks of each size (1 and 5 children).
    #[arg(long, default_value_t = 5)]
    fork_rounds: usize,
    /// Sequential creates from the warm pool.
    #[arg(long, default_value_t = 20)]
    pool_creates: usize,
    #[command(flatten)]
    rt: super::RuntimeArgs,
}

pub fn run(a: Args) -> anyhow::Result<i32> {
    let store = kiln_template::Store::open_default().context("opening the template store")?;
    let runtime = a.rt.resolve()?;
    let work_root = a.rt.work_root()?;
    let opts = LifecycleBenchOptions {
        template: a.template,
        rounds: a.rounds.max(1),
        fork_rounds: a.fork_rounds.max(1),
        pool_creates: a.pool_creates.max(1),
    };
    let rt = tokio::runtime::Runtime::new()?;
    let r = rt
        .block_on(lifecycle_bench(
            &opts,
            &runtime,
            &work_root,
            Arc::new(store),
        ))
        .map_err(|e| anyhow::anyhow!(e))?;
    let tool = runtime.baseline().tool().to_string();
    let row = |name: &str, p: &Percentiles, base: Option<(&str, &Percentiles)>| {
        let ratio = base
            .map(|(what, b)| format!("{:>5.2}x raw {what}", p.p50_ms / b.p50_ms))
            .unwrap_or_default();
        println!(
            "{name:<40} n={:<3} p50 {:>8.1} ms   p99 {:>8.1} ms   {ratio}",
            p.n, p.p50_ms, p.p99_ms,
        );
    };
    println!(
        "kiln bench lifecycle ({}, template {}):",
        runtime.label(),
        opts.template
    );
    println!("  raw = the {tool} command alone on the same sandbox (agent detached beforehand)");
    row(&format!("raw   {tool} checkpoint"), &r.raw_checkpoint, None);
    row(&format!("raw   {tool} restore"), &r.raw_restore, None);
    row(
        "kiln  pause (memory)",
        &r.pause,
        Some(("checkpoint", &r.raw_checkpoint)),
    );
    row(
        "kiln  resume (connect, agent answers)",
        &r.resume,
        Some(("restore", &r.raw_restore)),
    );
    row(
        "kiln  fork, 1 child answering",
        &r.fork1,
        Some(("restore", &r.raw_restore)),
    );
    row(
        "kiln  fork, 5 children answering",
        &r.fork5,
        Some(("restore", &r.raw_restore)),
    );
    // The parent of a fork continues after its children answered: its downtime, from the
    // start of the fork until its agent answers again.
    row(
        "kiln  fork, 1 child: parent answering again",
        &r.fork1_parent,
        Some((
            "checkpoint + restore",
            &sum(&r.raw_checkpoint, &r.raw_restore),
        )),
    );
    // The pause's background work (deleting the checkpointed container) overlaps the
    // resume's restore under a new container id: the pair beside the pair of raw commands.
    println!(
        "      pause + resume back to back vs raw checkpoint + restore: {:>5.2}x",
        (r.pause.p50_ms + r.resume.p50_ms) / (r.raw_checkpoint.p50_ms + r.raw_restore.p50_ms)
    );
    // A fork is by nature a checkpoint of the parent plus a restore of each child: the same
    // forks beside the sum of the two raw commands.
    let both = r.raw_checkpoint.p50_ms + r.raw_restore.p50_ms;
    for (name, p) in [("1 child", &r.fork1), ("5 children", &r.fork5)] {
        println!(
            "      fork, {name:<11} vs raw checkpoint + restore ({both:.1} ms): {:>5.2}x",
            p.p50_ms / both
        );
    }
    row(
        "kiln  create from warm pool, sequential",
        &r.pool_sequential,
        None,
    );
    row(
        "kiln  create from warm pool, 10 at once",
        &r.pool_concurrent,
        None,
    );
    println!("  targets: pool p50 <= 25 ms, p99 <= 100 ms; pause/resume <= 1.2x raw; fork child <= 1.3x raw restore");
    Ok(0)
}

/// The sum of two commands' percentiles (their p50s and p99s added), as a baseline for
/// what runs one after the other.
fn sum(a: &Percentiles, b: &Percentiles) -> Percentiles {
    Percentiles {
        n: a.n.min(b.n),
        p50_ms: a.p50_ms + b.p50_ms,
        p99_ms: a.p99_ms + b.p99_ms,
    }
}
