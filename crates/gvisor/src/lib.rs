//! kiln-gvisor: the gVisor driver, one `runsc` container per sandbox, behind kiln-driver's
//! [`Driver`] and [`Checkpoint`] traits (the binary builds it with [`build`]).
//!
//! Per sandbox, under `<state>/gvisor/sandboxes/<id>/`:
//! - `upper/`, `work/`: the writable layer of a host overlayfs mounted at `rootfs/`, whose lower
//!   layer is the template's rootfs directory (never written to);
//! - `bundle/config.json`: the OCI spec (kiln-agent as init, `linux.resources` limits,
//!   `cgroupsPath` `/kiln/<id>`);
//! - `run/`: a 64 KiB tmpfs at `/run/kiln`, sealed outside the server's windows ([`seal`]); the
//!   agent's `agent.sock` there is reached through `runsc --host-uds=create`, so the
//!   server↔agent channel never needs the sandbox network;
//! - `console.log`: the agent's stdout/stderr (runsc's own errors too).
//!
//! runsc's container state lives in `<state>/gvisor/runsc/` (`--root`), so every sandbox kiln
//! ever started can be listed and deleted after a crash.
//!
//! [`Driver::create`] prepares the layer and bundle; [`Driver::start`] is one `runsc run
//! --detach`. The server is a child subreaper: stop SIGKILLs and reaps a sandbox's runsc
//! processes itself before `runsc delete --force` (which would poll until init reaped them).
//! [`baseline`] is runsc driven directly, what `kiln bench` measures the driver against.
//! Modules: the README's crate map (`crates/gvisor`).

pub mod baseline;
mod cgroup_dirs;
mod checkpoint;
mod console;
mod container;
mod cpu_weight;
mod disk;
mod disk_pool;
mod forward;
mod generation;
mod host_stats;
pub mod in_use;
mod layout;
mod mounts;
pub mod net_config;
pub mod network;
mod oci;
mod oom_reserve;
mod pause_begun;
mod peer;
mod portable;
mod portable_snapshot;
mod pressure;
mod pressure_events;
mod proto;
mod reap;
mod runsc;
mod seal;
mod settings;
mod settle;
pub mod slack;
mod snapshot;
pub mod trace;
mod volumes;

use std::path::{Path, PathBuf};

use kiln_proto::envd::ENVD_PORT;

pub use baseline::GvisorBaseline;
pub use mounts::is_mounted;
pub use oci::oci_spec;
pub use reap::reap_adopted_zombies;
pub use runsc::Runsc;
pub use settings::{GvisorConfig, GvisorSettings};

pub use console::tail;
pub use container::halt_container;
use container::{AgentSocket, RunDirs};
/// The driver seam, under the name this crate's modules use (`crate::driver::…`).
use kiln_driver as driver;
use kiln_driver::{
    io_err, BoxIo, Checkpoint, Driver, DriverError, HostSandbox, Result, SandboxSpec, SandboxStats,
};
pub use oci::cgroup_memory_limit;

/// Path of the agent binary inside every template.
pub const AGENT_PATH: &str = "/usr/bin/kiln-agent";
/// Directory (inside the sandbox) holding the agent's host-reachable socket.
pub const AGENT_SOCKET_DIR: &str = "/run/kiln";
const SOCKET_NAME: &str = "agent.sock";
/// Longest sandbox id the driver accepts (kiln generates 20-character ids).
pub const MAX_ID_LEN: usize = 32;

/// The gVisor driver for `settings`, its state under `state_dir/gvisor`.
pub fn build(settings: &GvisorSettings, state_dir: &Path) -> Result<std::sync::Arc<dyn Driver>> {
    Ok(std::sync::Arc::new(GvisorDriver::new(
        GvisorConfig::from_settings(settings, state_dir),
    )?))
}

pub struct GvisorDriver {
    cfg: GvisorConfig,
    runsc: Runsc,
    net: Option<std::sync::Arc<network::Network>>,
    /// Work on a sandbox still running after a call returned (a capture's source continuing),
    /// by sandbox id.
    settling: settle::Settling,
    /// Containers no longer running their sandbox being deleted in the background, by
    /// container id (see [`generation`]).
    retiring: settle::Settling,
    /// Fork parents whose continuation waits for their children (see
    /// [`Checkpoint::capture_for_fork`]): dropping the sender lets it go on.
    holds: generation::Holds,
    syscalls: std::sync::OnceLock<crate::driver::SyscallObserver>,
    slack: Option<slack::SentrySlack>,
    idle_slack: Option<slack::IdleSlack>,
    weights: cpu_weight::Weights,
    /// Host-side pressure of each sandbox (the fork-bomb backstop).
    pressure: std::sync::Arc<pressure::HostPressure>,
    /// Frozen layers captures are making (the layer clean-up skips them).
    making: in_use::Making,
    /// Formatted disk images ready for creates.
    disks: std::sync::Arc<disk_pool::DiskPool>,
    /// The seal state of the directories shared at /run/kiln, and the agents' verified peers.
    run_dirs: std::sync::Arc<RunDirs>,
}

/// Sandbox ids become directory and container names: keep them to a safe alphabet.
fn check_id(id: &str) -> Result<()> {
    if id.is_empty()
        || id.len() > MAX_ID_LEN
        || !id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(DriverError::InvalidId(id.to_string()));
    }
    Ok(())
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
        let runsc = Runsc {
            bin: cfg.runsc.clone(),
            root: cfg.dir.join("runsc"),
            platform: cfg.platform.clone(),
            ignore_cgroups: cfg.ignore_cgroups,
            network: cfg.network.is_some(),
        };
        let net = cfg
            .network
            .clone()
            .map(|n| network::Network::new(n, cfg.dir.join("sandboxes")));
        let slack = cfg.timer_slack.map(slack::SentrySlack::new);
        let idle_slack = cfg
            .idle_timer_slack
            .map(|idle| slack::IdleSlack::new(idle, cfg.timer_slack, cfg.deep_idle));
        let cfg_dir = cfg.dir.clone();
        Ok(Self {
            cfg,
            runsc,
            net,
            settling: Default::default(),
            retiring: Default::default(),
            holds: Default::default(),
            syscalls: Default::default(),
            slack,
            idle_slack,
            weights: cpu_weight::Weights::default(),
            pressure: Default::default(),
            making: Default::default(),
            disks: std::sync::Arc::new(disk_pool::DiskPool::new(cfg_dir.join("disk-pool"))),
            run_dirs: Default::default(),
        })
    }

    pub fn config(&self) -> &GvisorConfig {
        &self.cfg
    }

    /// Tears down the network slots kept ready (a server or bench shutting down); the slots of
    /// running sandboxes stay with them.
    pub async fn shutdown_network(&self) {
        if let Some(net) = &self.net {
            net.shutdown().await;
        }
    }

    /// Whether runsc must start (or restore) sandbox `id` with the `/proc/sys/net`
    /// workaround: only when it has a network slot and the probe says this runsc needs it.
    pub(crate) async fn sysctl_workaround(&self, id: &str) -> bool {
        match &self.net {
            Some(net) => match net.sandbox_ns(id).await {
                Some(ns) => net.needs_sysctl_workaround(&ns).await,
                None => false,
            },
            None => false,
        }
    }

    /// Gets sandbox `id`'s own network slot ready for a restore into it (a paused sandbox
    /// resuming, a snapshot's source continuing); returns whether runsc needs the workaround.
    pub(crate) async fn prepare_restore(&self, id: &str) -> Result<bool> {
        if let Some(net) = &self.net {
            net.readdress(id).await?;
        }
        Ok(self.sysctl_workaround(id).await)
    }

    /// Whether container `cid` runs. A sandbox process that died is our zombie (we are its
    /// subreaper) until reaped, and runsc counts a zombie as alive: reaped first.
    pub(crate) async fn container_runs(&self, cid: &str) -> bool {
        reap_adopted_zombies();
        self.runsc.status(cid).await.as_deref() == Some("running")
    }

    /// The runsc command line this driver uses.
    pub fn runsc(&self) -> &Runsc {
        &self.runsc
    }

    fn sandbox_dir(&self, id: &str) -> PathBuf {
        self.cfg.dir.join("sandboxes").join(id)
    }

    /// Sandbox `id`'s agent socket (see [`container::AgentSocket`]).
    fn agent<'a>(&'a self, id: &'a str) -> AgentSocket<'a> {
        AgentSocket::new(id, self.sandbox_dir(id), &self.run_dirs)
    }

    /// Ends the sandbox's container and processes, keeping its files (layer, bundle, saved
    /// state). Idempotent.
    async fn halt(&self, id: &str) -> Result<()> {
        self.settling.settle(id).await;
        let dir = self.sandbox_dir(id);
        self.retire_leftovers(id);
        for cid in generation::retiring(&dir) {
            self.retiring.settle(&cid).await;
        }
        halt_container(&self.runsc, &self.cid(id), &dir).await
    }
}

#[async_trait::async_trait]
impl Driver for GvisorDriver {
    fn name(&self) -> &'static str {
        "gvisor"
    }

    async fn create(&self, spec: &SandboxSpec) -> Result<()> {
        check_id(&spec.id)?;
        let r = self.prepare_with(spec, None).await;
        if r.is_err() {
            let _ = self.stop(&spec.id).await;
        }
        r
    }

    async fn start(&self, id: &str) -> Result<()> {
        check_id(id)?;
        let dir = self.sandbox_dir(id);
        if !dir.join("bundle/config.json").exists() {
            return Err(DriverError::NotFound(id.to_string()));
        }
        let workaround = self.sysctl_workaround(id).await;
        let pod = trace::start(&dir, id, self.syscalls.get())?;
        let (bundle, log) = (dir.join("bundle"), dir.join("console.log"));
        let cid = self.cid(id);
        self.runsc
            .run_detached(&bundle, &cid, &log, workaround, pod.as_deref())
            .await?;
        self.weights.started(id, &cid);
        console::watch(&log);
        Ok(())
    }

    async fn stop(&self, id: &str) -> Result<()> {
        check_id(id)?;
        self.halt(id).await?;
        self.weights.forget(id);
        console::unwatch(&self.sandbox_dir(id).join("console.log"));
        if let Some(net) = &self.net {
            net.detach(id).await;
        }
        let r = self.remove_files(id);
        self.gc_layers();
        r
    }

    async fn connect(&self, id: &str, port: u16) -> Result<BoxIo> {
        check_id(id)?;
        // (A capture's source may still be continuing in the background.)
        self.settling.settle(id).await;
        if port != ENVD_PORT {
            if let Some(net) = &self.net {
                return match net.connect(id, port).await {
                    // Refused at the sandbox's address: maybe a server bound to localhost.
                    Err(DriverError::Unreachable { reason, .. })
                        if reason.starts_with(network::REFUSED) =>
                    {
                        let agent = self.agent(id);
                        match async { forward::via_agent(agent.connect().await?, port).await }.await
                        {
                            Ok(Some(s)) => Ok(Box::new(s)),
                            _ => Err(DriverError::Unreachable {
                                id: id.to_string(),
                                port,
                                reason,
                            }),
                        }
                    }
                    r => r,
                };
            }
            return Err(DriverError::Unreachable {
                id: id.to_string(),
                port,
                reason: format!(
                    "this server runs sandboxes without a network; only the agent port \
                     {ENVD_PORT} is reachable"
                ),
            });
        }
        // The agent's socket, made reachable from the host by `--host-uds=create`: this path
        // needs no sandbox network.
        match self.agent(id).connect_and_seal().await {
            Ok(s) => Ok(Box::new(s)),
            Err(e) => Err(container::unreachable(id, port, e)),
        }
    }

    async fn is_running(&self, id: &str) -> Result<bool> {
        check_id(id)?;
        // (A capture's source may still be continuing in the background.)
        self.settling.settle(id).await;
        if self.paused_on_host(id) {
            // Its checkpointed container may still be retiring.
            return Ok(false);
        }
        if let Some(net) = &self.net {
            net.ready().await; // a restarted server's slots (egress proxies) are adopted
        }
        Ok(self.container_runs(&self.cid(id)).await)
    }

    async fn dead(&self, ids: &[String]) -> Vec<String> {
        reap_adopted_zombies();
        // One /proc scan for all sandboxes; only those without a runsc-sandbox process are
        // asked about with `runsc state`.
        let alive = reap::live_sandbox_ids(&self.runsc.root);
        let mut out = Vec::new();
        for id in ids.iter().filter(|id| check_id(id).is_ok()) {
            if alive.contains(&self.cid(id)) {
                continue;
            }
            // A capture's source restoring in the background has no process for a moment
            // (and its generation changes).
            self.settling.settle(id).await;
            let cid = self.cid(id);
            if reap::live_sandbox_ids(&self.runsc.root).contains(&cid) {
                continue;
            }
            if self.runsc.status(&cid).await.as_deref() != Some("running") {
                out.push(id.clone());
            }
        }
        out
    }

    async fn stats(&self, id: &str) -> Result<SandboxStats> {
        check_id(id)?;
        // (A capture's source may still be continuing in the background.)
        self.settling.settle(id).await;
        let cid = self.cid(id);
        if let Some(stats) = host_stats::read(&cid) {
            return Ok(stats);
        }
        // No host cgroup (cgroups ignored): ask the sentry.
        let out = self
            .runsc
            .output(&["events", "--stats", &cid])
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
            // The host cgroup has headroom above the sandbox's size (oci::host_memory_limit).
            mem_limit_bytes: match num(&d["memory"]["usage"]["limit"]) {
                0 => cgroup_memory_limit(&cid)
                    .map(oci::sandbox_memory)
                    .unwrap_or(0),
                n => oci::sandbox_memory(n),
            },
            mem_cache_bytes: oci::cgroup_file_cache(&cid).unwrap_or(0),
            pids: num(&d["pids"]["current"]),
        })
    }

    async fn list_on_host(&self) -> Result<Vec<HostSandbox>> {
        let mut ids = std::collections::BTreeSet::new();
        let sdir = self.cfg.dir.join("sandboxes");
        if let Ok(rd) = std::fs::read_dir(&sdir) {
            for e in rd.flatten() {
                if let Some(n) = e.file_name().to_str() {
                    ids.insert(n.to_string());
                }
            }
        }
        let running = self.containers_on_host(&mut ids).await?;
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
        let dir = self.sandbox_dir(id);
        let cur = tail(&dir.join("console.log"), max_bytes);
        if cur.len() >= max_bytes {
            return Ok(cur);
        }
        // Just rotated: the rest comes from the previous file.
        let older = tail(&dir.join("console.log.1"), max_bytes - cur.len());
        Ok(older + &cur)
    }

    async fn housekeep(&self, ids: &[String]) {
        // Keyed by container: a resumed sandbox runs new host tasks under its next id.
        let cids: Vec<String> = ids.iter().map(|id| self.cid(id)).collect();
        if let Some(s) = &self.slack {
            s.housekeep(&cids);
        }
        if let Some(s) = &self.idle_slack {
            for id in s.housekeep(ids, &cids, std::time::Instant::now()) {
                tracing::debug!(sandbox = id, "idle long: deep timer slack");
            }
        }
        self.pressure.retain(&cids);
        for id in ids.iter().filter(|id| check_id(id).is_ok()) {
            console::rotate_if_large(&self.sandbox_dir(id).join("console.log"));
            // Host limits near: the agent kills its biggest command (kiln_agent::relief).
            self.pressure.tick(&self.runsc, id, &self.cid(id)).await;
        }
    }

    fn set_idle(&self, id: &str, idle: bool) {
        if let Some(s) = &self.idle_slack {
            s.apply(id, &self.cid(id), idle);
        }
    }

    fn set_background(&self, id: &str, background: bool) {
        if !self.runsc.ignore_cgroups {
            self.weights.set(id, &self.cid(id), background);
        }
    }

    fn death_cause(&self, id: &str) -> Option<&'static str> {
        (self.pressure.ran_out(&self.cid(id))).then_some(pressure::OOM_CAUSE)
    }
    fn has_network(&self) -> bool {
        self.net.is_some()
    }

    async fn shutdown(&self) {
        self.disks.clear();
        self.shutdown_network().await;
    }

    async fn set_network(&self, id: &str, policy: &kiln_net::EgressPolicy) -> Result<()> {
        check_id(id)?;
        match &self.net {
            Some(net) => net.set_policy(id, policy).await,
            None => Err(DriverError::NotImplemented(
                "sandbox networking (this server runs sandboxes without a network)",
            )),
        }
    }

    async fn network(&self, id: &str) -> Option<kiln_net::EgressPolicy> {
        self.net.as_ref()?.policy(id).await
    }

    async fn legacy_ingress(&self, id: &str) -> Option<kiln_net::Ingress> {
        check_id(id).ok()?;
        self.net.as_ref()?.legacy_ingress(id)
    }

    fn set_net_observer(&self, o: crate::driver::NetObserver) {
        if let Some(net) = &self.net {
            net.set_observer(o);
        }
    }

    fn set_syscall_observer(&self, o: crate::driver::SyscallObserver) {
        let _ = self.syscalls.set(o);
    }

    async fn create_volume(&self, id: &str, size_mb: u32) -> Result<()> {
        self.make_volume(id, size_mb).await
    }
    async fn delete_volume(&self, id: &str) -> Result<()> {
        self.remove_volume(id)
    }
    async fn volume_root(&self, id: &str) -> Result<PathBuf> {
        self.volume_data(id).await
    }

    fn checkpoint(&self) -> Option<&dyn Checkpoint> {
        Some(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_checked() {
        assert!(check_id("abc-DEF_1").is_ok());
        for bad in ["", "../x", "a/b", "a b", &"x".repeat(33)] {
            assert!(
                matches!(check_id(bad), Err(DriverError::InvalidId(_))),
                "{bad:?}"
            );
        }
    }
}
