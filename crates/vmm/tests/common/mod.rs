//! Helpers for the kiln-vmm integration tests: run the real `kiln-vmm` binary on the test guests
//! built by build.rs ([`Args`] builds its command line, [`spawn`] starts it), talk to its control
//! API, read its serial log.
//!
//! Every VM runs jailed (`--jail`, as the unprivileged [`JAIL_ID`]) unless its [`Args`] say
//! `unjailed()`, so the boot, device, snapshot and restore tests all exercise the jail. The jail
//! needs root; `KILN_VMM_TEST_JAIL=0` runs them unjailed instead.
#![allow(dead_code)]

use std::ffi::OsString;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

pub const VMM: &str = env!("CARGO_BIN_EXE_kiln-vmm");

/// uid and gid of jailed test VMs (no passwd entry needed).
pub const JAIL_ID: u32 = 61_000;

/// Whether VMs run jailed unless a test asks otherwise.
pub fn jail_by_default() -> bool {
    std::env::var("KILN_VMM_TEST_JAIL").as_deref() != Ok("0")
}

/// The command line of one VM run.
#[derive(Clone, Debug)]
pub struct Args {
    args: Vec<OsString>,
    jail: bool,
}

impl Args {
    /// No kernel at all (for error cases).
    pub fn empty() -> Self {
        Args {
            args: Vec::new(),
            jail: jail_by_default(),
        }
    }
    /// `kernel` booted with `cmdline`.
    pub fn kernel(kernel: impl AsRef<Path>, cmdline: &str) -> Self {
        Self::empty()
            .arg("--kernel")
            .arg(kernel.as_ref())
            .arg("--cmdline")
            .arg(cmdline)
    }
    /// `kernel` with the test guest workload `test` (`kiln.test=<test>`; more command line may
    /// follow after a space).
    pub fn guest(kernel: &str, test: &str) -> Self {
        Self::kernel(kernel, &format!("kiln.test={test}"))
    }
    /// The test guest booted through the 64-bit Linux boot protocol.
    pub fn linux64(test: &str) -> Self {
        Self::guest(guest64(), test)
    }
    /// The test guest booted through PVH.
    pub fn pvh(test: &str) -> Self {
        Self::guest(guest_pvh(), test)
    }
    /// A restore of `snapshot`.
    pub fn restore(snapshot: &Path) -> Self {
        Self::empty().arg("--restore").arg(snapshot)
    }
    pub fn arg(mut self, a: impl Into<OsString>) -> Self {
        self.args.push(a.into());
        self
    }
    fn flag(self, name: &str, v: impl Into<OsString>) -> Self {
        self.arg(name).arg(v)
    }
    pub fn mem_mib(self, n: u64) -> Self {
        self.flag("--mem-mib", n.to_string())
    }
    pub fn vcpus(self, n: u32) -> Self {
        self.flag("--vcpus", n.to_string())
    }
    pub fn paused(self) -> Self {
        self.arg("--paused")
    }
    pub fn rng(self) -> Self {
        self.arg("--rng")
    }
    pub fn disk_base(self, base: &Path) -> Self {
        self.flag("--disk-base", base)
    }
    pub fn disk_overlay(self, overlay: &Path) -> Self {
        self.flag("--disk-overlay", overlay)
    }
    pub fn disk_ro(self) -> Self {
        self.arg("--disk-ro")
    }
    pub fn vsock(self, cid: u64, uds: &Path) -> Self {
        self.flag("--vsock-cid", cid.to_string()).vsock_uds(uds)
    }
    pub fn vsock_uds(self, uds: &Path) -> Self {
        self.flag("--vsock-uds", uds)
    }
    /// Runs the VMM without the jail.
    pub fn unjailed(mut self) -> Self {
        self.jail = false;
        self
    }
    /// Runs the VMM jailed, whatever `KILN_VMM_TEST_JAIL` says.
    pub fn jailed(mut self) -> Self {
        self.jail = true;
        self
    }
    pub fn is_jailed(&self) -> bool {
        self.jail
    }
}

/// A host-side Unix listener the (possibly jailed) VMM may connect to, e.g. `<uds>_<port>` for
/// guest-initiated vsock connections.
pub fn host_listener(path: impl AsRef<Path>) -> UnixListener {
    let l = UnixListener::bind(path.as_ref()).unwrap();
    std::os::unix::fs::chown(path.as_ref(), Some(JAIL_ID), Some(JAIL_ID)).unwrap();
    l
}

/// Whether this host can run the VMM tests: KVM guests, as root (the jail: mounts, a /dev/kvm
/// node, a uid change, and ptrace of jailed VMMs), under the skip policy of [`kiln_testkit`].
pub fn kvm_usable() -> bool {
    kiln_testkit::needs().kvm().root("the VMM jail").ok()
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
    /// The jail's per-VM root directory (removed after the VM), when jailed.
    pub jail: Option<tempfile::TempDir>,
}

/// Starts kiln-vmm with `args`, serial log and API socket in `dir` (named by `name`). A jailed
/// VM gets `dir` (chowned to [`JAIL_ID`]) as its writable directory.
pub fn spawn(dir: &Path, name: &str, args: Args) -> Vm {
    let serial = dir.join(format!("{name}.serial"));
    let api = dir.join(format!("{name}.api"));
    let stderr = dir.join(format!("{name}.stderr"));
    let mut cmd = Command::new(VMM);
    cmd.args(&args.args);
    let jail = if args.jail {
        // SAFETY: geteuid has no preconditions.
        let euid = unsafe { libc::geteuid() };
        assert!(
            euid == 0,
            "the kiln-vmm tests run the VMM jailed, which needs root; \
             KILN_VMM_TEST_JAIL=0 runs them unjailed"
        );
        std::os::unix::fs::chown(dir, Some(JAIL_ID), Some(JAIL_ID)).unwrap();
        let root = tempfile::Builder::new()
            .prefix("kiln-vmm-jail-")
            .tempdir()
            .unwrap();
        cmd.arg("--jail")
            .arg(root.path())
            .args(["--jail-uid", &JAIL_ID.to_string()])
            .args(["--jail-gid", &JAIL_ID.to_string()]);
        Some(root)
    } else {
        None
    };
    let child = cmd
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
        jail,
    }
}

impl Vm {
    /// pid of the VMM process itself: the spawned process, or, jailed, its only child (the
    /// spawned process then only supervises).
    pub fn pid(&self) -> u32 {
        let sup = self.child.id();
        if self.jail.is_none() {
            return sup;
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let children = std::fs::read_to_string(format!("/proc/{sup}/task/{sup}/children"))
                .unwrap_or_default();
            if let Some(p) = children.split_whitespace().next() {
                return p.parse().unwrap();
            }
            assert!(
                Instant::now() < deadline,
                "the jailed VMM never started; stderr:\n{}",
                self.stderr_text()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
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
pub fn run_to_end(dir: &Path, name: &str, args: Args) -> (ExitStatus, String, String) {
    let mut vm = spawn(dir, name, args);
    let st = vm.wait_exit(Duration::from_secs(120));
    (st, vm.serial_text(), vm.stderr_text())
}

pub fn sha256(path: &Path) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(std::fs::read(path).unwrap()))
}
