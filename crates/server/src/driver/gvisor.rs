//! The gVisor driver: one `runsc` container per sandbox.
//!
//! Per sandbox, under `<state>/gvisor/sandboxes/<id>/`:
//! - `upper/`, `work/`: the writable layer of a host overlayfs mounted at `rootfs/`, whose lower
//!   layer is the template's rootfs directory (never written to);
//! - `bundle/config.json`: the OCI spec (kiln-agent as init, `linux.resources` limits,
//!   `cgroupsPath` `/kiln/<id>`);
//! - `run/`: bind-mounted at `/run/kiln` inside; the agent binds `agent.sock` there and
//!   `runsc --host-uds=create` makes it reachable from the host, so the server↔agent channel
//!   never depends on the sandbox network (which is `--network=none`);
//! - `console.log`: the agent's stdout/stderr (runsc's own errors too).
//!
//! runsc's container state lives in `<state>/gvisor/runsc/` (`--root`), so every sandbox kiln
//! ever started can be listed and deleted after a crash.
//!
//! Latency: [`Driver::create`] only prepares the layer and the bundle; [`Driver::start`] is one
//! `runsc run --detach` (one runsc process instead of `create` + `start`). The server is a child
//! subreaper, so each sandbox's `runsc-sandbox`/`runsc-gofer` processes become its children:
//! stop SIGKILLs and reaps them itself before `runsc delete --force`, which otherwise polls for
//! seconds until the host's init reaps the zombies.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use serde_json::json;
use tokio::process::Command;

use super::{
    io_err, AgentEndpoint, Driver, DriverError, HostSandbox, Result, SandboxSpec, SandboxStats,
};

/// Path of the agent binary inside every template.
pub const AGENT_PATH: &str = "/usr/bin/kiln-agent";
/// Directory (inside the sandbox) holding the agent's host-reachable socket.
pub const AGENT_SOCKET_DIR: &str = "/run/kiln";
const SOCKET_NAME: &str = "agent.sock";
/// Longest sandbox id the driver accepts (kiln generates 20-character ids).
pub const MAX_ID_LEN: usize = 32;

/// Settings of the gVisor driver.
#[derive(Debug, Clone)]
pub struct GvisorConfig {
    /// Root of the driver's state (`<state>/gvisor`).
    pub dir: PathBuf,
    /// `runsc` binary.
    pub runsc: PathBuf,
    /// `--platform` (`ptrace` here; `systrap`/`kvm` where they work).
    pub platform: String,
    /// Skip cgroup configuration entirely (hosts where runsc cannot manage cgroups).
    pub ignore_cgroups: bool,
    /// Extra arguments given to the agent (after the socket flag).
    pub agent_args: Vec<String>,
}

impl GvisorConfig {
    pub fn new(state_dir: &Path) -> Self {
        Self {
            dir: state_dir.join("gvisor"),
            // KILN_RUNSC / KILN_PLATFORM: what `kiln serve` resolved (scripts/test.sh exports them).
            runsc: std::env::var_os("KILN_RUNSC")
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
                .or_else(|| kiln_host::prereq::which("runsc"))
                .unwrap_or_else(|| PathBuf::from("runsc")),
            platform: std::env::var("KILN_PLATFORM")
                .ok()
                .filter(|v| !v.is_empty())
                .unwrap_or_else(|| "ptrace".into()),
            ignore_cgroups: false,
            agent_args: Vec::new(),
        }
    }
}

pub struct GvisorDriver {
    cfg: GvisorConfig,
}

/// Sandbox ids become directory and container names: keep them to a safe alphabet.
fn check_id(id: &str) -> Result<()> {
    if id.is_empty()
        || id.len() > MAX_ID_LEN
        || !id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(DriverError::Other(format!("invalid sandbox id {id:?}")));
    }
    Ok(())
}

fn cstr(p: &Path) -> Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| DriverError::Other(format!("path {} contains a NUL byte", p.display())))
}

/// Whether `path` is a mount point (listed in /proc/self/mountinfo).
pub fn is_mounted(path: &Path) -> bool {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let want = path.to_string_lossy();
    info.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .any(|mp| unescape_mount(mp) == want)
}

fn unescape_mount(s: &str) -> String {
    // mountinfo escapes space, tab, newline and backslash as \ooo.
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 4 <= b.len() {
            if let Ok(v) =
                u8::from_str_radix(std::str::from_utf8(&b[i + 1..i + 4]).unwrap_or("x"), 8)
            {
                out.push(v);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn mount_overlay(lower: &Path, upper: &Path, work: &Path, target: &Path) -> Result<()> {
    for p in [lower, upper, work] {
        if p.to_string_lossy().contains([',', ':']) {
            return Err(DriverError::Other(format!(
                "overlay layer path {} contains ',' or ':', which overlayfs cannot take",
                p.display()
            )));
        }
    }
    let opts = format!(
        "lowerdir={},upperdir={},workdir={}",
        lower.display(),
        upper.display(),
        work.display()
    );
    let src = CString::new("overlay").expect("static");
    let fstype = CString::new("overlay").expect("static");
    let target_c = cstr(target)?;
    let data =
        CString::new(opts).map_err(|_| DriverError::Other("NUL in overlay options".into()))?;
    // SAFETY: all pointers are valid NUL-terminated strings that outlive the call.
    let rc = unsafe {
        libc::mount(
            src.as_ptr(),
            target_c.as_ptr(),
            fstype.as_ptr(),
            0,
            data.as_ptr().cast(),
        )
    };
    if rc != 0 {
        return Err(DriverError::Io {
            what: format!(
                "mounting the sandbox overlay at {} (lower {}); kiln serve must run as root",
                target.display(),
                lower.display()
            ),
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

fn unmount(target: &Path) -> Result<()> {
    if !is_mounted(target) {
        return Ok(());
    }
    let c = cstr(target)?;
    // SAFETY: c is a valid NUL-terminated path.
    let rc = unsafe { libc::umount2(c.as_ptr(), 0) };
    if rc != 0 {
        // Something still holds it (a gofer that has not exited yet): detach lazily so nothing
        // is left mounted once the last user goes away.
        // SAFETY: as above.
        let rc = unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        if rc != 0 {
            return Err(DriverError::Io {
                what: format!("unmounting {}", target.display()),
                source: std::io::Error::last_os_error(),
            });
        }
    }
    Ok(())
}

const CAPS: &[&str] = &[
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_SETFCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_MKNOD",
    "CAP_AUDIT_WRITE",
];

/// The OCI runtime spec of one sandbox.
pub fn oci_spec(
    spec: &SandboxSpec,
    rootfs: &Path,
    run_dir: &Path,
    agent_args: &[String],
    with_cgroups: bool,
) -> serde_json::Value {
    let mut env: BTreeMap<String, String> = BTreeMap::new();
    env.insert(
        "PATH".into(),
        "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
    );
    env.insert("HOME".into(), "/root".into());
    for (k, v) in &spec.env {
        env.insert(k.clone(), v.clone());
    }
    let env: Vec<String> = env.into_iter().map(|(k, v)| format!("{k}={v}")).collect();
    let mut args = vec![
        AGENT_PATH.to_string(),
        "--listen-unix".to_string(),
        format!("{AGENT_SOCKET_DIR}/{SOCKET_NAME}"),
    ];
    args.extend(agent_args.iter().cloned());
    let period: u64 = 100_000;
    let mut linux = json!({
        "namespaces": [
            {"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}, {"type": "network"}
        ],
        "resources": {
            "memory": {"limit": u64::from(spec.memory_mb) * 1024 * 1024},
            "cpu": {"quota": i64::from(spec.cpu_count.max(1)) * period as i64, "period": period},
            "pids": {"limit": i64::from(spec.pids_limit.max(16))}
        },
        "maskedPaths": ["/proc/kcore", "/proc/keys", "/proc/timer_list", "/sys/firmware"],
        "readonlyPaths": ["/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus"]
    });
    if with_cgroups {
        linux["cgroupsPath"] = json!(format!("/kiln/{}", spec.id));
    }
    json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": 0, "gid": 0},
            "args": args,
            "env": env,
            "cwd": "/",
            "capabilities": {
                "bounding": CAPS, "effective": CAPS, "permitted": CAPS, "inheritable": CAPS
            },
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1048576u64, "soft": 1048576u64}],
            "noNewPrivileges": false
        },
        "root": {"path": rootfs, "readonly": false},
        "hostname": spec.id,
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
             "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs",
             "options": ["nosuid", "noexec", "nodev", "ro"]},
            {"destination": AGENT_SOCKET_DIR, "type": "bind", "source": run_dir,
             "options": ["rbind", "rw"]}
        ],
        "linux": linux
    })
}

impl GvisorDriver {
    pub fn new(cfg: GvisorConfig) -> Result<Self> {
        // runsc leaves each sandbox's processes behind as orphans. Adopting them (instead of
        // PID 1) lets stop reap them at once: `runsc delete` waits until they are gone, and a
        // slow init on the host leaves them as zombies for seconds.
        // SAFETY: prctl(PR_SET_CHILD_SUBREAPER) takes plain integers and affects only this
        // process.
        let rc = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
        if rc != 0 {
            tracing::warn!(
                error = %std::io::Error::last_os_error(),
                "cannot become a child subreaper; stopping sandboxes will be slower"
            );
        }
        // The agent socket path must fit in sockaddr_un (108 bytes) with the longest id.
        let longest = cfg
            .dir
            .join("sandboxes")
            .join("x".repeat(MAX_ID_LEN))
            .join("run")
            .join(SOCKET_NAME);
        if longest.as_os_str().len() > 107 {
            return Err(DriverError::Other(format!(
                "state directory {} is too long: sandbox agent sockets under it would exceed the \
                 108-byte Unix socket path limit; use a shorter --state-dir",
                cfg.dir.display()
            )));
        }
        std::fs::create_dir_all(cfg.dir.join("runsc")).map_err(io_err(format!(
            "creating {}",
            cfg.dir.join("runsc").display()
        )))?;
        std::fs::create_dir_all(cfg.dir.join("sandboxes")).map_err(io_err(format!(
            "creating {}",
            cfg.dir.join("sandboxes").display()
        )))?;
        Ok(Self { cfg })
    }

    pub fn config(&self) -> &GvisorConfig {
        &self.cfg
    }

    fn sandbox_dir(&self, id: &str) -> PathBuf {
        self.cfg.dir.join("sandboxes").join(id)
    }

    fn runsc_root(&self) -> PathBuf {
        self.cfg.dir.join("runsc")
    }

    /// runsc with the global flags every subcommand of a container must see identically.
    pub fn runsc(&self) -> Command {
        let mut c = Command::new(&self.cfg.runsc);
        c.arg(format!("--root={}", self.runsc_root().display()))
            .arg(format!("--platform={}", self.cfg.platform))
            .arg("--network=none")
            .arg("--host-uds=create")
            // Writes go to the host overlayfs layer (runsc >= 2023 defaults to root:self).
            .arg("--overlay2=none")
            .arg("--cpu-num-from-quota");
        if self.cfg.ignore_cgroups {
            c.arg("--ignore-cgroups");
        }
        c.stdin(Stdio::null()).kill_on_drop(true);
        c
    }

    async fn run_runsc(&self, args: &[&str]) -> Result<String> {
        let mut c = self.runsc();
        c.args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
        let out = tokio::time::timeout(Duration::from_secs(60), c.output())
            .await
            .map_err(|_| DriverError::Command {
                command: format!("runsc {}", args.join(" ")),
                output: "timed out after 60s".into(),
            })?
            .map_err(io_err(format!("running {}", self.cfg.runsc.display())))?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if !out.status.success() {
            return Err(DriverError::Command {
                command: format!("runsc {}", args.join(" ")),
                output: text.trim().to_string(),
            });
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// runsc's view of the container: `Some(status)` ("created", "running", "stopped", …).
    async fn runsc_status(&self, id: &str) -> Option<String> {
        let out = self.run_runsc(&["state", id]).await.ok()?;
        let v: serde_json::Value = serde_json::from_str(&out).ok()?;
        v.get("status").and_then(|s| s.as_str()).map(str::to_string)
    }

    async fn prepare(&self, spec: &SandboxSpec) -> Result<()> {
        let dir = self.sandbox_dir(&spec.id);
        if dir.exists() {
            return Err(DriverError::Other(format!(
                "sandbox directory {} already exists",
                dir.display()
            )));
        }
        if !spec
            .rootfs
            .join(AGENT_PATH.trim_start_matches('/'))
            .exists()
        {
            return Err(DriverError::Other(format!(
                "template {} has no {AGENT_PATH} in {}; rebuild the template",
                spec.template_name,
                spec.rootfs.display()
            )));
        }
        for sub in ["upper", "work", "rootfs", "run", "bundle"] {
            std::fs::create_dir_all(dir.join(sub))
                .map_err(io_err(format!("creating {}", dir.join(sub).display())))?;
        }
        mount_overlay(
            &spec.rootfs,
            &dir.join("upper"),
            &dir.join("work"),
            &dir.join("rootfs"),
        )?;
        let config = oci_spec(
            spec,
            &dir.join("rootfs"),
            &dir.join("run"),
            &self.cfg.agent_args,
            !self.cfg.ignore_cgroups,
        );
        let text = serde_json::to_vec_pretty(&config)
            .map_err(|e| DriverError::Other(format!("encoding config.json: {e}")))?;
        std::fs::write(dir.join("bundle/config.json"), text)
            .map_err(io_err("writing config.json"))?;

        Ok(())
    }

    /// `runsc run --detach`: creates the runtime container and starts the agent in one runsc
    /// invocation (one Go process start-up less than `create` + `start`).
    async fn run_detached(&self, id: &str) -> Result<()> {
        let dir = self.sandbox_dir(id);
        if !dir.join("bundle/config.json").exists() {
            return Err(DriverError::NotFound(id.to_string()));
        }
        // The sandbox inherits runsc's stdio for its whole life: give it a file, never a pipe
        // we would have to keep draining.
        let log_path = dir.join("console.log");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(io_err(format!("creating {}", log_path.display())))?;
        let log2 = log.try_clone().map_err(io_err("duplicating the log fd"))?;
        let mut c = self.runsc();
        c.arg("run")
            .arg("--detach")
            .arg(format!("--bundle={}", dir.join("bundle").display()))
            .arg(id)
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log2));
        let status = tokio::time::timeout(Duration::from_secs(60), c.status())
            .await
            .map_err(|_| DriverError::Command {
                command: "runsc run --detach".into(),
                output: "timed out after 60s".into(),
            })?
            .map_err(io_err(format!("running {}", self.cfg.runsc.display())))?;
        if !status.success() {
            let output = tail(&log_path, 4000);
            return Err(DriverError::Command {
                command: format!("runsc run --detach {id}"),
                output,
            });
        }
        Ok(())
    }

    /// Synchronous [`Driver::stop`] for `Drop` guards and signal paths (no runtime needed).
    pub fn stop_blocking(&self, id: &str) -> Result<()> {
        check_id(id)?;
        let pids = self.sandbox_processes(id);
        kill_pids(&pids);
        let deadline = std::time::Instant::now() + REAP_TIMEOUT;
        while !reap_some(&pids) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        reap_adopted_zombies();
        let mut c = std::process::Command::new(&self.cfg.runsc);
        c.arg(format!("--root={}", self.runsc_root().display()))
            .arg(format!("--platform={}", self.cfg.platform))
            .arg("--network=none")
            .arg("--host-uds=create")
            .arg("--overlay2=none")
            .args(["delete", "--force", id])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let _ = c.status();
        reap_adopted_zombies();
        self.remove_files(id)
    }

    /// The sandbox's own host processes (`runsc-sandbox`, `runsc-gofer`; `runsc run --detach`
    /// leaves them behind as orphans, which become children of this process because it is a
    /// child subreaper, see [`GvisorDriver::new`]).
    fn sandbox_processes(&self, id: &str) -> Vec<libc::pid_t> {
        let dir = self.sandbox_dir(id);
        let dir = dir.to_string_lossy();
        let mut out = Vec::new();
        let Ok(rd) = std::fs::read_dir("/proc") else {
            return out;
        };
        for e in rd.flatten() {
            let Some(pid) = e
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<libc::pid_t>().ok())
            else {
                continue;
            };
            let Ok(cmdline) = std::fs::read(e.path().join("cmdline")) else {
                continue;
            };
            let mut args = cmdline.split(|b| *b == 0).map(String::from_utf8_lossy);
            let argv0 = args.next().unwrap_or_default();
            if argv0 != "runsc-sandbox" && argv0 != "runsc-gofer" {
                continue;
            }
            // The sandbox's command line names the container id, the gofer's the bundle.
            if args.any(|a| a == id || a.contains(dir.as_ref())) {
                out.push(pid);
            }
        }
        out
    }

    /// Host path of the agent socket.
    pub fn socket_path(&self, id: &str) -> PathBuf {
        self.sandbox_dir(id).join("run").join(SOCKET_NAME)
    }

    /// Removes every host trace of a sandbox (after runsc is gone).
    fn remove_files(&self, id: &str) -> Result<()> {
        let dir = self.sandbox_dir(id);
        unmount(&dir.join("rootfs"))?;
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(DriverError::Io {
                what: format!("removing {}", dir.display()),
                source: e,
            }),
        }
    }
}

/// How long stop waits for a killed sandbox's processes to exit.
const REAP_TIMEOUT: Duration = Duration::from_secs(3);

fn kill_pids(pids: &[libc::pid_t]) {
    for &pid in pids {
        // SAFETY: kill takes plain integers; pid is a positive process id read from /proc.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
}

/// Reaps whichever of `pids` have exited; true when none of them is left to wait for (all
/// reaped, or not our children, in which case `runsc delete` waits for them).
fn reap_some(pids: &[libc::pid_t]) -> bool {
    let mut done = true;
    for &pid in pids {
        let mut status = 0;
        // SAFETY: waitpid on a specific pid with WNOHANG; status is a valid out pointer.
        let rc = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if rc == 0 {
            done = false;
        }
    }
    done
}

/// Reaps exited runsc sandbox/gofer processes this process adopted (as child subreaper) whose
/// exit nobody waited for yet, e.g. of a sandbox that died on its own. Those processes run
/// `/proc/self/exe` of runsc, so their command name is `exe`; processes this server spawns
/// itself (`runsc …`) are left to their owners.
pub fn reap_adopted_zombies() {
    // SAFETY: getpid has no preconditions.
    let me = unsafe { libc::getpid() };
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return;
    };
    for e in rd.flatten() {
        let Some(pid) = e
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<libc::pid_t>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let comm = &stat[open + 1..close];
        let mut rest = stat[close + 1..].split_whitespace();
        let (state, ppid) = (rest.next(), rest.next().and_then(|p| p.parse().ok()));
        if comm == "exe" && state == Some("Z") && ppid == Some(me) {
            let mut status = 0;
            // SAFETY: waitpid on a specific exited child with WNOHANG; status is valid.
            unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        }
    }
}

/// The memory limit of the sandbox's cgroup: v1 memory controller, v2 unified hierarchy
/// (mounted at /sys/fs/cgroup, or at /sys/fs/cgroup/unified on hybrid hosts).
pub fn cgroup_memory_limit(id: &str) -> Option<u64> {
    let candidates = [
        format!("/sys/fs/cgroup/memory/kiln/{id}/memory.limit_in_bytes"),
        format!("/sys/fs/cgroup/kiln/{id}/memory.max"),
        format!("/sys/fs/cgroup/unified/kiln/{id}/memory.max"),
    ];
    candidates
        .iter()
        .filter_map(|p| std::fs::read_to_string(p).ok())
        .find_map(|v| v.trim().parse::<u64>().ok())
}

/// Last `max` bytes of a file, lossily decoded (empty when unreadable).
pub fn tail(path: &Path, max: usize) -> String {
    let Ok(data) = std::fs::read(path) else {
        return String::new();
    };
    let start = data.len().saturating_sub(max);
    String::from_utf8_lossy(&data[start..]).into_owned()
}

#[async_trait::async_trait]
impl Driver for GvisorDriver {
    fn name(&self) -> &'static str {
        "gvisor"
    }

    async fn create(&self, spec: &SandboxSpec) -> Result<()> {
        check_id(&spec.id)?;
        let r = self.prepare(spec).await;
        if r.is_err() {
            let _ = self.stop(&spec.id).await;
        }
        r
    }

    async fn start(&self, id: &str) -> Result<()> {
        check_id(id)?;
        self.run_detached(id).await
    }

    async fn stop(&self, id: &str) -> Result<()> {
        check_id(id)?;
        // Kill the sandbox's processes and reap them ourselves: runsc delete then finds them
        // gone instead of polling for seconds until the host's init reaps the zombies.
        let pids = self.sandbox_processes(id);
        kill_pids(&pids);
        let deadline = tokio::time::Instant::now() + REAP_TIMEOUT;
        while !reap_some(&pids) && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        reap_adopted_zombies();
        // delete --force kills what is left, removes the cgroups and runsc's state. It fails for
        // an unknown container (never created, or a concurrent stop won): only fail if the
        // container is still there.
        if let Err(e) = self.run_runsc(&["delete", "--force", id]).await {
            if self.runsc_status(id).await.is_some() {
                return Err(e);
            }
        }
        reap_adopted_zombies();
        self.remove_files(id)
    }

    fn agent_endpoint(&self, id: &str) -> AgentEndpoint {
        AgentEndpoint::Unix(self.socket_path(id))
    }

    async fn is_running(&self, id: &str) -> Result<bool> {
        check_id(id)?;
        Ok(self.runsc_status(id).await.as_deref() == Some("running"))
    }

    async fn stats(&self, id: &str) -> Result<SandboxStats> {
        check_id(id)?;
        let out = self
            .run_runsc(&["events", "--stats", id])
            .await
            .map_err(|e| match self.sandbox_dir(id).exists() {
                true => e,
                false => DriverError::NotFound(id.to_string()),
            })?;
        let v: serde_json::Value = serde_json::from_str(out.trim())
            .map_err(|e| DriverError::Other(format!("parsing runsc events output: {e}")))?;
        let d = &v["data"];
        let num = |x: &serde_json::Value| x.as_u64().unwrap_or(0);
        Ok(SandboxStats {
            cpu_ns: num(&d["cpu"]["usage"]["total"]),
            mem_used_bytes: num(&d["memory"]["usage"]["usage"]),
            mem_limit_bytes: match num(&d["memory"]["usage"]["limit"]) {
                0 => cgroup_memory_limit(id).unwrap_or(0),
                n => n,
            },
            pids: num(&d["pids"]["current"]),
        })
    }

    async fn list_on_host(&self) -> Result<Vec<HostSandbox>> {
        let mut ids = std::collections::BTreeSet::new();
        let out = self.run_runsc(&["list", "--format=json"]).await?;
        let mut running = std::collections::BTreeSet::new();
        if let Ok(serde_json::Value::Array(list)) = serde_json::from_str(out.trim()) {
            for c in list {
                if let Some(id) = c["id"].as_str() {
                    ids.insert(id.to_string());
                    if c["status"].as_str() == Some("running") {
                        running.insert(id.to_string());
                    }
                }
            }
        }
        let sdir = self.cfg.dir.join("sandboxes");
        if let Ok(rd) = std::fs::read_dir(&sdir) {
            for e in rd.flatten() {
                if let Some(n) = e.file_name().to_str() {
                    ids.insert(n.to_string());
                }
            }
        }
        Ok(ids
            .into_iter()
            .map(|id| HostSandbox {
                running: running.contains(&id),
                id,
            })
            .collect())
    }

    async fn console_log(&self, id: &str, max_bytes: usize) -> Result<String> {
        check_id(id)?;
        Ok(tail(&self.sandbox_dir(id).join("console.log"), max_bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_carries_limits_agent_and_socket_mount() {
        let spec = SandboxSpec {
            id: "sbx1".into(),
            template_name: "base".into(),
            rootfs: "/t/rootfs".into(),
            env: BTreeMap::from([("LANG".into(), "C.UTF-8".into())]),
            cpu_count: 2,
            memory_mb: 256,
            pids_limit: 300,
        };
        let v = oci_spec(
            &spec,
            Path::new("/s/rootfs"),
            Path::new("/s/run"),
            &[],
            true,
        );
        assert_eq!(v["process"]["args"][0], AGENT_PATH);
        assert_eq!(v["process"]["args"][2], "/run/kiln/agent.sock");
        assert_eq!(v["linux"]["resources"]["memory"]["limit"], 256u64 << 20);
        assert_eq!(v["linux"]["resources"]["cpu"]["quota"], 200_000);
        assert_eq!(v["linux"]["resources"]["pids"]["limit"], 300);
        assert_eq!(v["linux"]["cgroupsPath"], "/kiln/sbx1");
        assert_eq!(v["root"]["path"], "/s/rootfs");
        let env: Vec<&str> = v["process"]["env"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e.as_str().unwrap())
            .collect();
        assert!(env.contains(&"LANG=C.UTF-8"));
        let mounts = v["mounts"].as_array().unwrap();
        assert!(mounts
            .iter()
            .any(|m| m["destination"] == "/run/kiln" && m["source"] == "/s/run"));
        let v = oci_spec(
            &spec,
            Path::new("/s/rootfs"),
            Path::new("/s/run"),
            &[],
            false,
        );
        assert!(v["linux"].get("cgroupsPath").is_none());
    }

    #[test]
    fn ids_are_checked() {
        assert!(check_id("abc-DEF_1").is_ok());
        for bad in ["", "../x", "a/b", "a b", &"x".repeat(33)] {
            assert!(check_id(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn mountinfo_unescape() {
        assert_eq!(unescape_mount("/a\\040b"), "/a b");
        assert_eq!(unescape_mount("/plain"), "/plain");
    }
}
