//! Which gVisor platforms work with a given runsc on this host, and which one kiln uses.
//!
//! Each platform is tried by running `/bin/true` in a throwaway sandbox (`runsc do`) with a
//! timeout. Order is fastest first, as measured on kiln's workloads: `systrap` (2024 runsc+),
//! `kvm` (only when the KVM probe says guest kernel code runs at hardware speed: under nested
//! or para-virtualized KVM it can hang) and `ptrace` (works everywhere, slowest).

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;

/// Platforms in the order kiln prefers them (fastest first).
pub const FASTEST_FIRST: [&str; 3] = ["systrap", "kvm", "ptrace"];

/// How long one platform probe may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(8);

/// The outcome of trying one platform.
#[derive(Debug, Clone, Serialize)]
pub struct PlatformProbe {
    pub platform: String,
    pub ok: bool,
    /// Wall time of the `runsc do /bin/true`, when it ran.
    pub ms: Option<u64>,
    pub note: String,
}

/// Runs a command with a timeout, killing its whole process group if it overruns.
pub(crate) fn run_with_timeout(
    cmd: &mut Command,
    timeout: Duration,
) -> Result<(bool, String), String> {
    use std::os::unix::process::CommandExt;
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let mut child = cmd.spawn().map_err(|e| e.to_string())?;
    let start = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(_)) => {
                let out = child.wait_with_output().map_err(|e| e.to_string())?;
                let mut text = String::from_utf8_lossy(&out.stdout).to_string();
                text.push_str(&String::from_utf8_lossy(&out.stderr));
                return Ok((out.status.success(), text));
            }
            Ok(None) if start.elapsed() > timeout => {
                // SAFETY: killpg on the group we created for this child; failure is harmless.
                unsafe {
                    libc::killpg(child.id() as i32, libc::SIGKILL);
                }
                let _ = child.wait();
                return Err(format!("timed out after {timeout:?}"));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// Tries one platform: `runsc --platform=P --network=none do /bin/true`.
pub fn try_platform(runsc: &Path, platform: &str) -> PlatformProbe {
    let root = std::env::temp_dir().join(format!(
        "kiln-runsc-probe-{}-{platform}",
        std::process::id()
    ));
    let started = Instant::now();
    let r = run_with_timeout(
        Command::new(runsc)
            .arg(format!("--root={}", root.display()))
            .arg(format!("--platform={platform}"))
            .args(["--network=none", "do", "/bin/true"]),
        PROBE_TIMEOUT,
    );
    let _ = std::fs::remove_dir_all(&root);
    let ms = started.elapsed().as_millis() as u64;
    let probe = |ok, ms, note: String| PlatformProbe {
        platform: platform.to_string(),
        ok,
        ms,
        note,
    };
    match r {
        Ok((true, _)) => probe(true, Some(ms), format!("{platform}: ok ({ms} ms)")),
        Ok((false, out)) => {
            let last = out
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("");
            let last: String = last.chars().take(100).collect();
            probe(false, Some(ms), format!("{platform}: failed ({last})"))
        }
        Err(e) => probe(false, None, format!("{platform}: {e}")),
    }
}

/// Tries every platform (`kvm` only when `kvm_fast`), fastest first.
pub fn probe_all(runsc: &Path, kvm_fast: bool) -> Vec<PlatformProbe> {
    FASTEST_FIRST
        .iter()
        .map(|p| {
            if *p == "kvm" && !kvm_fast {
                PlatformProbe {
                    platform: "kvm".into(),
                    ok: false,
                    ms: None,
                    note: "kvm: not tried (KVM is not at hardware speed)".into(),
                }
            } else {
                try_platform(runsc, p)
            }
        })
        .collect()
}

/// The fastest platform that works, trying them in order and stopping at the first success.
/// `Err` carries every failure when none works.
pub fn pick(runsc: &Path, kvm_fast: bool) -> Result<String, String> {
    let mut notes = Vec::new();
    for p in FASTEST_FIRST {
        if p == "kvm" && !kvm_fast {
            continue;
        }
        let r = try_platform(runsc, p);
        if r.ok {
            return Ok(r.platform);
        }
        notes.push(r.note);
    }
    Err(notes.join("; "))
}

/// True when KVM runs guest kernel code at hardware speed (runs the KVM probe; false without
/// `/dev/kvm`).
pub fn kvm_at_hardware_speed() -> bool {
    Path::new("/dev/kvm").exists()
        && crate::kvm::probe()
            .map(|p| p.hardware_speed())
            .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeout_kills_the_process_group() {
        let t = Instant::now();
        let r = run_with_timeout(
            Command::new("sh").args(["-c", "sleep 30 & sleep 30"]),
            Duration::from_millis(300),
        );
        assert!(r.unwrap_err().contains("timed out"));
        assert!(t.elapsed() < Duration::from_secs(5));
        let (ok, out) = run_with_timeout(
            Command::new("sh").args(["-c", "echo hi"]),
            Duration::from_secs(5),
        )
        .unwrap();
        assert!(ok && out.contains("hi"));
    }

    #[test]
    fn a_failing_runsc_reports_its_last_line() {
        let p = try_platform(Path::new("/bin/false"), "systrap");
        assert!(!p.ok);
        assert!(p.note.starts_with("systrap: failed"), "{}", p.note);
    }
}
