//! The server's own counters and histograms, and a small writer of the Prometheus text
//! exposition format (version 0.0.4) for `GET /metrics`.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// Upper bounds (seconds) of the lifecycle latency histogram buckets.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// A cumulative histogram with fixed buckets.
#[derive(Debug, Clone, Default)]
pub struct Histogram {
    /// Count of observations `<= LATENCY_BUCKETS[i]`, per bucket (not yet cumulative).
    buckets: Vec<u64>,
    count: u64,
    sum: f64,
}

impl Histogram {
    pub fn observe(&mut self, secs: f64) {
        if self.buckets.is_empty() {
            self.buckets = vec![0; LATENCY_BUCKETS.len()];
        }
        if let Some(i) = LATENCY_BUCKETS.iter().position(|b| secs <= *b) {
            self.buckets[i] += 1;
        }
        self.count += 1;
        self.sum += secs;
    }
}

/// Counters the server bumps as it works.
#[derive(Default)]
pub struct Telemetry {
    lifecycle: Mutex<BTreeMap<&'static str, Histogram>>,
    pub proxy_requests: AtomicU64,
    pub proxy_errors: AtomicU64,
    pub proxy_request_bytes: AtomicU64,
    pub proxy_response_bytes: AtomicU64,
    pub agent_errors: AtomicU64,
    pub webhook_delivered: AtomicU64,
    pub webhook_failed_attempts: AtomicU64,
    /// Alerts raised by the rule engine, by (rule, priority).
    alerts: Mutex<BTreeMap<(String, String), u64>>,
}

impl Telemetry {
    /// Records how long one lifecycle operation (`create`, `pause`, `resume`, `fork`) took.
    pub fn observe(&self, op: &'static str, took: Duration) {
        self.lifecycle
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(op)
            .or_default()
            .observe(took.as_secs_f64());
    }

    /// Counts one alert of `rule` at `priority`.
    pub fn count_alert(&self, rule: &str, priority: &str) {
        *self
            .alerts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry((rule.to_string(), priority.to_string()))
            .or_default() += 1;
    }

    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// Writes the lifecycle histograms and the counters.
    pub fn write(&self, w: &mut Text) {
        w.family(
            "kiln_lifecycle_duration_seconds",
            "Latency of sandbox lifecycle operations as the API sees them.",
            "histogram",
        );
        let hists = self
            .lifecycle
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        for op in ["create", "pause", "resume", "fork"] {
            let h = hists.get(op).cloned().unwrap_or_default();
            let mut cum = 0;
            for (i, le) in LATENCY_BUCKETS.iter().enumerate() {
                cum += h.buckets.get(i).copied().unwrap_or(0);
                w.sample(
                    "kiln_lifecycle_duration_seconds_bucket",
                    &[("op", op), ("le", &fmt_f64(*le))],
                    cum as f64,
                );
            }
            let labels = [("op", op), ("le", "+Inf")];
            w.sample(
                "kiln_lifecycle_duration_seconds_bucket",
                &labels,
                h.count as f64,
            );
            w.sample("kiln_lifecycle_duration_seconds_sum", &[("op", op)], h.sum);
            w.sample(
                "kiln_lifecycle_duration_seconds_count",
                &[("op", op)],
                h.count as f64,
            );
        }
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed) as f64;
        let counters: [(&str, &str, &AtomicU64); 7] = [
            (
                "kiln_proxy_requests_total",
                "Requests proxied into sandboxes.",
                &self.proxy_requests,
            ),
            (
                "kiln_proxy_errors_total",
                "Proxied requests answered with a 5xx status (by kiln or the sandbox).",
                &self.proxy_errors,
            ),
            (
                "kiln_proxy_request_bytes_total",
                "Body bytes proxied into sandboxes.",
                &self.proxy_request_bytes,
            ),
            (
                "kiln_proxy_response_bytes_total",
                "Body bytes proxied out of sandboxes.",
                &self.proxy_response_bytes,
            ),
            (
                "kiln_agent_errors_total",
                "Failed calls to a sandbox agent by the metrics sampler.",
                &self.agent_errors,
            ),
            (
                "kiln_webhook_deliveries_total",
                "Webhook deliveries answered with a 2xx status.",
                &self.webhook_delivered,
            ),
            (
                "kiln_webhook_failed_attempts_total",
                "Webhook delivery attempts that failed (each retry counts).",
                &self.webhook_failed_attempts,
            ),
        ];
        for (name, help, c) in counters {
            w.family(name, help, "counter");
            w.sample(name, &[], get(c));
        }
        w.family(
            "kiln_alerts_total",
            "Alerts raised by the rule engine over the audit stream.",
            "counter",
        );
        let alerts = self
            .alerts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        for ((rule, priority), n) in alerts {
            w.sample(
                "kiln_alerts_total",
                &[("rule", &rule), ("priority", &priority)],
                n as f64,
            );
        }
    }
}

/// Prometheus formats floats like Go: `+Inf`, `NaN`, else the shortest round-trip form.
pub fn fmt_f64(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.into()
    } else {
        format!("{v}")
    }
}

fn escape_label(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

fn escape_help(v: &str) -> String {
    v.replace('\\', "\\\\").replace('\n', "\\n")
}

/// The exposition text being written.
#[derive(Default)]
pub struct Text(String);

impl Text {
    /// Starts a metric family (`# HELP` and `# TYPE`).
    pub fn family(&mut self, name: &str, help: &str, kind: &str) {
        let _ = writeln!(self.0, "# HELP {name} {}", escape_help(help));
        let _ = writeln!(self.0, "# TYPE {name} {kind}");
    }

    /// One sample line.
    pub fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) {
        self.0.push_str(name);
        if !labels.is_empty() {
            self.0.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.0.push(',');
                }
                let _ = write!(self.0, "{k}=\"{}\"", escape_label(v));
            }
            self.0.push('}');
        }
        let _ = writeln!(self.0, " {}", fmt_f64(value));
    }

    pub fn finish(self) -> String {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_labels_and_formats_values() {
        let mut t = Text::default();
        t.family("x_total", "a\nb", "counter");
        t.sample("x_total", &[("t", "a\"b\\c\nd")], 1.5);
        t.sample("x_total", &[], f64::INFINITY);
        let s = t.finish();
        assert_eq!(
            s,
            "# HELP x_total a\\nb\n# TYPE x_total counter\n\
             x_total{t=\"a\\\"b\\\\c\\nd\"} 1.5\nx_total +Inf\n"
        );
    }

    #[test]
    fn histogram_buckets_are_cumulative() {
        let t = Telemetry::default();
        t.observe("create", Duration::from_millis(3));
        t.observe("create", Duration::from_millis(300));
        t.observe("create", Duration::from_secs(100));
        let mut w = Text::default();
        t.write(&mut w);
        let s = w.finish();
        assert!(
            s.contains("kiln_lifecycle_duration_seconds_bucket{op=\"create\",le=\"0.005\"} 1\n")
        );
        assert!(s.contains("kiln_lifecycle_duration_seconds_bucket{op=\"create\",le=\"0.5\"} 2\n"));
        assert!(s.contains("kiln_lifecycle_duration_seconds_bucket{op=\"create\",le=\"30\"} 2\n"));
        assert!(s.contains("kiln_lifecycle_duration_seconds_bucket{op=\"create\",le=\"+Inf\"} 3\n"));
        assert!(s.contains("kiln_lifecycle_duration_seconds_count{op=\"create\"} 3\n"));
        assert!(s.contains("kiln_lifecycle_duration_seconds_count{op=\"fork\"} 0\n"));
    }

    #[test]
    fn alerts_are_counted_by_rule_and_priority() {
        let t = Telemetry::default();
        t.count_alert("read_shadow", "error");
        t.count_alert("read_shadow", "error");
        t.count_alert("miner_binary", "critical");
        let mut w = Text::default();
        t.write(&mut w);
        let s = w.finish();
        assert!(s.contains("# TYPE kiln_alerts_total counter\n"));
        assert!(s.contains("kiln_alerts_total{rule=\"read_shadow\",priority=\"error\"} 2\n"));
        assert!(s.contains("kiln_alerts_total{rule=\"miner_binary\",priority=\"critical\"} 1\n"));
    }
}
