//! Hardening: every thread runs under a seccomp filter; the VMM runs inside a chroot with fresh
//! namespaces, needing nothing from the host filesystem but what is placed there.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;
use serde_json::json;

#[test]
fn all_threads_are_seccomp_filtered() {
    if !kvm_usable() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut vm = spawn(
        dir.path(),
        "vm",
        &[
            "--kernel",
            guest64(),
            "--cmdline",
            "kiln.test=count",
            "--vcpus",
            "2",
        ],
    );
    vm.wait_serial("count=", Duration::from_secs(60));
    let st = vm.call(json!({"op": "stats"}));
    assert_eq!(st["seccomp"], true);
    let pid = vm.child.id();
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
        assert_eq!(mode, "2", "thread {name} is not filtered");
        threads += 1;
    }
    assert!(threads >= 3, "main + 2 vCPU threads, got {threads}");
    vm.call(json!({"op": "stop"}));
    assert_eq!(vm.wait_exit(Duration::from_secs(30)).code(), Some(0));
}

/// Copies `bin` and the shared libraries `ldd` lists into `root` at the same paths.
fn copy_with_libs(bin: &Path, root: &Path, dst: &str) {
    std::fs::copy(bin, root.join(dst)).unwrap();
    let out = Command::new("ldd").arg(bin).output().expect("ldd");
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let path = line
            .split_whitespace()
            .find(|w| w.starts_with('/'))
            .map(str::to_string);
        if let Some(p) = path {
            let target = root.join(p.trim_start_matches('/'));
            std::fs::create_dir_all(target.parent().unwrap()).unwrap();
            std::fs::copy(&p, &target).unwrap();
        }
    }
}

#[test]
fn runs_in_a_chroot_with_fresh_namespaces() {
    if !kvm_usable() {
        return;
    }
    if Command::new("unshare").arg("--help").output().is_err() {
        println!("skipped: unshare(1) is not installed");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("jail");
    std::fs::create_dir_all(root.join("dev")).unwrap();
    copy_with_libs(Path::new(VMM), &root, "kiln-vmm");
    std::fs::copy(guest64(), root.join("guest.elf")).unwrap();
    let script = format!(
        "mknod {r}/dev/kvm c 10 232 && exec chroot {r} /kiln-vmm --kernel /guest.elf --cmdline kiln.test=hello --serial-out /serial.log",
        r = root.display()
    );
    let out = Command::new("unshare")
        .args([
            "--mount", "--pid", "--net", "--ipc", "--uts", "--fork", "--", "sh", "-c", &script,
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success()
        && (stderr.contains("Operation not permitted") || stderr.contains("mknod"))
    {
        println!("skipped: cannot create namespaces or device nodes here: {stderr}");
        return;
    }
    assert!(
        out.status.success(),
        "kiln-vmm in the jail failed: {stderr}"
    );
    let serial = std::fs::read_to_string(root.join("serial.log")).unwrap();
    assert!(
        serial.contains("hello from the kiln test guest"),
        "{serial}"
    );
}
