//! Hardening of the real `kiln-vmm` process: every thread runs under a seccomp filter, and the
//! jailed VMM (the default of these tests) sees none of the host's file system or network, runs as
//! the unprivileged uid in fresh namespaces, and inherits no fds.

mod common;

use std::collections::BTreeSet;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use serde_json::json;

const T: Duration = Duration::from_secs(60);

fn status_field(pid: u32, field: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
        .trim()
        .to_string()
}

/// Asserts every thread of `pid` is in seccomp filter mode; returns the number of threads.
fn assert_all_threads_filtered(pid: u32) -> usize {
    let mut threads = 0;
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let status = std::fs::read_to_string(t.unwrap().path().join("status")).unwrap();
        let name = status.lines().next().unwrap().to_string();
        let mode = status
            .lines()
            .find_map(|l| l.strip_prefix("Seccomp:"))
            .unwrap()
            .trim()
            .to_string();
        assert_eq!(mode, "2", "thread {name} of {pid} is not filtered");
        threads += 1;
    }
    threads
}

fn all_threads_are_seccomp_filtered(args: Args) {
    let jailed = args.is_jailed();
    let dir = tempfile::tempdir().unwrap();
    let mut vm = spawn(dir.path(), "vm", args.vcpus(2));
    vm.wait_serial("count=", T);
    let st = vm.call(json!({"op": "stats"}));
    assert_eq!(st["seccomp"], true);
    let threads = assert_all_threads_filtered(vm.pid());
    assert!(threads >= 3, "main + 2 vCPU threads, got {threads}");
    if jailed {
        // the supervising parent too
        assert_eq!(assert_all_threads_filtered(vm.child.id()), 1);
    }
    vm.call(json!({"op": "stop"}));
    assert_eq!(vm.wait_exit(T).code(), Some(0));
}

#[test]
fn all_threads_are_seccomp_filtered_jailed() {
    if !kvm_usable() {
        return;
    }
    all_threads_are_seccomp_filtered(Args::linux64("count").jailed());
}

#[test]
fn all_threads_are_seccomp_filtered_unjailed() {
    if !kvm_usable() {
        return;
    }
    all_threads_are_seccomp_filtered(Args::linux64("count").unjailed());
}

/// Files the process `pid` has open.
fn open_files(pid: u32) -> Vec<PathBuf> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.unwrap().path()).ok())
        .collect()
}

/// Mount points of `pid` (field 5 of mountinfo) with their per-mount options (field 6).
fn mounts(pid: u32) -> Vec<(String, String)> {
    std::fs::read_to_string(format!("/proc/{pid}/mountinfo"))
        .unwrap()
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            (f[4].to_string(), f[5].to_string())
        })
        .collect()
}

fn first_component(p: &Path) -> String {
    p.components()
        .nth(1)
        .unwrap()
        .as_os_str()
        .to_string_lossy()
        .into_owned()
}

#[test]
fn jailed_vmm_sees_no_host_and_runs_unprivileged() {
    if !kvm_usable() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // An fd this test process leaks into its children (no CLOEXEC): the jail must close it.
    let marker = d.join("inherited-marker");
    let leaked = std::fs::File::create(&marker).unwrap();
    // SAFETY: clears FD_CLOEXEC on an fd this test owns.
    let r = unsafe { libc::fcntl(leaked.as_raw_fd(), libc::F_SETFD, 0) };
    assert_eq!(r, 0);

    let mut free = spawn(d, "free", Args::linux64("count").unjailed());
    let mut vm = spawn(d, "vm", Args::linux64("count").jailed());
    vm.wait_serial("count=", T);
    free.wait_serial("count=", T);
    let pid = vm.pid();
    let sup = vm.child.id();
    assert_ne!(pid, sup);

    // the leak reaches an unjailed VMM, so its absence below is the jail's doing
    assert!(open_files(free.pid()).contains(&marker));
    assert!(!open_files(pid).contains(&marker), "{:?}", open_files(pid));
    assert!(!open_files(sup).contains(&marker));
    drop(leaked);

    // unprivileged: every uid/gid is the jail's, no groups, no capabilities, no new privileges
    let id = JAIL_ID.to_string();
    for p in [pid, sup] {
        for field in ["Uid:", "Gid:"] {
            let ids: Vec<String> = status_field(p, field)
                .split_whitespace()
                .map(str::to_string)
                .collect();
            assert_eq!(ids, vec![id.clone(); 4], "{field} of {p}");
        }
        assert_eq!(status_field(p, "Groups:"), "");
        for cap in ["CapInh:", "CapPrm:", "CapEff:", "CapAmb:"] {
            assert_eq!(status_field(p, cap), "0000000000000000", "{cap} of {p}");
        }
        assert_eq!(status_field(p, "NoNewPrivs:"), "1");
    }
    // PID 1 of its own pid namespace
    let nspid = status_field(pid, "NSpid:");
    assert_eq!(nspid.split_whitespace().last(), Some("1"), "{nspid}");

    // fresh namespaces
    for ns in ["mnt", "pid", "net", "ipc", "uts", "cgroup"] {
        let mine = std::fs::read_link(format!("/proc/self/ns/{ns}")).unwrap();
        let its = std::fs::read_link(format!("/proc/{pid}/ns/{ns}")).unwrap();
        assert_ne!(mine, its, "{ns} namespace is shared with the host");
    }
    // no network but a loopback device
    let net = std::fs::read_to_string(format!("/proc/{pid}/net/dev")).unwrap();
    let ifaces: Vec<&str> = net
        .lines()
        .skip(2)
        .filter_map(|l| l.split(':').next())
        .map(str::trim)
        .collect();
    assert_eq!(ifaces, ["lo"], "{net}");

    // the file system: a read-only root holding /dev/kvm, /proc and the bound paths only
    let kernel = std::fs::canonicalize(guest64()).unwrap();
    let m = mounts(pid);
    let points: BTreeSet<&str> = m.iter().map(|(p, _)| p.as_str()).collect();
    let want: BTreeSet<&str> = ["/", "/proc", d.to_str().unwrap(), kernel.to_str().unwrap()]
        .into_iter()
        .collect();
    assert_eq!(points, want, "{m:?}");
    for (point, opts) in &m {
        let opts: Vec<&str> = opts.split(',').collect();
        assert!(opts.contains(&"nosuid"), "{point}: {opts:?}");
        if point != "/proc" && point != d.to_str().unwrap() {
            assert!(opts.contains(&"ro"), "{point} must be read-only: {opts:?}");
        }
    }
    let root = PathBuf::from(format!("/proc/{pid}/root"));
    let top: BTreeSet<String> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let want: BTreeSet<String> = [
        "dev".to_string(),
        "proc".to_string(),
        first_component(d),
        first_component(&kernel),
    ]
    .into_iter()
    .collect();
    assert_eq!(top, want);
    let dev: Vec<String> = std::fs::read_dir(root.join("dev"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(dev, ["kvm"]);
    for host_only in ["etc/passwd", "usr", "root", "home", "sys"] {
        let p = root.join(host_only);
        if want.contains(host_only) {
            // The parent of a bound path (the build directory may be under /root): it holds
            // only the way to that path.
            let entries = std::fs::read_dir(&p).unwrap().count();
            assert_eq!(
                entries, 1,
                "{host_only} shows more than the way to a bound path"
            );
        } else {
            assert!(!p.exists(), "{host_only} is visible");
        }
    }
    // its /proc shows its own pid namespace only
    let procs: Vec<String> = std::fs::read_dir(root.join("proc"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.chars().all(|c| c.is_ascii_digit()))
        .collect();
    assert_eq!(procs, ["1"]);
    for hidden in ["sys", "kallsyms", "kcore", "sysrq-trigger", "modules"] {
        assert!(!root.join("proc").join(hidden).exists(), "/proc/{hidden}");
    }

    // and it still works: stats (reads its own /proc) and a snapshot into its directory
    let st = vm.call(json!({"op": "stats"}));
    assert!(st["rss_bytes"].as_u64().unwrap() > 0);
    vm.call(json!({"op": "snapshot", "dir": d.join("snap"), "resume": true}));
    assert!(d.join("snap/state.json").exists());
    // a snapshot outside what the jail shows fails inside the jail, not on the host
    let outside = tempfile::tempdir().unwrap();
    let r = kiln_vmm::api::call(
        &vm.api,
        &json!({"op": "snapshot", "dir": outside.path().join("s")}),
    )
    .unwrap();
    assert_eq!(r["ok"], false, "{r}");
    assert!(!outside.path().join("s").exists());
    for v in [&mut vm, &mut free] {
        v.call(json!({"op": "stop"}));
        assert_eq!(v.wait_exit(T).code(), Some(0));
    }
}

#[test]
fn jail_needs_its_uid_and_gid() {
    let out = std::process::Command::new(VMM)
        .args(["--kernel", guest64(), "--jail", "/tmp/x"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--jail-uid"), "{err}");
}
