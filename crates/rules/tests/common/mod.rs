//! What the pack tests share: a feed of records shaped like kiln's audit records
//! (docs/audit.md) into an engine with the built-in pack.
#![allow(dead_code)]

use std::sync::Arc;

use kiln_rules::{Alert, Engine, Event, RuleSet};
use serde_json::{json, Value};

pub struct Feed {
    pub engine: Engine,
    pub id: i64,
    pub ts: i64,
}

impl Feed {
    pub fn new() -> Feed {
        Feed {
            engine: Engine::new(Arc::new(RuleSet::default_pack())),
            id: 0,
            ts: 1_700_000_000_000,
        }
    }

    /// Feeds one record (`ms` after the previous one); the rules that fired.
    pub fn rec(&mut self, ms: i64, kind: &str, body: Value) -> Vec<String> {
        self.alerts(ms, kind, body)
            .into_iter()
            .map(|a| a.rule)
            .collect()
    }

    /// Feeds one record (`ms` after the previous one); the alerts it raised.
    pub fn alerts(&mut self, ms: i64, kind: &str, body: Value) -> Vec<Alert> {
        self.id += 1;
        self.ts += ms;
        let ev = Event {
            id: self.id,
            sandbox: "sbx".into(),
            team: Some("default".into()),
            ts_ms: self.ts,
            kind: kind.into(),
            body,
        };
        self.engine.eval(&ev)
    }

    /// A command run the way the SDK runs one (`bash -l -c CMD`).
    pub fn cmd(&mut self, cmd: &str) -> Vec<String> {
        let pid = 100 + self.id;
        self.rec(
            10,
            "process",
            json!({"event": "start", "cmd": "/bin/bash", "args": ["-l", "-c", cmd],
                   "pid": pid, "pty": false, "user": null, "cwd": null, "envNames": [], "tag": null}),
        )
    }

    pub fn execve(&mut self, pid: i64, caller: &str, argv: &[&str]) -> Vec<String> {
        self.rec(
            5,
            "syscall",
            json!({"call": "execve", "pid": pid, "process": caller, "path": argv[0], "argv": argv}),
        )
    }

    pub fn open(&mut self, pid: i64, caller: &str, path: &str, flags: i64) -> Vec<String> {
        self.rec(
            5,
            "syscall",
            json!({"call": "openat", "pid": pid, "process": caller, "path": path, "flags": flags, "result": 3}),
        )
    }

    pub fn file(&mut self, op: &str, path: &str) -> Vec<String> {
        self.rec(
            10,
            "file",
            json!({"op": op, "path": path, "result": "ok", "bytes": 10, "user": "user"}),
        )
    }

    pub fn net(&mut self, ms: i64, event: &str, dst: &str, extra: Value) -> Vec<String> {
        let mut b = json!({"event": event, "proto": "tcp", "src": "169.254.0.21:40000", "dst": dst,
                           "name": null, "rule": "default"});
        if let Value::Object(m) = extra {
            for (k, v) in m {
                b[k] = v;
            }
        }
        self.rec(ms, "net", b)
    }

    pub fn dns(&mut self, ms: i64, name: &str, ty: &str) -> Vec<String> {
        self.rec(ms, "dns", json!({"name": name, "type": ty, "transport": "udp", "rcode": "NOERROR", "answers": []}))
    }
}

pub fn only(fired: Vec<String>, rule: &str) {
    assert_eq!(fired, vec![rule.to_string()], "expected exactly {rule}");
}
