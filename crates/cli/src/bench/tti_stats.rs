//! ComputeSDK's statistics for `kiln bench tti` (`computesdk/benchmarks`, see
//! docs/benchmarks.md): the fastest and slowest 5 % of successful iterations are trimmed before
//! median, p95 and p99 (linear interpolation between ranks); min and max use every successful
//! iteration. Each metric scores `100 × (1 − ms / 10 000)` (0 at ≥ 10 s); `timing = 0.6·median
//! + 0.25·p95 + 0.15·p99` of those scores; `composite = timing × successRate`.

use serde_json::{json, Value};

use super::stats::quantile;

/// The summary of one mode's iterations.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    pub n: usize,
    pub ok: usize,
    pub min: f64,
    pub median: f64,
    pub p95: f64,
    pub p99: f64,
    pub max: f64,
    pub success_rate: f64,
    pub composite: f64,
}

/// ComputeSDK's score of one latency.
fn score(ms: f64) -> f64 {
    (100.0 * (1.0 - ms / 10_000.0)).clamp(0.0, 100.0)
}

/// The composite score of median/p95/p99 (ms) at `success_rate` (0–1).
pub fn composite(median: f64, p95: f64, p99: f64, success_rate: f64) -> f64 {
    if median.is_nan() {
        return 0.0;
    }
    (0.6 * score(median) + 0.25 * score(p95) + 0.15 * score(p99)) * success_rate
}

/// Summarises `n` iterations of which `ok_ms` (milliseconds) succeeded.
pub fn summarize(n: usize, ok_ms: &[f64]) -> Summary {
    let v = super::stats::sorted(ok_ms);
    let trim = v.len() * 5 / 100;
    let kept = &v[trim..v.len() - trim];
    let success_rate = if n == 0 {
        0.0
    } else {
        v.len() as f64 / n as f64
    };
    let (median, p95, p99) = (
        quantile(kept, 0.5),
        quantile(kept, 0.95),
        quantile(kept, 0.99),
    );
    Summary {
        n,
        ok: v.len(),
        min: v.first().copied().unwrap_or(f64::NAN),
        median,
        p95,
        p99,
        max: v.last().copied().unwrap_or(f64::NAN),
        success_rate,
        composite: composite(median, p95, p99, success_rate),
    }
}

/// Rounds to two decimals (as ComputeSDK's files do); NaN becomes 0.
pub fn r2(x: f64) -> f64 {
    if x.is_finite() {
        (x * 100.0).round() / 100.0
    } else {
        0.0
    }
}

/// One mode's entry of ComputeSDK's `results` array, from the client's mode object
/// (`mode`, `iterations`, `wallClockMs`, `timeToFirstReadyMs`).
pub fn result_entry(m: &Value, n: usize, stagger_ms: f64) -> (Value, Summary) {
    let iterations = m["iterations"].as_array().cloned().unwrap_or_default();
    let ok: Vec<f64> = iterations
        .iter()
        .filter(|i| i.get("error").is_none())
        .filter_map(|i| i["ttiMs"].as_f64())
        .collect();
    let s = summarize(iterations.len().max(n), &ok);
    let mode = m["mode"].as_str().unwrap_or("");
    let mut e = json!({
        "provider": "kiln",
        "mode": if mode == "burst" { "concurrent" } else { mode },
        "wallClockMs": m["wallClockMs"],
        "timeToFirstReadyMs": m["timeToFirstReadyMs"],
        "iterations": iterations,
        "summary": {"ttiMs": {"min": r2(s.min), "median": r2(s.median), "p95": r2(s.p95),
                              "p99": r2(s.p99), "max": r2(s.max)}},
        "compositeScore": r2(s.composite),
        "successRate": s.success_rate,
    });
    match mode {
        "burst" => e["concurrency"] = json!(n),
        "staggered" => e["staggerDelayMs"] = json!(stagger_ms),
        _ => {}
    }
    (e, s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn composite_matches_a_published_score() {
        // archil's burst of 2026-10-09: 190.16 / 389.57 / 439.69 ms at 100 % → 97.23.
        assert_eq!(r2(composite(190.16, 389.57, 439.69, 1.0)), 97.23);
        assert_eq!(composite(20_000.0, 20_000.0, 20_000.0, 1.0), 0.0);
    }

    #[test]
    fn trimming_and_success_rate() {
        // 20 successes of 1..=20 ms out of 25: one trimmed at each end.
        let ok: Vec<f64> = (1..=20).map(f64::from).collect();
        let s = summarize(25, &ok);
        assert_eq!((s.ok, s.min, s.max), (20, 1.0, 20.0));
        assert_eq!(s.median, 10.5);
        assert!((s.p95 - 18.15).abs() < 1e-9, "{}", s.p95);
        assert_eq!(s.success_rate, 0.8);
        let none = summarize(3, &[]);
        assert_eq!((none.success_rate, none.composite), (0.0, 0.0));
    }
}
