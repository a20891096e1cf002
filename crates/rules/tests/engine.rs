//! The engine and the file format: errors with line and column, ancestry, windows per sandbox
//! and per team, sequences, per-team overrides, and the engine ignoring its own records.

use std::sync::Arc;

use kiln_rules::{Action, Engine, Event, Priority, RuleSet};
use serde_json::{json, Value};

fn ev(id: i64, ts: i64, sandbox: &str, team: &str, kind: &str, body: Value) -> Event {
    Event {
        id,
        sandbox: sandbox.into(),
        team: Some(team.into()),
        ts_ms: ts,
        kind: kind.into(),
        body,
    }
}

fn engine(src: &str) -> Engine {
    Engine::new(Arc::new(
        RuleSet::load(src).unwrap_or_else(|e| panic!("{e}")),
    ))
}

fn errors(src: &str) -> Vec<(usize, usize, String)> {
    RuleSet::load(src)
        .expect_err("the file must be refused")
        .0
        .into_iter()
        .map(|e| (e.line, e.col, e.msg))
        .collect()
}

const HEAD: &str = "  desc: d\n  output: o\n  priority: warning\n";

#[test]
fn errors_have_line_column_and_reason() {
    let e = errors(&format!(
        "- rule: r\n{HEAD}  condition: kind = file and and x = 1\n"
    ));
    assert_eq!((e[0].0, e[0].1), (5, 30), "{e:?}");
    assert!(e[0].2.contains("expected a field"), "{e:?}");

    let e = errors(&format!("- rule: r\n{HEAD}  condition: proc.bogus = 1\n"));
    assert_eq!((e[0].0, e[0].1), (5, 14), "{e:?}");
    assert!(e[0].2.contains("unknown field"), "{e:?}");

    let e = errors(&format!(
        "- rule: r\n{HEAD}  condition: >\n    kind = file\n    and (path = x\n"
    ));
    assert_eq!(e[0].0, 7, "{e:?}");

    let e = errors("- rule: r\n  condition: [unclosed\n");
    assert!(e[0].2.starts_with("YAML:"), "{e:?}");
    assert!(e[0].0 >= 2, "{e:?}");

    let e = errors(&format!(
        "- rule: r\n{HEAD}  condition: kind = file\n  action: explode\n"
    ));
    assert_eq!(e[0].0, 6, "{e:?}");
    assert!(e[0].2.contains("unknown action"), "{e:?}");

    let e = errors("- rule: r\n  desc: d\n  output: o\n  condition: kind = file\n");
    assert!(e[0].2.contains("has no priority"), "{e:?}");

    let e = errors(&format!(
        "- rule: r\n{HEAD}  condition: kind = file and nomacro\n  colour: red\n"
    ));
    assert_eq!(e.len(), 2, "every error is reported: {e:?}");
    assert_eq!((e[0].0, e[0].1), (5, 30));
    assert_eq!((e[1].0, e[1].1), (6, 3));

    let e = errors(&format!(
        "- rule: r\n{HEAD}  condition: kind = file\n  count: 3\n"
    ));
    assert!(e[0].2.contains("needs both count and within"), "{e:?}");

    let e = errors(&format!(
        "- macro: m\n  condition: bogus.[x = 1\n- rule: r\n{HEAD}  condition: kind = file\n"
    ));
    assert_eq!(e[0].0, 2, "{e:?}");

    let e = errors(&format!(
        "- rule: r\n{HEAD}  condition: kind = file\n- override: nope\n  team: t\n  enabled: false\n"
    ));
    assert!(e[0].2.contains("unknown rule"), "{e:?}");
}

#[test]
fn lists_macros_and_output() {
    let mut e = engine(
        "- list: bad\n  items: [/etc/shadow, /root]\n- macro: reads\n  condition: kind = file and op = read\n\
         - rule: r\n  desc: d\n  output: \"read %path by %user (%nothing)\"\n  priority: error\n  tags: [a, b]\n  condition: reads and path pmatch (bad)\n",
    );
    let a = e.eval(&ev(
        1,
        0,
        "s",
        "t",
        "file",
        json!({"op": "read", "path": "/root/x", "user": "root"}),
    ));
    assert_eq!(a.len(), 1);
    assert_eq!(a[0].output, "read /root/x by root (<NA>)");
    assert_eq!(a[0].priority, Priority::Error);
    assert_eq!(a[0].tags, ["a", "b"]);
    assert_eq!(a[0].records, [1]);
    assert_eq!(a[0].actions, [Action::Alert]);
    assert!(e
        .eval(&ev(
            2,
            0,
            "s",
            "t",
            "file",
            json!({"op": "write", "path": "/root/x"})
        ))
        .is_empty());
    assert!(e
        .eval(&ev(
            3,
            0,
            "s",
            "t",
            "file",
            json!({"op": "read", "path": "/rootfs"})
        ))
        .is_empty());
}

#[test]
fn ancestry_from_exec_records() {
    let mut e = engine(
        "- rule: nc_under_python\n  desc: d\n  output: \"%proc.name < %proc.pname < %proc.aname[2]\"\n  priority: error\n\
         \x20 condition: kind = syscall and call = execve and proc.name = nc and proc.aname = python3\n",
    );
    let exec = |id, pid, caller: &str, argv: &[&str]| {
        ev(
            id,
            id,
            "s",
            "t",
            "syscall",
            json!({"call": "execve", "pid": pid, "process": caller, "path": argv[0], "argv": argv}),
        )
    };
    // The agent starts bash, bash execs python3 in the same pid, python3 forks a child that execs sh, which execs nc.
    let start = ev(
        1,
        1,
        "s",
        "t",
        "process",
        json!({"event": "start", "cmd": "/bin/bash", "args": ["-c", "python3 x.py"], "pid": 10}),
    );
    assert!(e.eval(&start).is_empty());
    assert!(e
        .eval(&exec(2, 10, "bash", &["/usr/bin/python3", "x.py"]))
        .is_empty());
    assert!(e
        .eval(&exec(3, 11, "python3", &["/bin/sh", "-c", "nc h 1"]))
        .is_empty());
    let a = e.eval(&exec(4, 11, "sh", &["/bin/nc", "h", "1"]));
    assert_eq!(a.len(), 1, "nc's chain is sh < python3");
    assert_eq!(a[0].output, "nc < sh < python3");
    // The same exec not under python raises nothing.
    assert!(e
        .eval(&exec(5, 12, "bash", &["/bin/nc", "h", "1"]))
        .is_empty());
    // A pid that ended is forgotten.
    let end = ev(
        6,
        6,
        "s",
        "t",
        "process",
        json!({"event": "end", "pid": 10}),
    );
    e.eval(&end);
    let a = e.eval(&exec(7, 10, "bash", &["/bin/nc", "h", "1"]));
    assert!(a.is_empty());
    // Agent-started processes descend from the agent.
    let mut e = engine("- rule: r\n  desc: d\n  output: o\n  priority: notice\n  condition: kind = process and proc.pname = kiln-agent\n");
    assert_eq!(e.eval(&start).len(), 1);
}

#[test]
fn windows_per_sandbox_and_per_team() {
    let src = |per: &str| {
        format!("- rule: w\n{HEAD}  condition: kind = net and event = deny\n  count: 3\n  within: 10s\n  per: {per}\n")
    };
    let deny = |id, ts, s: &str, team: &str| {
        ev(
            id,
            ts,
            s,
            team,
            "net",
            json!({"event": "deny", "dst": "10.0.0.1:1"}),
        )
    };
    let mut e = engine(&src("sandbox"));
    assert!(e.eval(&deny(1, 0, "a", "t")).is_empty());
    assert!(e.eval(&deny(2, 1000, "b", "t")).is_empty());
    assert!(e.eval(&deny(3, 2000, "a", "t")).is_empty());
    let a = e.eval(&deny(4, 3000, "a", "t"));
    assert_eq!(a.len(), 1);
    assert_eq!(a[0].records, [1, 3, 4]);
    // The count starts over after firing, and old records fall out of the window.
    assert!(e.eval(&deny(5, 4000, "a", "t")).is_empty());
    assert!(e.eval(&deny(6, 30_000, "a", "t")).is_empty());
    assert!(e.eval(&deny(7, 31_000, "a", "t")).is_empty());

    let mut e = engine(&src("team"));
    assert!(e.eval(&deny(1, 0, "a", "t")).is_empty());
    assert!(e.eval(&deny(2, 1000, "b", "t")).is_empty());
    assert!(e.eval(&deny(3, 1500, "c", "other")).is_empty());
    let a = e.eval(&deny(4, 2000, "c", "t"));
    assert_eq!(a.len(), 1, "three denies across the team's sandboxes");
    assert_eq!(a[0].records, [1, 2, 4]);
    assert_eq!(a[0].sandbox, "c");
}

#[test]
fn sequences() {
    let mut e = engine(&format!(
        "- rule: download_then_exec\n{HEAD}  condition: kind = file and op = write and path startswith /tmp/\n\
         \x20 then: kind = process and event = start and args contains /tmp/\n  within: 30s\n"
    ));
    let write = |id, ts, s: &str| {
        ev(
            id,
            ts,
            s,
            "t",
            "file",
            json!({"op": "write", "path": "/tmp/x"}),
        )
    };
    let run = |id, ts, s: &str| {
        ev(
            id,
            ts,
            s,
            "t",
            "process",
            json!({"event": "start", "cmd": "/bin/bash", "args": ["-c", "/tmp/x"], "pid": 3}),
        )
    };
    assert!(e.eval(&run(1, 0, "a")).is_empty(), "B before A is nothing");
    assert!(e.eval(&write(2, 1000, "a")).is_empty());
    assert!(e.eval(&run(3, 2000, "b")).is_empty(), "another sandbox's B");
    let a = e.eval(&run(4, 5000, "a"));
    assert_eq!(a.len(), 1);
    assert_eq!(a[0].records, [2, 4]);
    assert!(e.eval(&run(5, 6000, "a")).is_empty(), "consumed");
    assert!(e.eval(&write(6, 10_000, "a")).is_empty());
    assert!(e.eval(&run(7, 60_000, "a")).is_empty(), "too late");
}

#[test]
fn team_overrides() {
    let mut e = engine(&format!(
        "- rule: w\n{HEAD}  condition: kind = net and event = deny\n  count: 3\n  within: 10s\n\
         - rule: p\n{HEAD}  condition: kind = file\n  action: kill\n\
         - override: w\n  team: quiet\n  count: 5\n  action: [alert, deny-network]\n\
         - override: p\n  team: off\n  enabled: false\n\
         - override: p\n  team: calm\n  action: alert\n  priority: notice\n"
    ));
    let f = |team: &str| ev(1, 0, "s", team, "file", json!({"op": "read"}));
    assert_eq!(e.eval(&f("any"))[0].actions, [Action::Kill]);
    assert!(e.eval(&f("off")).is_empty());
    let a = e.eval(&f("calm"));
    assert_eq!(
        (a[0].actions.clone(), a[0].priority),
        (vec![Action::Alert], Priority::Notice)
    );
    let mut fired = Vec::new();
    for i in 0..5 {
        fired.extend(e.eval(&ev(
            10 + i,
            i * 100,
            "s",
            "quiet",
            "net",
            json!({"event": "deny"}),
        )));
    }
    assert_eq!(fired.len(), 1);
    assert_eq!(fired[0].records.len(), 5);
    assert_eq!(fired[0].actions, [Action::Alert, Action::DenyNetwork]);
}

#[test]
fn the_engine_never_reads_its_own_records() {
    let mut e = engine(&format!(
        "- rule: any_lifecycle\n{HEAD}  condition: kind = lifecycle\n"
    ));
    for event in ["alert", "rule-action"] {
        let own = ev(
            1,
            0,
            "s",
            "t",
            "lifecycle",
            json!({"event": event, "rule": "any_lifecycle", "records": [1]}),
        );
        assert!(e.eval(&own).is_empty());
    }
    assert_eq!(
        e.eval(&ev(2, 0, "s", "t", "lifecycle", json!({"event": "paused"})))
            .len(),
        1
    );
}

#[test]
fn reloading_keeps_process_tables() {
    let mut e = engine(&format!("- rule: a\n{HEAD}  condition: kind = file\n"));
    e.eval(&ev(
        1,
        0,
        "s",
        "t",
        "process",
        json!({"event": "start", "cmd": "/usr/bin/python3", "args": [], "pid": 4}),
    ));
    e.set_rules(Arc::new(
        RuleSet::load(&format!(
            "- rule: b\n{HEAD}  condition: kind = syscall and proc.name = python3\n"
        ))
        .unwrap(),
    ));
    let a = e.eval(&ev(
        2,
        0,
        "s",
        "t",
        "syscall",
        json!({"call": "openat", "pid": 4, "process": "python3", "path": "/x", "flags": 0}),
    ));
    assert_eq!(a.len(), 1);
    assert_eq!(e.tracked_sandboxes(), 1);
    e.eval(&ev(
        3,
        0,
        "s",
        "t",
        "lifecycle",
        json!({"event": "killed", "detail": "x"}),
    ));
    assert_eq!(e.tracked_sandboxes(), 0);
}

#[test]
fn sums_holds_and_incident_names() {
    let src = format!(
        "- rule: volume\n{HEAD}  condition: kind = net and bytesOut exists\n  sum: bytesOut\n  count: 1000\n  within: 10s\n  incident: exfil\n\
         - rule: busy\n{HEAD}  condition: kind = sample and cpuPct >= 90\n  for: 10s\n\
         - override: busy\n  team: patient\n  within: 30s\n"
    );
    let mut e = engine(&src);
    let net = |id, ts, n: u64| ev(id, ts, "s", "t", "net", json!({"bytesOut": n}));
    assert!(e.eval(&net(1, 0, 600)).is_empty());
    assert!(
        e.eval(&net(2, 20_000, 600)).is_empty(),
        "the first fell out"
    );
    let a = e.eval(&net(3, 21_000, 500));
    assert_eq!(a.len(), 1);
    assert_eq!(
        (a[0].incident.as_str(), &a[0].records[..]),
        ("exfil", &[2, 3][..])
    );
    assert!(
        e.eval(&net(4, 22_000, 999)).is_empty(),
        "the sum starts over"
    );

    let cpu = |ts, team: &str, pct: f64| ev(0, ts, "s", team, "sample", json!({"cpuPct": pct}));
    let mut fired = Vec::new();
    for ts in (0..=10_000).step_by(2000) {
        fired.extend(e.eval(&cpu(ts, "t", 95.0)));
    }
    assert_eq!(fired.len(), 1, "{fired:?}");
    assert_eq!(fired[0].incident, "busy", "the rule's name by default");
    assert!(fired[0].records.is_empty(), "samples are not audit records");
    // One sample below breaks the run.
    let mut fired = Vec::new();
    for (i, ts) in (20_000..=40_000).step_by(2000).enumerate() {
        fired.extend(e.eval(&cpu(ts, "t", if i == 5 { 50.0 } else { 95.0 })));
    }
    assert!(fired.is_empty(), "{fired:?}");
    // A team's override of `within` changes `for`.
    let mut fired = Vec::new();
    for ts in (100_000..=120_000).step_by(2000) {
        fired.extend(e.eval(&ev(0, ts, "p", "patient", "sample", json!({"cpuPct": 99}))));
    }
    assert!(fired.is_empty(), "{fired:?}");

    let e = errors(&format!(
        "- rule: r\n{HEAD}  condition: kind = sample\n  for: 10s\n  count: 3\n  within: 1s\n"
    ));
    assert!(e[0].2.contains("for takes no count"), "{e:?}");
    let e = errors(&format!(
        "- rule: r\n{HEAD}  condition: kind = net\n  sum: bytesOut\n  distinct: dst\n  count: 3\n  within: 1s\n"
    ));
    assert!(e[0].2.contains("takes no distinct"), "{e:?}");
    let e = errors(&format!(
        "- rule: r\n{HEAD}  condition: kind = sample\n  for: soon\n"
    ));
    assert_eq!(
        (e[0].0, e[0].2.as_str()),
        (6, "for must be a duration such as 500ms, 10s, 5m or 1h")
    );
}
