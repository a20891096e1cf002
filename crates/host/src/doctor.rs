//! `kiln doctor`: what this host can do, why, and which isolation driver kiln will use.
//!
//! Every check records what it saw (`detail`) so the report explains itself; the JSON form
//! (`kiln doctor --json`) is the same [`Report`] serialized.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde::Serialize;

use crate::choose::{self, HostProbe, KvmState};
use crate::kvm::{self, KvmProbe};
use crate::prereq;
use crate::runsc::{self, platform};
use platform::run_with_timeout;

/// Free space below which the cache dir is reported as a problem.
pub const MIN_FREE_BYTES: u64 = 2 << 30;

pub use crate::choose::DriverChoice;

#[derive(Debug, Clone, Serialize)]
pub struct Check {
    pub name: String,
    pub ok: bool,
    pub detail: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct KvmReport {
    pub present: bool,
    /// Probe result when it ran.
    pub probe: Option<KvmProbe>,
    pub hardware_speed: bool,
    pub detail: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct RunscReport {
    pub path: Option<String>,
    pub version: Option<String>,
    /// Where this runsc came from (`--runsc`/`KILN_RUNSC`, kiln's cache, the host).
    pub origin: Option<runsc::Origin>,
    /// Platforms that ran `true` in a sandbox, fastest first.
    pub working_platforms: Vec<String>,
    /// Every platform tried, with its outcome.
    pub platforms: Vec<platform::PlatformProbe>,
    pub detail: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Version of this report's shape.
    pub schema: u32,
    pub kernel: String,
    /// "v1", "v2" or "hybrid".
    pub cgroup_mode: String,
    pub kvm: KvmReport,
    pub runsc: RunscReport,
    pub checks: Vec<Check>,
    pub cache_dir: String,
    pub cache_free_bytes: Option<u64>,
    /// The driver kiln will use by default; `None` when kiln cannot run here.
    pub driver: Option<DriverChoice>,
    pub driver_reason: String,
    /// True when kiln can run sandboxes on this host.
    pub can_run: bool,
    /// The host's limits, what one idle sandbox costs, and how many more fit.
    pub capacity: CapacityReport,
}

/// The capacity part of the report.
#[derive(Debug, Clone, Serialize)]
pub struct CapacityReport {
    pub limits: crate::capacity::HostLimits,
    pub per_sandbox: crate::capacity::SandboxCost,
    /// Each limit and how many more sandboxes it allows, tightest first.
    pub headroom: Vec<crate::capacity::Headroom>,
}

fn capacity_report() -> CapacityReport {
    let limits = crate::capacity::read_limits(&crate::paths::state_dir());
    let per_sandbox = crate::capacity::SandboxCost::default();
    CapacityReport {
        headroom: crate::capacity::headroom(&limits, &per_sandbox),
        limits,
        per_sandbox,
    }
}

pub const SCHEMA_VERSION: u32 = 1;

fn kernel_version() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

/// Classifies the cgroup setup from the text of /proc/mounts.
pub fn cgroup_mode_from_mounts(mounts: &str) -> String {
    let mut v1 = false;
    let mut v2_root = false;
    let mut v2_other = false;
    for line in mounts.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 3 {
            continue;
        }
        match f[2] {
            "cgroup2" if f[1] == "/sys/fs/cgroup" => v2_root = true,
            "cgroup2" => v2_other = true,
            "cgroup" => v1 = true,
            _ => {}
        }
    }
    match (v1, v2_root, v2_other) {
        (false, true, _) => "v2",
        (true, _, true) | (true, true, _) => "hybrid",
        (true, false, false) => "v1",
        _ => "none",
    }
    .to_string()
}

fn cgroup_mode() -> String {
    cgroup_mode_from_mounts(&std::fs::read_to_string("/proc/mounts").unwrap_or_default())
}

fn runsc_report(skip_platform_probe: bool, kvm_fast: bool) -> RunscReport {
    let r = match runsc::resolve(None) {
        Ok(r) => r,
        Err(e) => {
            let (path, version) = match &e {
                runsc::RunscError::TooOld { path, version, .. } => (
                    Some(path.clone()),
                    Some(format!("runsc version {version} (too old)")),
                ),
                _ => (None, None),
            };
            return RunscReport {
                path,
                version,
                origin: None,
                working_platforms: vec![],
                platforms: vec![],
                detail: e.to_string(),
            };
        }
    };
    let (platforms, detail) = if skip_platform_probe {
        (Vec::new(), "platform probe skipped".to_string())
    } else {
        let p = platform::probe_all(&r.path, kvm_fast);
        let d = p
            .iter()
            .map(|x| x.note.as_str())
            .collect::<Vec<_>>()
            .join("; ");
        (p, d)
    };
    RunscReport {
        path: Some(r.path.display().to_string()),
        version: Some(r.version_line.clone()),
        origin: Some(r.origin),
        working_platforms: platforms
            .iter()
            .filter(|p| p.ok)
            .map(|p| p.platform.clone())
            .collect(),
        platforms,
        detail,
    }
}

fn kvm_report(skip: bool) -> KvmReport {
    let present = Path::new("/dev/kvm").exists();
    if !present {
        return KvmReport {
            present,
            probe: None,
            hardware_speed: false,
            detail: "/dev/kvm not present".into(),
        };
    }
    if skip {
        return KvmReport {
            present,
            probe: None,
            hardware_speed: false,
            detail: "probe skipped".into(),
        };
    }
    match kvm::probe() {
        Ok(p) => KvmReport {
            present,
            hardware_speed: p.hardware_speed(),
            detail: p.verdict(),
            probe: Some(p),
        },
        Err(e) => KvmReport {
            present,
            probe: None,
            hardware_speed: false,
            detail: format!("probe failed: {e}"),
        },
    }
}

fn check(name: &str, ok: bool, detail: impl Into<String>) -> Check {
    Check {
        name: name.into(),
        ok,
        detail: detail.into(),
    }
}

fn tool_checks() -> Vec<Check> {
    prereq::SERVE_TOOLS
        .iter()
        .filter(|t| t.program != "runsc")
        .map(|t| match prereq::which(t.program) {
            Some(p) => check(t.program, true, format!("{} ({})", p.display(), t.why)),
            None => check(
                t.program,
                false,
                format!("missing: install package {} ({})", t.package, t.why),
            ),
        })
        .collect()
}

fn kernel_feature_checks() -> Vec<Check> {
    let filesystems = std::fs::read_to_string("/proc/filesystems").unwrap_or_default();
    let overlay = filesystems
        .lines()
        .any(|l| l.trim_end().ends_with("overlay"));
    let tun = Path::new("/dev/net/tun").exists();
    // Create a veth pair in a throwaway network namespace: the only test that tells for sure.
    let veth = run_with_timeout(
        Command::new("unshare").args([
            "--net",
            "ip",
            "link",
            "add",
            "kiln-doc0",
            "type",
            "veth",
            "peer",
            "name",
            "kiln-doc1",
        ]),
        Duration::from_secs(5),
    )
    .map(|(ok, _)| ok)
    .unwrap_or(false);
    let nft_works = prereq::which("nft")
        .map(|nft| {
            Command::new(nft)
                .args(["list", "tables"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .map(|s| s.success())
                .unwrap_or(false)
        })
        .unwrap_or(false);
    vec![
        check(
            "overlayfs",
            overlay,
            if overlay {
                "overlay in /proc/filesystems"
            } else {
                "overlay filesystem not available"
            },
        ),
        check(
            "tun",
            tun,
            if tun {
                "/dev/net/tun present"
            } else {
                "/dev/net/tun missing"
            },
        ),
        check(
            "veth",
            veth,
            if veth {
                "created a veth pair in a scratch network namespace"
            } else {
                "could not create a veth pair in a scratch network namespace (needs root and veth)"
            },
        ),
        check(
            "nftables",
            nft_works,
            if nft_works {
                "`nft list tables` works"
            } else {
                "`nft list tables` failed (needs root and nf_tables)"
            },
        ),
    ]
}

/// Whether `kiln serve` can give sandboxes a network (it is on by default), and why not.
fn network_check(checks: &[Check]) -> Check {
    let failed = |name: &str| {
        checks
            .iter()
            .find(|c| c.name == name)
            .is_some_and(|c| !c.ok)
    };
    let mut why = Vec::new();
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        why.push("not root".to_string());
    }
    for (name, what) in [
        ("ip", "iproute2 (`ip`) is missing"),
        ("nft", "nftables (`nft`) is missing"),
        ("veth", "network namespaces with veth pairs do not work"),
        ("nftables", "nftables does not work"),
    ] {
        if failed(name) {
            why.push(what.to_string());
        }
    }
    if why.is_empty() {
        check(
            "network",
            true,
            "sandbox networking works (on by default in `kiln serve`; --network off to turn it off)",
        )
    } else {
        check(
            "network",
            false,
            format!(
                "`kiln serve` will run sandboxes without a network (creates asking for internet \
                 access get 501): {}",
                why.join("; ")
            ),
        )
    }
}

/// What the report saw, as the probe [`choose::choose`] looks at.
pub fn host_probe(kvm: &KvmReport, runsc: &RunscReport) -> HostProbe {
    let kvm = match (kvm.present, kvm.hardware_speed, kvm.probe.is_some()) {
        (false, _, _) => KvmState::Absent,
        (true, true, _) => KvmState::HardwareSpeed(kvm.detail.clone()),
        (true, false, true) => KvmState::Emulated(kvm.detail.clone()),
        (true, false, false) => KvmState::Unknown(kvm.detail.clone()),
    };
    HostProbe {
        kvm,
        gvisor: runsc
            .working_platforms
            .first()
            .cloned()
            .ok_or_else(|| runsc.detail.clone()),
    }
}

/// The default driver ([`choose::choose`] over what the report saw), or none, and why.
pub fn choose_driver(kvm: &KvmReport, runsc: &RunscReport) -> (Option<DriverChoice>, String) {
    let c = choose::choose(&host_probe(kvm, runsc));
    (c.driver, c.reason)
}

#[derive(Debug, Clone, Copy, Default)]
pub struct Options {
    /// Skip the slow probes (KVM and runsc platforms); used by fast tests.
    pub skip_probes: bool,
}

/// Builds the full report.
pub fn report(opts: Options) -> Report {
    let kvm = kvm_report(opts.skip_probes);
    let runsc = runsc_report(opts.skip_probes, kvm.hardware_speed);
    let cache = crate::paths::cache_dir();
    let free = crate::capacity::free_bytes(&cache);
    let mut checks = tool_checks();
    checks.extend(kernel_feature_checks());
    checks.push(network_check(&checks));
    let domain = std::env::var("KILN_DOMAIN").unwrap_or_else(|_| "localhost".into());
    let (ok, detail) = crate::names::check(&domain);
    checks.push(check("host names", ok, detail));
    checks.push(match free {
        Some(b) => check(
            "disk space",
            b >= MIN_FREE_BYTES,
            format!(
                "{:.1} GiB free under {}",
                b as f64 / (1u64 << 30) as f64,
                cache.display()
            ),
        ),
        None => check(
            "disk space",
            false,
            format!("cannot stat {}", cache.display()),
        ),
    });
    let (driver, driver_reason) = choose_driver(&kvm, &runsc);
    Report {
        schema: SCHEMA_VERSION,
        kernel: kernel_version(),
        cgroup_mode: cgroup_mode(),
        can_run: driver.is_some(),
        capacity: capacity_report(),
        kvm,
        runsc,
        checks,
        cache_dir: cache.display().to_string(),
        cache_free_bytes: free,
        driver,
        driver_reason,
    }
}

/// The human-readable screen.
pub fn render(r: &Report) -> String {
    let mark = |ok: bool| if ok { "ok  " } else { "FAIL" };
    let mut s = String::new();
    s.push_str(&format!("kiln doctor\n  kernel        {}\n", r.kernel));
    s.push_str(&format!("  cgroups       {}\n", r.cgroup_mode));
    s.push_str(&format!(
        "  /dev/kvm      {}\n",
        if r.kvm.present { "present" } else { "absent" }
    ));
    s.push_str(&format!("  KVM speed     {}\n", r.kvm.detail));
    s.push_str(&format!(
        "  runsc         {} {}{}\n                {}\n",
        r.runsc.path.as_deref().unwrap_or("missing"),
        r.runsc.version.as_deref().unwrap_or(""),
        match r.runsc.origin {
            Some(runsc::Origin::Flag) => " (--runsc)",
            Some(runsc::Origin::Env) => " (KILN_RUNSC)",
            Some(runsc::Origin::Kiln) => " (installed by kiln)",
            Some(runsc::Origin::Host) => " (host)",
            None => "",
        },
        r.runsc.detail
    ));
    for c in &r.checks {
        s.push_str(&format!("  [{}] {:<11} {}\n", mark(c.ok), c.name, c.detail));
    }
    let c = &r.capacity;
    s.push_str(&format!(
        "  capacity      one idle sandbox ≈ {} MiB, {} host threads, {} files; {} threads in use\n",
        c.per_sandbox.mem_bytes >> 20,
        c.per_sandbox.threads,
        c.per_sandbox.open_files,
        c.limits.threads_now
    ));
    for h in &c.headroom {
        s.push_str(&format!(
            "                {:>7} more under {}\n",
            h.sandboxes, h.limit
        ));
    }
    match r.driver {
        Some(d) => s.push_str(&format!(
            "\ndriver: {} — {}\n",
            serde_json::to_value(d).unwrap().as_str().unwrap_or("?"),
            r.driver_reason
        )),
        None => s.push_str(&format!(
            "\nkiln cannot run sandboxes here: {}\n",
            r.driver_reason
        )),
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cgroup_modes() {
        let hybrid = "tmpfs /sys/fs/cgroup tmpfs rw 0 0\ncgroup /sys/fs/cgroup/cpu cgroup rw,cpu 0 0\ncgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n";
        assert_eq!(cgroup_mode_from_mounts(hybrid), "hybrid");
        assert_eq!(
            cgroup_mode_from_mounts("cgroup2 /sys/fs/cgroup cgroup2 rw 0 0\n"),
            "v2"
        );
        assert_eq!(
            cgroup_mode_from_mounts("cgroup /sys/fs/cgroup/memory cgroup rw,memory 0 0\n"),
            "v1"
        );
        assert_eq!(cgroup_mode_from_mounts(""), "none");
    }

    fn kvm(present: bool, hw: bool) -> KvmReport {
        KvmReport {
            present,
            probe: None,
            hardware_speed: hw,
            detail: "d".into(),
        }
    }

    fn runsc(platforms: &[&str]) -> RunscReport {
        RunscReport {
            path: Some("/usr/bin/runsc".into()),
            version: None,
            origin: None,
            working_platforms: platforms.iter().map(|s| s.to_string()).collect(),
            platforms: vec![],
            detail: "x".into(),
        }
    }

    #[test]
    fn driver_choice() {
        // Hardware-speed KVM: gVisor while the microvm driver cannot boot Linux guests.
        let (d, why) = choose_driver(&kvm(true, true), &runsc(&["systrap"]));
        assert_eq!(d, Some(DriverChoice::Gvisor));
        assert!(why.contains("microvm") && why.contains("systrap"), "{why}");
        assert_eq!(choose_driver(&kvm(true, true), &runsc(&[])).0, None);
        let (d, why) = choose_driver(&kvm(true, false), &runsc(&["ptrace"]));
        assert_eq!(d, Some(DriverChoice::Gvisor));
        assert!(
            why.contains("not usable") && why.contains("ptrace"),
            "{why}"
        );
        let (d, why) = choose_driver(&kvm(false, false), &runsc(&[]));
        assert_eq!(d, None);
        assert!(why.contains("kiln runtime ensure"), "{why}");
    }

    #[test]
    fn fast_report_serializes_with_every_field() {
        let r = report(Options { skip_probes: true });
        let v = serde_json::to_value(&r).unwrap();
        for k in [
            "schema",
            "kernel",
            "cgroup_mode",
            "kvm",
            "runsc",
            "checks",
            "cache_dir",
            "driver",
            "driver_reason",
            "can_run",
        ] {
            assert!(v.get(k).is_some(), "missing {k} in {v}");
        }
        assert_eq!(v["schema"], SCHEMA_VERSION);
        assert!(render(&r).contains("kiln doctor"));
    }
}
