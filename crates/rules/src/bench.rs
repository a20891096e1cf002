//! Throughput measurement of the engine (`kiln bench rules`, `examples/throughput.rs`): a
//! synthetic stream shaped like kiln's audit records, and records per second on one thread,
//! evaluation alone and parse + evaluation (from the stored body text, as the server does).

use std::sync::Arc;
use std::time::Instant;

use serde_json::{json, Value};

use crate::{Engine, Event, RuleSet};

/// A record of a stream: (sandbox, kind, body as JSON text).
pub type Raw = (String, String, String);

/// One synthetic record: (kind, body), cycling through what an agent's session writes.
pub fn synthetic(i: usize) -> (&'static str, Value) {
    let pid = 100 + (i % 500) as i64;
    match i % 16 {
        0 => (
            "process",
            json!({"event": "start", "cmd": "/bin/bash", "args": ["-l", "-c", format!("python3 script{}.py --n {i}", i % 7)],
            "pid": pid, "pty": false, "user": null, "cwd": "/home/user", "envNames": ["PATH"], "tag": null, "stdin": false, "key": "k1"}),
        ),
        1 => (
            "process",
            json!({"event": "end", "pid": pid, "cmd": "/bin/bash", "args": ["-l", "-c", "python3 x.py"], "exitCode": 0,
            "exited": true, "status": "exit status 0", "durationMs": 120, "user": null, "key": "k1", "pty": false}),
        ),
        2 | 3 => (
            "syscall",
            json!({"call": "openat", "pid": pid, "process": "python3",
            "path": format!("/usr/lib/python3.11/mod{}.py", i % 97), "flags": 0o2000000, "result": 3}),
        ),
        4 => (
            "syscall",
            json!({"call": "execve", "pid": pid, "process": "bash", "path": "/usr/bin/python3",
            "argv": ["python3", "script.py"]}),
        ),
        5 => (
            "file",
            json!({"op": "write", "path": format!("/home/user/out{}.txt", i % 31), "bytes": 2048, "result": "ok", "user": "user"}),
        ),
        6 => (
            "file",
            json!({"op": "read", "path": "/home/user/data.csv", "bytes": 65536, "result": "ok", "user": "user"}),
        ),
        7 | 8 => (
            "net",
            json!({"event": "connect", "proto": "tcp", "src": "169.254.0.21:40000",
            "dst": format!("198.51.100.{}:443", i % 50), "name": "pypi.example.test", "rule": "default"}),
        ),
        9 | 10 => (
            "net",
            json!({"event": "close", "proto": "tcp", "src": "169.254.0.21:40000",
            "dst": format!("198.51.100.{}:443", i % 50), "name": "pypi.example.test", "rule": "default",
            "bytesOut": 900, "bytesIn": 120_000, "durationMs": 80}),
        ),
        11 | 12 => (
            "dns",
            json!({"name": format!("host{}.example.test", i % 200), "type": "A", "transport": "udp",
            "rcode": "NOERROR", "answers": ["198.51.100.1"]}),
        ),
        13 => (
            "net",
            json!({"event": "deny", "proto": "tcp", "src": "169.254.0.21:40001", "dst": "10.0.0.1:80",
            "name": null, "rule": "always denied 10.0.0.0/8"}),
        ),
        14 => (
            "api",
            json!({"key": "k1", "method": "POST", "route": "/sandboxes/{sandboxID}/timeout", "status": 200, "sandbox": "s"}),
        ),
        _ => (
            "lifecycle",
            json!({"event": "connect", "detail": "lives at least 300s more"}),
        ),
    }
}

/// `n` synthetic records over 20 sandboxes.
pub fn synthetic_stream(n: usize) -> Vec<Raw> {
    (0..n)
        .map(|i| {
            let (k, b) = synthetic(i);
            (format!("sbx{}", i % 20), k.to_string(), b.to_string())
        })
        .collect()
}

fn event(i: usize, (s, k, b): &Raw) -> Event {
    Event {
        id: i as i64 + 1,
        sandbox: s.clone(),
        team: Some("default".into()),
        ts_ms: 1_700_000_000_000 + i as i64,
        kind: k.clone(),
        body: serde_json::from_str(b).unwrap_or(Value::Null),
    }
}

/// Medians over the rounds.
#[derive(Debug, Clone)]
pub struct Report {
    /// Records per second of this thread's CPU time (one core), evaluation alone.
    pub eval_per_s: f64,
    /// Records per second of CPU time, JSON parse + evaluation.
    pub full_per_s: f64,
    /// The same per second of wall-clock time (lower on a busy machine).
    pub eval_per_wall_s: f64,
    pub full_per_wall_s: f64,
    /// Alerts one pass raised.
    pub alerts: usize,
}

/// This thread's CPU time in seconds.
fn thread_cpu() -> f64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid, writable timespec for the call's duration.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    t.tv_sec as f64 + t.tv_nsec as f64 / 1e9
}

/// Wall and CPU seconds `f` took.
fn timed(f: impl FnOnce()) -> (f64, f64) {
    let (w, c) = (Instant::now(), thread_cpu());
    f();
    (w.elapsed().as_secs_f64(), (thread_cpu() - c).max(1e-9))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Runs `recs` through `set` `rounds` times, each pass on a fresh engine.
pub fn measure(set: &Arc<RuleSet>, recs: &[Raw], rounds: usize) -> Report {
    let parsed: Vec<Event> = recs.iter().enumerate().map(|(i, r)| event(i, r)).collect();
    let n = recs.len() as f64;
    let (mut eval, mut full, mut eval_w, mut full_w, mut alerts) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), 0);
    for _ in 0..rounds.max(1) {
        let mut e = Engine::new(set.clone());
        let (w, c) = timed(|| {
            alerts = parsed.iter().map(|ev| e.eval(ev).len()).sum();
        });
        eval.push(n / c);
        eval_w.push(n / w);
        let mut e = Engine::new(set.clone());
        let (w, c) = timed(|| {
            for (i, r) in recs.iter().enumerate() {
                std::hint::black_box(e.eval(&event(i, r)));
            }
        });
        full.push(n / c);
        full_w.push(n / w);
    }
    Report {
        eval_per_s: median(eval),
        full_per_s: median(full),
        eval_per_wall_s: median(eval_w),
        full_per_wall_s: median(full_w),
        alerts,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_synthetic_stream_is_benign_for_the_pack() {
        let set = Arc::new(RuleSet::default_pack());
        let r = measure(&set, &synthetic_stream(3000), 1);
        // The stream's denies (one in 16, to one destination) stay under every threshold
        // except the burst of denied egress, which they reach in a minute of records.
        assert!(r.alerts <= 3000 / 16 / 50 + 1, "{r:?}");
        assert!(r.eval_per_s > 0.0 && r.full_per_s > 0.0);
    }
}
