//! `kiln bench rules`: the rule engine's throughput on one core — audit records per second
//! through a rules file (the built-in pack by default), on a synthetic stream shaped like
//! kiln's records or on recorded audit (`kiln audit --json` output). See
//! [`kiln_rules::bench`]. Then, with sandboxes, attack → alert latency and the exec round trip
//! with the pack on vs off ([`super::rules_live`]).

use std::sync::Arc;

use anyhow::Context;
use kiln_rules::bench::{measure, synthetic_stream, Raw};
use kiln_rules::RuleSet;
use serde_json::Value;

#[derive(clap::Args)]
pub struct Args {
    /// Records per round.
    #[arg(long, default_value_t = 200_000)]
    records: usize,
    /// Rounds (the median is reported).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Rules file (default: the built-in pack).
    #[arg(long)]
    rules: Option<std::path::PathBuf>,
    /// Recorded audit instead of the synthetic stream: JSON lines as `kiln audit --json`
    /// prints them (replayed until `--records` are reached).
    #[arg(long, value_name = "FILE")]
    audit_json: Option<std::path::PathBuf>,
    /// Attack → alert samples with a sandbox (0, with `--exec-rounds 0`: the engine alone).
    #[arg(long, default_value_t = 100)]
    latency_runs: usize,
    /// Rounds of exec round trips, the pack on vs off (each: `--execs-per-round` on one
    /// server, then on the other).
    #[arg(long, default_value_t = 40)]
    exec_rounds: usize,
    /// Exec round trips per server in each round.
    #[arg(long, default_value_t = 10)]
    execs_per_round: usize,
    /// Template of the sandboxes.
    #[arg(long, default_value = "base")]
    template: String,
    #[command(flatten)]
    rt: super::RuntimeArgs,
}

fn recorded(p: &std::path::Path, n: usize) -> anyhow::Result<Vec<Raw>> {
    let text = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
    let recs: Vec<Value> = text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    anyhow::ensure!(
        !recs.is_empty(),
        "{} holds no audit records (JSON lines)",
        p.display()
    );
    Ok(recs
        .iter()
        .cycle()
        .take(n)
        .map(|r| {
            (
                r["sandboxID"].as_str().unwrap_or("s").to_string(),
                r["kind"].as_str().unwrap_or("").to_string(),
                r["body"].to_string(),
            )
        })
        .collect())
}

pub fn run(a: Args) -> anyhow::Result<i32> {
    let set = match &a.rules {
        Some(p) => RuleSet::load_file(p).map_err(|e| anyhow::anyhow!("{}:\n{e}", p.display()))?,
        None => RuleSet::default_pack(),
    };
    let set = Arc::new(set);
    let recs = match &a.audit_json {
        Some(p) => recorded(p, a.records)?,
        None => synthetic_stream(a.records),
    };
    println!(
        "rule engine: {} rules, {} {} records per round, {} rounds, one thread",
        set.rules.len(),
        recs.len(),
        if a.audit_json.is_some() {
            "recorded"
        } else {
            "synthetic"
        },
        a.rounds
    );
    let r = measure(&set, &recs, a.rounds);
    println!("alerts per round: {}", r.alerts);
    println!(
        "evaluation:          {:>10.0} records per CPU second ({:.0} per wall second)",
        r.eval_per_s, r.eval_per_wall_s
    );
    println!(
        "parse + evaluation:  {:>10.0} records per CPU second ({:.0} per wall second; \
         target ≥ 200,000 on one core)",
        r.full_per_s, r.full_per_wall_s
    );
    if a.latency_runs > 0 || a.exec_rounds > 0 {
        super::rules_live::run(super::rules_live::Live {
            template: a.template,
            latency_runs: a.latency_runs,
            exec_rounds: a.exec_rounds,
            execs_per_round: a.execs_per_round,
            rt: a.rt,
        })?;
    }
    if cfg!(debug_assertions) {
        println!("(a debug build: measure with a release build)");
    }
    Ok(0)
}
