//! gVisor's raw baseline (kiln-driver's [`RawBaseline`] and [`SandboxBaseline`]): runsc driven
//! directly, with the same binary, platform and network flag as the driver.
//!
//! Containers boot from OCI bundles written under the bench's work directory: the rootfs
//! read-only, no overlay, no cgroup limits, no agent, `--network=none`; their runsc state is
//! under `<work>/raw-runsc-root` (`<work>/workload-root` for scripts). [`interactive`] measures
//! one idle container; [`sandbox`] checkpoints and restores a sandbox of a running driver.

mod interactive;
mod sandbox;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kiln_driver::baseline::{HostUsage, InteractiveReport, RawBaseline, RawImage};
use kiln_driver::{DriverError, Result};

/// runsc `bin` on `platform`, driven directly.
#[derive(Debug, Clone)]
pub struct GvisorBaseline {
    pub bin: PathBuf,
    pub platform: String,
}

fn failed(what: impl Into<String>) -> DriverError {
    DriverError::Other(what.into())
}

impl GvisorBaseline {
    /// `runsc --root=<root> --platform=… --network=none`, stdin closed.
    fn command(&self, root: &Path) -> Command {
        let mut c = Command::new(&self.bin);
        c.arg(format!("--root={}", root.display()))
            .arg(format!("--platform={}", self.platform))
            .arg("--network=none")
            .stdin(Stdio::null());
        c
    }
}

/// uid, gid and home of `user` in the rootfs's /etc/passwd.
fn passwd_entry(rootfs: &Path, user: &str) -> Option<(u32, u32, String)> {
    let text = std::fs::read_to_string(rootfs.join("etc/passwd")).ok()?;
    text.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        (f.len() >= 6 && f[0] == user)
            .then(|| Some((f[2].parse().ok()?, f[3].parse().ok()?, f[5].to_string())))?
    })
}

const NAMESPACES: &str = r#"[{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}, {"type": "network"}]"#;

/// Writes an OCI bundle at `bundle` running `argv` on `image` (read-only, no overlay, no
/// cgroup limits, no agent) as its user in its workdir.
pub(crate) fn write_bundle(bundle: &Path, image: &RawImage, argv: &[String]) -> Result<()> {
    std::fs::create_dir_all(bundle).map_err(|e| failed(e.to_string()))?;
    let (uid, gid, home) =
        passwd_entry(&image.rootfs, &image.user).unwrap_or((0, 0, "/root".to_string()));
    let namespaces: serde_json::Value =
        serde_json::from_str(NAMESPACES).map_err(|e| failed(e.to_string()))?;
    let spec = serde_json::json!({
        "ociVersion": "1.0.2",
        "process": {"terminal": false, "user": {"uid": uid, "gid": gid},
                    "args": argv,
                    "env": ["PATH=/usr/local/bin:/usr/bin:/bin", format!("HOME={home}"),
                            format!("USER={}", image.user)],
                    "cwd": image.workdir},
        "root": {"path": image.rootfs, "readonly": true},
        "hostname": "raw",
        "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"}],
        "linux": {"namespaces": namespaces}
    });
    std::fs::write(bundle.join("config.json"), spec.to_string()).map_err(|e| failed(e.to_string()))
}

impl RawBaseline for GvisorBaseline {
    fn runtime(&self) -> &str {
        "gVisor"
    }

    fn platform(&self) -> &str {
        &self.platform
    }

    fn tool(&self) -> &str {
        "runsc"
    }

    fn version(&self) -> String {
        kiln_host::runsc::probe_version(&self.bin)
            .map(|(v, _)| v.to_string())
            .unwrap_or_else(|e| e.to_string())
    }

    /// `runsc run` of a bundle at `<work>/raw-<i>`, its stdout piped.
    fn first_line(
        &self,
        work: &Path,
        image: &RawImage,
        argv: &[String],
        expect: &str,
        i: usize,
    ) -> Result<Duration> {
        use std::io::BufRead;
        let bundle = work.join(format!("raw-{i}"));
        write_bundle(&bundle, image, argv)?;
        let id = format!("kiln-bench-raw-{}-{i}", std::process::id());
        let t = Instant::now();
        let mut child = self
            .command(&work.join("raw-runsc-root"))
            .args(["run", "--bundle"])
            .arg(&bundle)
            .arg(&id)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| failed(format!("running runsc: {e}")))?;
        let mut line = String::new();
        let read = match child.stdout.take() {
            Some(out) => std::io::BufReader::new(out).read_line(&mut line).is_ok(),
            None => false,
        };
        let took = t.elapsed();
        let out = child
            .wait_with_output()
            .map_err(|e| failed(format!("waiting for runsc: {e}")))?;
        if !read || line.trim() != expect {
            return Err(failed(format!(
                "raw runsc run printed {line:?} (stderr {:?})",
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        Ok(took)
    }

    /// `runsc --ignore-cgroups run` of a bundle at `<work>/workload-<i>` (removed after).
    fn script(
        &self,
        work: &Path,
        rootfs: &Path,
        shell: &str,
        script: &str,
        i: usize,
    ) -> Result<Vec<u8>> {
        let bundle = work.join(format!("workload-{i}"));
        std::fs::create_dir_all(&bundle).map_err(|e| failed(e.to_string()))?;
        let namespaces: serde_json::Value =
            serde_json::from_str(NAMESPACES).map_err(|e| failed(e.to_string()))?;
        let spec = serde_json::json!({
            "ociVersion": "1.0.2",
            "process": {"terminal": false, "user": {"uid": 0, "gid": 0},
                        "args": [shell, "-c", script],
                        "env": ["PATH=/usr/local/bin:/usr/bin:/bin"], "cwd": "/"},
            "root": {"path": rootfs, "readonly": true},
            "hostname": "workload",
            "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"},
                       {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs"}],
            "linux": {"namespaces": namespaces}
        });
        std::fs::write(bundle.join("config.json"), spec.to_string())
            .map_err(|e| failed(e.to_string()))?;
        let out = self
            .command(&work.join("workload-root"))
            .args(["--ignore-cgroups", "run", "--bundle"])
            .arg(&bundle)
            .arg(format!("kiln-bench-wl-{}-{i}", std::process::id()))
            .output()
            .map_err(|e| failed(format!("running {}: {e}", self.bin.display())))?;
        let _ = std::fs::remove_dir_all(&bundle);
        if !out.status.success() {
            return Err(failed(format!(
                "{shell} under {} --platform={} failed ({}): stdout {:?} stderr {:?}",
                self.bin.display(),
                self.platform,
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        Ok(out.stdout)
    }

    fn interactive(
        &self,
        work: &Path,
        image: &RawImage,
        exec_argv: &[String],
        runs: usize,
        rounds: usize,
    ) -> InteractiveReport {
        interactive::measure(self, work, image, exec_argv, runs, rounds)
    }

    fn usage(&self, root: &Path) -> HostUsage {
        runsc_usage(root)
    }
}

/// Summed over the runsc processes whose command line names `root`.
pub fn runsc_usage(root: &Path) -> HostUsage {
    let needle = root.to_string_lossy().into_owned();
    let mut u = HostUsage::default();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return u;
    };
    for e in rd.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|s| s.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let mut args = cmdline.split(|&b| b == 0);
        let argv0 = String::from_utf8_lossy(args.next().unwrap_or_default());
        let is_runsc = argv0
            .rsplit('/')
            .next()
            .is_some_and(|b| b.starts_with("runsc"));
        let ours = String::from_utf8_lossy(&cmdline).contains(&needle);
        if !(is_runsc && ours) {
            continue;
        }
        let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
            continue;
        };
        u.processes += 1;
        if let Ok(rollup) = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")) {
            u.pss_kib += proc_field(&rollup, "Pss:");
        }
        u.rss_kib += proc_field(&status, "VmRSS:");
        u.threads += proc_field(&status, "Threads:");
    }
    u
}

/// The number after `key` on its line of a /proc status-like file (0 when absent).
fn proc_field(text: &str, key: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bundles_run_as_the_image_user() {
        let d = tempfile::tempdir().unwrap();
        let rootfs = d.path().join("rootfs");
        std::fs::create_dir_all(rootfs.join("etc")).unwrap();
        std::fs::write(
            rootfs.join("etc/passwd"),
            "root:x:0:0::/root:/bin/sh\nuser:x:1000:1001::/home/user:/bin/bash\n",
        )
        .unwrap();
        let image = RawImage {
            rootfs: rootfs.clone(),
            user: "user".into(),
            workdir: "/home/user".into(),
        };
        write_bundle(&d.path().join("b"), &image, &["/bin/true".to_string()]).unwrap();
        let spec: serde_json::Value =
            serde_json::from_slice(&std::fs::read(d.path().join("b/config.json")).unwrap())
                .unwrap();
        assert_eq!(
            spec["process"]["user"],
            serde_json::json!({"uid": 1000, "gid": 1001})
        );
        assert_eq!(spec["process"]["cwd"], "/home/user");
        assert_eq!(spec["root"]["readonly"], true);
        assert_eq!(spec["linux"]["namespaces"].as_array().unwrap().len(), 5);
        assert!(spec["process"]["env"]
            .as_array()
            .unwrap()
            .contains(&serde_json::json!("HOME=/home/user")));
    }

    #[test]
    fn proc_fields() {
        assert_eq!(proc_field("Name:\tx\nVmRSS:\t  1234 kB\n", "VmRSS:"), 1234);
        assert_eq!(proc_field("Threads:\t7\n", "VmRSS:"), 0);
    }
}
