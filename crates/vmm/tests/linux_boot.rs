//! Boots a real Linux kernel (built by kernel/build-kernel.sh) with a tiny ext4 rootfs whose /init
//! answers commands over vsock. Runs only where `kiln_host::kvm::probe` measures guest kernel mode
//! at hardware speed; elsewhere it prints `skipped: <measured reason>` and asserts nothing (it is
//! not a pass on such hosts). Kernel: `$KILN_VMM_KERNEL`, else the recipe's cache (built on demand,
//! ~10 min).
//!
//! This file has its own harness (`harness = false`): libtest has no runtime skip, and a skip must
//! not be reported as a pass, so a skip is reported as `ignored`.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;

fn kernel() -> Result<PathBuf, String> {
    if let Some(k) = std::env::var_os("KILN_VMM_KERNEL") {
        return Ok(PathBuf::from(k));
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernel/build-kernel.sh");
    let out = Command::new("bash")
        .arg(&script)
        .output()
        .map_err(|e| format!("running {}: {e}", script.display()))?;
    if !out.status.success() {
        return Err(format!(
            "kernel recipe failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(PathBuf::from(
        String::from_utf8_lossy(&out.stdout).trim().to_string(),
    ))
}

fn rootfs(dir: &Path) -> PathBuf {
    let root = dir.join("root");
    std::fs::create_dir_all(root.join("bin")).unwrap();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/linux/init.rs");
    let st = Command::new(std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into()))
        .args([
            "--edition",
            "2021",
            "-O",
            "-C",
            "target-feature=+crt-static",
            "-o",
        ])
        .arg(root.join("init"))
        .arg(&src)
        .status()
        .unwrap();
    assert!(st.success(), "building the test /init failed");
    if Path::new("/bin/busybox").is_file() {
        std::fs::copy("/bin/busybox", root.join("bin/busybox")).unwrap();
        std::os::unix::fs::symlink("busybox", root.join("bin/sh")).unwrap();
    }
    let img = dir.join("rootfs.ext4");
    let st = Command::new("mkfs.ext4")
        .args(["-q", "-F", "-d"])
        .arg(&root)
        .arg(&img)
        .arg("64M")
        .status()
        .expect("mkfs.ext4 (e2fsprogs) is needed for the Linux boot test");
    assert!(st.success());
    img
}

const NAME: &str = "linux_boots_to_a_shell_answering_over_vsock";

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--list") {
        println!("{NAME}: test");
        return;
    }
    let filters: Vec<&String> = args.iter().filter(|a| !a.starts_with('-')).collect();
    if !filters.is_empty() && !filters.iter().any(|f| NAME.contains(f.as_str())) {
        println!("\nrunning 0 tests\n\ntest result: ok. 0 passed; 0 failed; 0 ignored; 0 measured; 1 filtered out\n");
        return;
    }
    println!("\nrunning 1 test");
    match skip_reason() {
        Some(why) => {
            println!("test {NAME} ... skipped: {why}");
            println!(
                "\ntest result: ok. 0 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out\n"
            );
        }
        None => {
            linux_boots_to_a_shell_answering_over_vsock();
            println!("test {NAME} ... ok");
            println!(
                "\ntest result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out\n"
            );
        }
    }
}

/// Why the test cannot run on this host, measured; None when it can.
fn skip_reason() -> Option<String> {
    if !kvm_usable() {
        return Some("/dev/kvm is not usable".into());
    }
    match kiln_host::kvm::probe() {
        Err(e) => Some(format!("the KVM speed probe failed: {e}")),
        Ok(p) if !p.hardware_speed() => Some(format!(
            "{} -- a Linux guest cannot boot in reasonable time here",
            p.verdict()
        )),
        Ok(_) => None,
    }
}

fn linux_boots_to_a_shell_answering_over_vsock() {
    let kernel = match kernel() {
        Ok(k) => k,
        Err(e) => panic!("hardware-speed KVM but no guest kernel: {e}"),
    };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let img = rootfs(d);
    let uds = d.join("v.sock");
    let ov = d.join("ov");
    let mut vm = spawn(
        d,
        "linux",
        Args::kernel(
            &kernel,
            "console=ttyS0 reboot=k panic=-1 pci=off nomodules root=/dev/vda rw init=/init",
        )
        .mem_mib(256)
        .vcpus(2)
        .disk_base(&img)
        .disk_overlay(&ov)
        .vsock(3, &uds)
        .rng(),
    );
    vm.wait_serial("kiln-init: ready", Duration::from_secs(180));
    let mut s = std::os::unix::net::UnixStream::connect(&uds).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s.write_all(b"CONNECT 1024\n").unwrap();
    let mut r = BufReader::new(s.try_clone().unwrap());
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    assert!(line.starts_with("OK "), "{line:?}");
    s.write_all(b"echo hello-from-linux\n").unwrap();
    line.clear();
    r.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "hello-from-linux");
    let mut rest = String::new();
    while !rest.contains("--end--") {
        r.read_line(&mut rest).unwrap();
    }
    s.write_all(b"cat /proc/version\n").unwrap();
    line.clear();
    r.read_line(&mut line).unwrap();
    assert!(line.contains("Linux version 6.1"), "{line}");
    vm.call(serde_json::json!({"op": "stop"}));
    vm.wait_exit(Duration::from_secs(30));
}
