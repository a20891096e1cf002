//! Helpers for the kiln-vmm integration tests: run the real `kiln-vmm` binary on the test guests
//! built by build.rs, talk to its control API, read its serial log.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

pub const VMM: &str = env!("CARGO_BIN_EXE_kiln-vmm");

/// Whether this host can run KVM guests. Without `/dev/kvm` the tests fail, so a host that
/// cannot run them never reports them as passed; `KILN_ALLOW_SKIPS=1` turns that into a printed
/// skip for people who know their host lacks KVM.
pub fn kvm_usable() -> bool {
    match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
    {
        Ok(_) => true,
        Err(e) if std::env::var("KILN_ALLOW_SKIPS").as_deref() == Ok("1") => {
            println!("skipped: /dev/kvm cannot be opened ({e}); these tests need KVM");
            false
        }
        Err(e) => panic!(
            "/dev/kvm cannot be opened ({e}): the kiln-vmm tests need KVM; \
             set KILN_ALLOW_SKIPS=1 to skip them on this host"
        ),
    }
}

pub fn guest64() -> &'static str {
    kiln_vmm::test_guests::LINUX64
}

pub fn guest_pvh() -> &'static str {
    kiln_vmm::test_guests::PVH
}

pub struct Vm {
    pub child: Child,
    pub serial: PathBuf,
    pub api: PathBuf,
    pub stderr: PathBuf,
}

/// Starts kiln-vmm with `args`, serial log and API socket in `dir` (named by `name`).
pub fn spawn(dir: &Path, name: &str, args: &[&str]) -> Vm {
    let serial = dir.join(format!("{name}.serial"));
    let api = dir.join(format!("{name}.api"));
    let stderr = dir.join(format!("{name}.stderr"));
    let child = Command::new(VMM)
        .args(args)
        .arg("--serial-out")
        .arg(&serial)
        .arg("--api-sock")
        .arg(&api)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&stderr).unwrap())
        .spawn()
        .expect("spawn kiln-vmm");
    Vm {
        child,
        serial,
        api,
        stderr,
    }
}

impl Vm {
    pub fn serial_text(&self) -> String {
        std::fs::read_to_string(&self.serial).unwrap_or_default()
    }
    pub fn stderr_text(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }
    /// Waits until the serial log contains `needle` on a complete line (the guest writes byte by
    /// byte, so the rest of the line may still be coming).
    pub fn wait_serial(&mut self, needle: &str, timeout: Duration) -> String {
        let complete = |s: &str| s.find(needle).is_some_and(|i| s[i..].contains('\n'));
        let deadline = Instant::now() + timeout;
        loop {
            let s = self.serial_text();
            if complete(&s) {
                return s;
            }
            if let Ok(Some(st)) = self.child.try_wait() {
                let s = self.serial_text();
                if complete(&s) {
                    return s;
                }
                panic!(
                    "kiln-vmm exited ({st}) before printing {needle:?}; serial:\n{s}\nstderr:\n{}",
                    self.stderr_text()
                );
            }
            assert!(
                Instant::now() < deadline,
                "timeout waiting for {needle:?}; serial:\n{s}\nstderr:\n{}",
                self.stderr_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    /// Waits for the process to exit.
    pub fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!(
                    "kiln-vmm did not exit in time; serial:\n{}\nstderr:\n{}",
                    self.serial_text(),
                    self.stderr_text()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    pub fn wait_api(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::os::unix::net::UnixStream::connect(&self.api).is_err() {
            assert!(
                Instant::now() < deadline,
                "API socket never came up; stderr:\n{}",
                self.stderr_text()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    pub fn call(&self, req: serde_json::Value) -> serde_json::Value {
        self.wait_api();
        let r = kiln_vmm::api::call(&self.api, &req).expect("API call");
        assert_eq!(r["ok"], true, "API call {req} failed: {r}");
        r
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Runs kiln-vmm to completion (no API), returns (status, serial, stderr).
pub fn run_to_end(dir: &Path, name: &str, args: &[&str]) -> (ExitStatus, String, String) {
    let mut vm = spawn(dir, name, args);
    let st = vm.wait_exit(Duration::from_secs(120));
    (st, vm.serial_text(), vm.stderr_text())
}

pub fn sha256(path: &Path) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(std::fs::read(path).unwrap()))
}
