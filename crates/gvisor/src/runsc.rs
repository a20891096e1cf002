//! The runsc command line: one builder for every subcommand, so `run`, `state`, `events`,
//! `list` and `delete` of a container always see the same global flags.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::process::Command;

use crate::driver::{io_err, DriverError, Result};

/// How long one runsc invocation may take.
const RUNSC_TIMEOUT: Duration = Duration::from_secs(60);

/// A runsc binary with kiln's global flags.
#[derive(Debug, Clone)]
pub struct Runsc {
    pub bin: PathBuf,
    /// `--root`: runsc's container state (kiln's own, so every sandbox it started can be
    /// listed and deleted after a crash).
    pub root: PathBuf,
    pub platform: String,
    pub ignore_cgroups: bool,
    /// `--network=sandbox` (gVisor's netstack in the spec's network namespace) instead of
    /// `--network=none`.
    pub network: bool,
}

impl Runsc {
    /// The global flags, identical for every subcommand of a container.
    pub fn global_args(&self) -> Vec<String> {
        let mut v = vec![
            format!("--root={}", self.root.display()),
            format!("--platform={}", self.platform),
            format!(
                "--network={}",
                if self.network { "sandbox" } else { "none" }
            ),
            "--host-uds=create".to_string(),
            "--cpu-num-from-quota".to_string(),
            // The writable layer is kiln's host overlayfs (per-sandbox upper dir, which
            // snapshots and forks stack): turn off runsc's own rootfs overlay, the default of
            // newer runsc (`root:self`), which would hide writes from that layer.
            "--overlay2=none".to_string(),
        ];
        if self.network {
            // A checkpoint (pause, snapshot, fork) of a sandbox with open TCP connections
            // disconnects them instead of failing ("endpoint cannot be saved in connected
            // state").
            v.push("--net-disconnect-ok".to_string());
        }
        if self.ignore_cgroups {
            v.push("--ignore-cgroups".to_string());
        }
        v
    }

    /// `runsc <global flags>`, stdin closed, killed if dropped.
    pub fn command(&self) -> Command {
        let mut c = Command::new(&self.bin);
        c.args(self.global_args())
            .stdin(Stdio::null())
            .kill_on_drop(true);
        c
    }

    /// Runs `runsc <args>` and returns its stdout; fails with its output on a non-zero exit.
    pub async fn output(&self, args: &[&str]) -> Result<String> {
        let mut c = self.command();
        c.args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
        let out = tokio::time::timeout(RUNSC_TIMEOUT, c.output())
            .await
            .map_err(|_| DriverError::Command {
                command: format!("runsc {}", args.join(" ")),
                output: format!("timed out after {}s", RUNSC_TIMEOUT.as_secs()),
            })?
            .map_err(io_err(format!("running {}", self.bin.display())))?;
        if !out.status.success() {
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            return Err(DriverError::Command {
                command: format!("runsc {}", args.join(" ")),
                output: text.trim().to_string(),
            });
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Whether runsc knows a container of exactly id `id` (in whatever state). True when the
    /// list cannot be read (a caller then acts on the container as if it were there).
    pub async fn exists(&self, id: &str) -> bool {
        match self.output(&["list", "--quiet"]).await {
            Ok(out) => out.lines().any(|l| l.trim() == id),
            Err(_) => true,
        }
    }

    /// runsc's view of container `id`: `Some(status)` ("created", "running", "stopped", …);
    /// None when there is no container of exactly that id (runsc also accepts a unique
    /// prefix of an id).
    pub async fn status(&self, id: &str) -> Option<String> {
        let out = self.output(&["state", id]).await.ok()?;
        let v: serde_json::Value = serde_json::from_str(&out).ok()?;
        if v.get("id").and_then(|i| i.as_str()) != Some(id) {
            return None;
        }
        v.get("status").and_then(|s| s.as_str()).map(str::to_string)
    }

    /// `runsc run --detach`: creates the container and starts its init in one invocation (one
    /// Go start-up less than `create` + `start`). The sandbox inherits the given stdio for its
    /// whole life, so it gets a file (`log`), never a pipe someone would have to drain.
    ///
    /// `sysctl_workaround`: run it in a private mount namespace with an empty tmpfs over
    /// `/proc/sys/net` (see [`super::network`]).
    /// `pod_config`: `--pod-init-config` (syscall auditing, see [`super::trace`]).
    pub async fn run_detached(
        &self,
        bundle: &Path,
        id: &str,
        log: &Path,
        sysctl_workaround: bool,
        pod_config: Option<&Path>,
    ) -> Result<()> {
        let pod = pod_config.map(|p| format!("--pod-init-config={}", p.display()));
        let sub: Vec<&str> = pod.iter().map(String::as_str).chain(["run"]).collect();
        self.detached(&sub, bundle, id, log, sysctl_workaround)
            .await
    }

    /// `runsc restore --detach`: a new container `id` continuing from the checkpoint in
    /// `image` (stdio, `sysctl_workaround` and `pod_config` as for [`Self::run_detached`]).
    pub async fn restore_detached(
        &self,
        image: &Path,
        bundle: &Path,
        id: &str,
        log: &Path,
        sysctl_workaround: bool,
        pod_config: Option<&Path>,
    ) -> Result<()> {
        let image = format!("--image-path={}", image.display());
        let pod = pod_config.map(|p| format!("--pod-init-config={}", p.display()));
        let sub: Vec<&str> = pod
            .iter()
            .map(String::as_str)
            .chain(["restore", image.as_str()])
            .collect();
        self.detached(&sub, bundle, id, log, sysctl_workaround)
            .await
    }

    /// `runsc checkpoint`: saves the container's memory and processes into `image`. Without
    /// `leave_running` the sandbox stops (its container is left for `delete`).
    pub async fn checkpoint(&self, id: &str, image: &Path, leave_running: bool) -> Result<()> {
        let image = format!("--image-path={}", image.display());
        let mut args = vec!["checkpoint", image.as_str()];
        if leave_running {
            args.push("--leave-running");
        }
        args.push(id);
        self.output(&args).await.map(drop)
    }

    async fn detached(
        &self,
        sub: &[&str],
        bundle: &Path,
        id: &str,
        log: &Path,
        sysctl_workaround: bool,
    ) -> Result<()> {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .map_err(io_err(format!("creating {}", log.display())))?;
        let err = out.try_clone().map_err(io_err("duplicating the log fd"))?;
        let mut c = self.command();
        if sysctl_workaround {
            // SAFETY: the closure runs in the forked child before exec and only makes raw
            // system calls (unshare, mount) on static C strings: no allocation, no locks.
            unsafe { c.pre_exec(hide_proc_sys_net) };
        }
        c.args(sub)
            .arg("--detach")
            .arg(format!("--bundle={}", bundle.display()))
            .arg(id)
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err));
        let status = tokio::time::timeout(RUNSC_TIMEOUT, c.status())
            .await
            .map_err(|_| DriverError::Command {
                command: format!("runsc {} --detach", sub.last().unwrap_or(&"")),
                output: format!("timed out after {}s", RUNSC_TIMEOUT.as_secs()),
            })?
            .map_err(io_err(format!("running {}", self.bin.display())))?;
        if !status.success() {
            return Err(DriverError::Command {
                command: format!("runsc {} --detach {id}", sub.last().unwrap_or(&"")),
                output: super::tail(log, 4000),
            });
        }
        Ok(())
    }
}

/// In a new private mount namespace, covers `/proc/sys/net` with an empty tmpfs (runs in the
/// child between fork and exec; see [`super::network`] for why).
fn hide_proc_sys_net() -> std::io::Result<()> {
    let fail = || Err(std::io::Error::last_os_error());
    // SAFETY: plain system calls with static NUL-terminated strings and null pointers where
    // the kernel accepts them.
    unsafe {
        if libc::unshare(libc::CLONE_NEWNS) != 0 {
            return fail();
        }
        let none = c"none".as_ptr();
        if libc::mount(
            none,
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        ) != 0
        {
            return fail();
        }
        if libc::mount(
            c"kiln-net".as_ptr(),
            c"/proc/sys/net".as_ptr(),
            c"tmpfs".as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            c"size=4k".as_ptr().cast(),
        ) != 0
        {
            return fail();
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_subcommand_gets_the_same_global_flags() {
        let r = Runsc {
            bin: "/usr/bin/runsc".into(),
            root: "/s/runsc".into(),
            platform: "systrap".into(),
            ignore_cgroups: true,
            network: false,
        };
        let args = r.global_args();
        assert_eq!(
            args,
            [
                "--root=/s/runsc",
                "--platform=systrap",
                "--network=none",
                "--host-uds=create",
                "--cpu-num-from-quota",
                "--overlay2=none",
                "--ignore-cgroups"
            ]
        );
        let cmd = r.command();
        let got: Vec<String> = cmd
            .as_std()
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert_eq!(got, args);
        let r = Runsc { network: true, ..r };
        assert!(r.global_args().contains(&"--network=sandbox".to_string()));
    }
}
