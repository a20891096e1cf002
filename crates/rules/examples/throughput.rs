//! The engine's throughput with the built-in pack on a synthetic stream (what `kiln bench
//! rules` prints), runnable without building the whole `kiln` binary:
//! `cargo run --release -p kiln-rules --example throughput [RECORDS]`.

use std::sync::Arc;

use kiln_rules::bench::{measure, synthetic_stream};
use kiln_rules::RuleSet;

fn main() {
    let n = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(200_000);
    let set = Arc::new(RuleSet::default_pack());
    let r = measure(&set, &synthetic_stream(n), 5);
    println!(
        "{} rules, {n} records, records per CPU second (wall): evaluation {:.0} ({:.0}), \
         parse + evaluation {:.0} ({:.0}); {} alerts",
        set.rules.len(),
        r.eval_per_s,
        r.eval_per_wall_s,
        r.full_per_s,
        r.full_per_wall_s,
        r.alerts
    );
}
