//! Fields a condition can read, and the record the engine reads them from.
//!
//! | field | value |
//! |---|---|
//! | `kind`, `sandbox`, `team`, `id`, `time` | the record's kind, sandbox id, team, cursor, time (ms) |
//! | any other name `a.b` | the body's key `a` (then `b` inside it); arrays read as their items joined by spaces |
//! | `proc.name`, `proc.exe`, `proc.cmdline`, `proc.args`, `proc.pid` | the process the record is about (see below) |
//! | `proc.pname`, `proc.pcmdline` | its parent's name and command line |
//! | `proc.aname[N]`, `proc.acmdline[N]` | the N-th ancestor's (1 = parent) |
//! | `proc.aname`, `proc.acmdline` | any ancestor's (a comparison holds if it holds for one) |
//! | `fd.name` | the path (`path`, or `destination` of a move), or the peer (`dst`, `address`) |
//! | `fd.write` | true for `file` writes, moves, removes and mkdirs, and opens with a write flag |
//! | `fd.ownproc` | true when the path is under `/proc/self`, `/proc/thread-self` or `/proc/P` with P the pid of the process the record is about |
//! | `dst.ip`, `dst.port` | `dst` (`1.2.3.4:80`) or a connect's `address` split |
//! | `dns.domain` | the query name's last two labels (`a.b.example.com` → `example.com`) |
//! | `dns.labels`, `dns.maxlabel`, `dns.entropy` | label count, longest label, highest Shannon entropy (bits per character) of a label of 8 or more characters |
//!
//! The process a record is about: a `process` record's `cmd`/`args`/`pid`; a `syscall`
//! `execve` record's `path`/`argv`/`pid`; any other record with a `pid` known to the sandbox's
//! process table (see [`crate::procs`]). Reading a field a record does not have yields
//! nothing, and every comparison on nothing is false.

use std::borrow::Cow;

use serde_json::Value;

use crate::procs::{basename, Proc};

/// A record as the engine reads it (its body is the audit record's body).
#[derive(Debug, Clone)]
pub struct Event {
    /// The audit record's cursor.
    pub id: i64,
    pub sandbox: String,
    /// The sandbox's team, when known (per-team windows and overrides need it).
    pub team: Option<String>,
    pub ts_ms: i64,
    pub kind: String,
    pub body: Value,
}

/// What part of a process an ancestry field reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProcPart {
    Name,
    Cmdline,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Field {
    Kind,
    Sandbox,
    Team,
    Id,
    Time,
    Body(Vec<String>),
    ProcName,
    ProcExe,
    ProcCmdline,
    ProcArgs,
    ProcPid,
    /// The N-th ancestor (1 = parent).
    Ancestor(usize, ProcPart),
    /// Any ancestor.
    AnyAncestor(ProcPart),
    FdName,
    FdWrite,
    FdOwnProc,
    DstIp,
    DstPort,
    DnsDomain,
    DnsLabels,
    DnsMaxLabel,
    DnsEntropy,
}

impl Field {
    /// The field a name means, or why it means none.
    pub fn parse(name: &str) -> Result<Field, String> {
        if let Some(rest) = name.strip_prefix("proc.") {
            let (base, idx) = match rest.split_once('[') {
                Some((b, i)) => {
                    let n: usize = i
                        .strip_suffix(']')
                        .and_then(|n| n.parse().ok())
                        .filter(|n| (1..=crate::procs::MAX_DEPTH).contains(n))
                        .ok_or_else(|| {
                            format!(
                                "{name}: the index must be a number from 1 to {}",
                                crate::procs::MAX_DEPTH
                            )
                        })?;
                    (b, Some(n))
                }
                None => (rest, None),
            };
            let f = match (base, idx) {
                ("name", None) => Field::ProcName,
                ("exe", None) => Field::ProcExe,
                ("cmdline", None) => Field::ProcCmdline,
                ("args", None) => Field::ProcArgs,
                ("pid", None) => Field::ProcPid,
                ("pname", None) => Field::Ancestor(1, ProcPart::Name),
                ("pcmdline", None) => Field::Ancestor(1, ProcPart::Cmdline),
                ("aname", Some(n)) => Field::Ancestor(n, ProcPart::Name),
                ("acmdline", Some(n)) => Field::Ancestor(n, ProcPart::Cmdline),
                ("aname", None) => Field::AnyAncestor(ProcPart::Name),
                ("acmdline", None) => Field::AnyAncestor(ProcPart::Cmdline),
                _ => {
                    return Err(format!(
                    "unknown field {name:?} (proc fields: name, exe, cmdline, args, pid, pname, \
                     pcmdline, aname[N], acmdline[N], aname, acmdline)"
                ))
                }
            };
            return Ok(f);
        }
        Ok(match name {
            "kind" => Field::Kind,
            "sandbox" => Field::Sandbox,
            "team" => Field::Team,
            "id" => Field::Id,
            "time" => Field::Time,
            "fd.name" => Field::FdName,
            "fd.write" => Field::FdWrite,
            "fd.ownproc" => Field::FdOwnProc,
            "dst.ip" => Field::DstIp,
            "dst.port" => Field::DstPort,
            "dns.domain" => Field::DnsDomain,
            "dns.labels" => Field::DnsLabels,
            "dns.maxlabel" => Field::DnsMaxLabel,
            "dns.entropy" => Field::DnsEntropy,
            n if n.starts_with("fd.") || n.starts_with("dst.") || n.starts_with("dns.") => {
                return Err(format!("unknown field {n:?}"))
            }
            n if n.is_empty()
                || n.contains('[')
                || n.split('.').any(|p| p.is_empty() || p.contains('*')) =>
            {
                return Err(format!("{n:?} is not a field name"))
            }
            n => Field::Body(n.split('.').map(str::to_string).collect()),
        })
    }
}

/// A field's value.
#[derive(Debug, Clone, PartialEq)]
pub enum V<'a> {
    Bool(bool),
    Num(f64),
    Str(Cow<'a, str>),
}

impl V<'_> {
    /// As text (numbers without a fraction print as integers).
    pub fn text(&self) -> Cow<'_, str> {
        match self {
            V::Str(s) => Cow::Borrowed(s),
            V::Bool(b) => Cow::Borrowed(if *b { "true" } else { "false" }),
            V::Num(n) => Cow::Owned(num_text(*n)),
        }
    }

    pub fn num(&self) -> Option<f64> {
        match self {
            V::Num(n) => Some(*n),
            V::Str(s) => s.trim().parse().ok(),
            V::Bool(_) => None,
        }
    }
}

pub fn num_text(n: f64) -> String {
    if n.fract() == 0.0 && n.abs() < 1e15 {
        format!("{}", n as i64)
    } else {
        format!("{n}")
    }
}

fn json_v(v: &Value) -> Option<V<'_>> {
    match v {
        Value::Null => None,
        Value::Bool(b) => Some(V::Bool(*b)),
        Value::Number(n) => n.as_f64().map(V::Num),
        Value::String(s) => Some(V::Str(Cow::Borrowed(s))),
        Value::Array(a) => Some(V::Str(Cow::Owned(
            a.iter()
                .map(|x| match x {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                })
                .collect::<Vec<_>>()
                .join(" "),
        ))),
        Value::Object(_) => Some(V::Str(Cow::Owned(v.to_string()))),
    }
}

fn str_of<'a>(b: &'a Value, k: &str) -> Option<&'a str> {
    b.get(k).and_then(Value::as_str)
}

/// Open flags that write: O_WRONLY, O_RDWR, O_CREAT, O_TRUNC, O_APPEND.
const WRITE_FLAGS: i64 = 0o1 | 0o2 | 0o100 | 0o1000 | 0o2000;

fn split_host_port(s: &str) -> Option<(&str, &str)> {
    s.rsplit_once(':')
}

/// The highest Shannon entropy (bits per character) among `name`'s labels of 8+ characters.
pub fn max_label_entropy(name: &str) -> f64 {
    name.split('.')
        .filter(|l| l.len() >= 8)
        .map(entropy)
        .fold(0.0, f64::max)
}

fn entropy(s: &str) -> f64 {
    let mut counts = [0u32; 256];
    for b in s.bytes() {
        counts[b as usize] += 1;
    }
    let n = s.len() as f64;
    counts
        .iter()
        .filter(|c| **c > 0)
        .map(|c| {
            let p = f64::from(*c) / n;
            -p * p.log2()
        })
        .sum()
}

/// Reads `f` of `ev` (whose process, if any, is `proc`), calling `each` with every value
/// (several for `proc.aname`); true if `each` returned true for one.
pub fn with_values(
    f: &Field,
    ev: &Event,
    proc: Option<&Proc>,
    each: &mut dyn FnMut(&V<'_>) -> bool,
) -> bool {
    let b = &ev.body;
    let one = |v: Option<V<'_>>, each: &mut dyn FnMut(&V<'_>) -> bool| v.is_some_and(|v| each(&v));
    match f {
        Field::Kind => each(&V::Str(Cow::Borrowed(&ev.kind))),
        Field::Sandbox => each(&V::Str(Cow::Borrowed(&ev.sandbox))),
        Field::Team => one(ev.team.as_deref().map(|t| V::Str(Cow::Borrowed(t))), each),
        Field::Id => each(&V::Num(ev.id as f64)),
        Field::Time => each(&V::Num(ev.ts_ms as f64)),
        Field::Body(path) => {
            let mut cur = b;
            for k in path {
                match cur.get(k) {
                    Some(x) => cur = x,
                    None => return false,
                }
            }
            one(json_v(cur), each)
        }
        Field::ProcName | Field::ProcCmdline => {
            let v = match (proc, f) {
                (Some(p), Field::ProcName) => Some(p.name.as_str()),
                (Some(p), _) => Some(p.cmdline.as_str()),
                // A syscall of a process not in the table: its name.
                (None, _) if ev.kind == "syscall" => str_of(b, "process"),
                (None, _) => None,
            };
            one(v.map(|s| V::Str(Cow::Borrowed(s))), each)
        }
        Field::ProcExe => {
            let exe = match ev.kind.as_str() {
                "process" => str_of(b, "cmd"),
                "syscall" if b.get("argv").is_some() => str_of(b, "path"),
                _ => None,
            };
            one(exe.map(|e| V::Str(Cow::Borrowed(e))), each)
        }
        Field::ProcArgs => {
            let args = match ev.kind.as_str() {
                "process" => b.get("args").and_then(json_v),
                "syscall" => b.get("argv").and_then(Value::as_array).map(|a| {
                    V::Str(Cow::Owned(
                        a.iter()
                            .skip(1)
                            .filter_map(Value::as_str)
                            .collect::<Vec<_>>()
                            .join(" "),
                    ))
                }),
                _ => None,
            };
            one(args, each)
        }
        Field::ProcPid => one(
            b.get("pid")
                .and_then(Value::as_i64)
                .or(proc.and_then(|p| p.pid))
                .map(|p| V::Num(p as f64)),
            each,
        ),
        Field::Ancestor(n, part) => {
            let a = proc.and_then(|p| p.ancestor(*n));
            one(a.map(|a| part_v(a, *part)), each)
        }
        Field::AnyAncestor(part) => match proc {
            Some(p) => p.ancestors().any(|a| each(&part_v(a, *part))),
            None => false,
        },
        Field::FdName => one(
            str_of(b, "destination")
                .or_else(|| str_of(b, "path"))
                .or_else(|| str_of(b, "dst"))
                .or_else(|| str_of(b, "address"))
                .map(|s| V::Str(Cow::Borrowed(s))),
            each,
        ),
        Field::FdWrite => {
            let w = match ev.kind.as_str() {
                "file" => matches!(str_of(b, "op"), Some("write" | "move" | "remove" | "mkdir")),
                "syscall" => b
                    .get("flags")
                    .and_then(Value::as_i64)
                    .is_some_and(|f| f & WRITE_FLAGS != 0),
                _ => false,
            };
            each(&V::Bool(w))
        }
        Field::FdOwnProc => {
            let pid = b
                .get("pid")
                .and_then(Value::as_i64)
                .or(proc.and_then(|p| p.pid));
            let own = str_of(b, "path")
                .and_then(|p| p.strip_prefix("/proc/"))
                .map(|rest| rest.split('/').next().unwrap_or(""))
                .is_some_and(|first| {
                    first == "self"
                        || first == "thread-self"
                        || (pid.is_some() && first.parse::<i64>().ok() == pid)
                });
            each(&V::Bool(own))
        }
        Field::DstIp | Field::DstPort => {
            let d = str_of(b, "dst").or_else(|| str_of(b, "address"));
            let part = d.and_then(split_host_port).map(|(h, p)| match f {
                Field::DstIp => V::Str(Cow::Borrowed(h)),
                _ => p
                    .parse::<f64>()
                    .map(V::Num)
                    .unwrap_or(V::Str(Cow::Borrowed(p))),
            });
            // ICMP's dst is an address alone.
            let part = part.or_else(|| match f {
                Field::DstIp => d.map(|d| V::Str(Cow::Borrowed(d))),
                _ => None,
            });
            one(part, each)
        }
        Field::DnsDomain | Field::DnsLabels | Field::DnsMaxLabel | Field::DnsEntropy => {
            if ev.kind != "dns" {
                return false;
            }
            let Some(name) = str_of(b, "name") else {
                return false;
            };
            let name = name.trim_end_matches('.');
            let v = match f {
                Field::DnsDomain => {
                    let mut it = name.rmatch_indices('.');
                    let _ = it.next();
                    V::Str(Cow::Borrowed(match it.next() {
                        Some((i, _)) => &name[i + 1..],
                        None => name,
                    }))
                }
                Field::DnsLabels => V::Num(name.split('.').count() as f64),
                Field::DnsMaxLabel => {
                    V::Num(name.split('.').map(str::len).max().unwrap_or(0) as f64)
                }
                _ => V::Num(max_label_entropy(name)),
            };
            each(&v)
        }
    }
}

fn part_v(p: &Proc, part: ProcPart) -> V<'_> {
    V::Str(Cow::Borrowed(match part {
        ProcPart::Name => &p.name,
        ProcPart::Cmdline => &p.cmdline,
    }))
}

/// The process image a record describes, for the process table: (pid, exe, cmdline).
pub fn exec_of(ev: &Event) -> Option<(Option<i64>, String, String)> {
    let b = &ev.body;
    let pid = b.get("pid").and_then(Value::as_i64);
    match ev.kind.as_str() {
        "process" if str_of(b, "event") == Some("start") && pid.is_some() => {
            let cmd = str_of(b, "cmd")?.to_string();
            let mut line = cmd.clone();
            if let Some(a) = b.get("args").and_then(Value::as_array) {
                for x in a.iter().filter_map(Value::as_str) {
                    line.push(' ');
                    line.push_str(x);
                }
            }
            Some((pid, cmd, line))
        }
        "syscall" if matches!(str_of(b, "call"), Some("execve" | "execveat")) => {
            let argv: Vec<&str> = b
                .get("argv")
                .and_then(Value::as_array)
                .map(|a| a.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            let exe = str_of(b, "path")
                .filter(|p| !p.is_empty())
                .or(argv.first().copied())
                .unwrap_or("")
                .to_string();
            Some((pid, exe, argv.join(" ")))
        }
        _ => None,
    }
}

/// The name of the process a syscall record comes from (its image before an exec).
pub fn caller_of(ev: &Event) -> &str {
    str_of(&ev.body, "process").unwrap_or("")
}

/// Basename helper re-exported for the engine.
pub fn exe_name(exe: &str) -> &str {
    basename(exe)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ev(kind: &str, body: Value) -> Event {
        Event {
            id: 1,
            sandbox: "s".into(),
            team: None,
            ts_ms: 0,
            kind: kind.into(),
            body,
        }
    }

    fn get(f: &str, e: &Event) -> Option<String> {
        let mut out = None;
        with_values(&Field::parse(f).unwrap(), e, None, &mut |v| {
            out = Some(v.text().into_owned());
            true
        });
        out
    }

    #[test]
    fn names() {
        assert_eq!(
            Field::parse("proc.aname[2]"),
            Ok(Field::Ancestor(2, ProcPart::Name))
        );
        assert!(Field::parse("proc.aname[0]").is_err());
        assert!(Field::parse("proc.nope").is_err());
        assert!(Field::parse("a..b").is_err());
        assert_eq!(
            Field::parse("a.b"),
            Ok(Field::Body(vec!["a".into(), "b".into()]))
        );
    }

    #[test]
    fn derived() {
        let n = ev("net", json!({"dst": "10.0.0.1:4444"}));
        assert_eq!(get("dst.ip", &n).as_deref(), Some("10.0.0.1"));
        assert_eq!(get("dst.port", &n).as_deref(), Some("4444"));
        assert_eq!(get("fd.name", &n).as_deref(), Some("10.0.0.1:4444"));
        let d = ev(
            "dns",
            json!({"name": "aGVsbG8gd29ybGQgaGVsbG8.x.example.com."}),
        );
        assert_eq!(get("dns.domain", &d).as_deref(), Some("example.com"));
        assert_eq!(get("dns.labels", &d).as_deref(), Some("4"));
        assert_eq!(get("dns.maxlabel", &d).as_deref(), Some("23"));
        assert!(max_label_entropy("x7f3k9q2m1v8b4n6z0c5w.example.com") > 3.5);
        assert!(max_label_entropy("www.example.com") < 3.0);
        let p = ev(
            "process",
            json!({"cmd": "/bin/bash", "args": ["-c", "x y"]}),
        );
        assert_eq!(get("args", &p).as_deref(), Some("-c x y"));
        assert_eq!(get("proc.exe", &p).as_deref(), Some("/bin/bash"));
        let o = ev(
            "syscall",
            json!({"call": "openat", "flags": 0o101, "path": "/x"}),
        );
        assert_eq!(get("fd.write", &o).as_deref(), Some("true"));
        let r = ev(
            "syscall",
            json!({"call": "openat", "flags": 0x80000, "path": "/x"}),
        );
        assert_eq!(get("fd.write", &r).as_deref(), Some("false"));
        assert_eq!(get("missing", &r), None);
        let own = |path: &str| {
            let e = ev(
                "syscall",
                json!({"call": "openat", "pid": 42, "path": path}),
            );
            get("fd.ownproc", &e).unwrap()
        };
        assert_eq!(own("/proc/42/environ"), "true");
        assert_eq!(own("/proc/self/environ"), "true");
        assert_eq!(own("/proc/421/environ"), "false");
        assert_eq!(own("/etc/passwd"), "false");
    }
}
