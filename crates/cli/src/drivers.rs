//! The binary's driver wiring: the isolation driver `kiln serve` and the benches run, built from
//! `--driver` and each driver's settings and handed to the server as an `Arc<dyn Driver>`
//! (kiln-server never names a driver). What `auto` resolves to is [`kiln_host::choose`]'s
//! decision, the one `kiln doctor` reports. The benches get their runtime here too
//! ([`RuntimeFlags`] → [`BenchRuntime`]): its drivers and its raw baseline.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kiln_driver::baseline::{RawBaseline, SandboxBaseline};
use kiln_driver::{Driver, DriverError, Result};
use kiln_gvisor::{GvisorBaseline, GvisorConfig, GvisorDriver, GvisorSettings};
pub use kiln_host::choose::DriverKind;
use kiln_host::choose::{self, DriverChoice, HostProbe, KvmState};
use kiln_microvm::MicrovmSettings;
use kiln_server::templates::Templates;
use kiln_server::{Server, ServerConfig};

/// Driver configuration: the choice, plus each driver's own section.
#[derive(Debug, Clone, Default)]
pub struct DriverConfig {
    pub kind: DriverKind,
    pub gvisor: GvisorSettings,
    pub microvm: MicrovmSettings,
}

/// This host as [`choose::choose`] sees it: the KVM probe, and the gVisor platform configured
/// (`kiln serve` picks one that works before it builds the driver).
pub fn host_probe(cfg: &DriverConfig) -> HostProbe {
    HostProbe {
        kvm: KvmState::probe(),
        gvisor: Ok(cfg
            .gvisor
            .platform
            .clone()
            .unwrap_or_else(|| "ptrace".into())),
    }
}

/// Builds the configured driver, its state under `state_dir/<driver>`.
pub fn build(cfg: &DriverConfig, state_dir: &Path) -> Result<Arc<dyn Driver>> {
    build_with_probe(cfg, state_dir, || host_probe(cfg))
}

/// [`build`] with the host seen through `probe` (run only for `auto`); `auto` logs its
/// decision in one line.
pub fn build_with_probe(
    cfg: &DriverConfig,
    state_dir: &Path,
    probe: impl FnOnce() -> HostProbe,
) -> Result<Arc<dyn Driver>> {
    let c = choose::resolve(cfg.kind, probe).map_err(|reason| DriverError::Unavailable {
        driver: "auto",
        reason,
    })?;
    if cfg.kind == DriverKind::Auto {
        tracing::info!(driver = ?c.driver, "driver auto: {}", c.reason);
    }
    match c.driver {
        Some(DriverChoice::Microvm) => kiln_microvm::build(&cfg.microvm, state_dir),
        _ => kiln_gvisor::build(&cfg.gvisor, state_dir),
    }
}

/// What the sandboxes and snapshots of a state directory stack on, so that `kiln template gc`
/// keeps those template versions.
pub struct TemplateRefs(String);

impl TemplateRefs {
    /// The references the drivers' records under `state_dir` hold.
    pub fn of_state(state_dir: &Path) -> Self {
        Self(kiln_gvisor::in_use::references(&state_dir.join("gvisor")))
    }

    /// Whether `dir` (a template version's directory) is in use.
    pub fn uses(&self, dir: &Path) -> bool {
        kiln_gvisor::in_use::is_referenced(&self.0, dir)
    }
}

/// The runtime flags every `kiln bench` takes: the gVisor runtime its sandboxes and its raw
/// baseline run on.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct RuntimeFlags {
    /// gVisor platform (default: the fastest that works, as `kiln serve`).
    #[arg(long, env = "KILN_PLATFORM")]
    pub platform: Option<String>,
    /// runsc binary (default: the one `kiln serve` uses; see `kiln runtime show`).
    #[arg(long, env = kiln_host::runsc::RUNSC_ENV)]
    pub runsc: Option<PathBuf>,
}

/// The flag of `kiln bench create` naming an older runtime to compare its workload with.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct CompareFlags {
    /// Older runsc to compare the workload with (default: the host's /usr/bin/runsc when it is
    /// older than kiln's minimum).
    #[arg(long)]
    pub old_runsc: Option<PathBuf>,
}

impl RuntimeFlags {
    /// The given runsc and platform, else what `kiln serve` would use on this host (its
    /// runsc; the fastest platform that works).
    pub fn resolve(&self) -> anyhow::Result<BenchRuntime> {
        let runsc = kiln_host::runsc::resolve(self.runsc.as_deref())?.path;
        let platform = match self.platform.clone() {
            Some(p) => p,
            None => kiln_host::runsc::platform::pick(
                &runsc,
                kiln_host::runsc::platform::kvm_at_hardware_speed(),
            )
            .map_err(|e| anyhow::anyhow!("no gVisor platform works: {e}"))?,
        };
        Ok(BenchRuntime(GvisorBaseline {
            bin: runsc,
            platform,
        }))
    }
}

/// The runtime a bench runs on: what its drivers use and what its raw baseline drives.
#[derive(Debug, Clone)]
pub struct BenchRuntime(GvisorBaseline);

/// A bench's own driver, and the runtime's commands on its sandboxes.
pub struct BenchDriver {
    pub driver: Arc<dyn Driver>,
    pub raw: Arc<dyn SandboxBaseline>,
}

impl BenchRuntime {
    /// The runtime as a bench's heading names it ("gVisor, platform systrap").
    pub fn label(&self) -> String {
        format!("{}, platform {}", self.0.runtime(), self.0.platform)
    }

    pub fn platform(&self) -> &str {
        &self.0.platform
    }

    /// The flags that make a `kiln serve` or `kiln node` child run on this runtime.
    pub fn serve_flags(&self) -> Vec<std::ffi::OsString> {
        vec![
            "--runsc".into(),
            self.0.bin.clone().into_os_string(),
            "--platform".into(),
            self.0.platform.clone().into(),
        ]
    }

    /// The driver configuration of a server on this runtime.
    pub fn driver_config(&self) -> DriverConfig {
        let mut cfg = DriverConfig {
            kind: DriverKind::Gvisor,
            ..Default::default()
        };
        cfg.gvisor.runsc = Some(self.0.bin.clone());
        cfg.gvisor.platform = Some(self.0.platform.clone());
        cfg
    }

    /// The runtime driven directly.
    pub fn baseline(&self) -> Arc<dyn RawBaseline> {
        Arc::new(self.0.clone())
    }

    /// The variants a workload is compared across: this runtime on each of its platforms
    /// (`new`), and `old` (the given older runtime, else the host's own runsc when it is older
    /// than kiln's minimum) on the platform every version has.
    pub fn workload_variants(
        &self,
        old: &CompareFlags,
    ) -> Vec<(&'static str, Arc<dyn RawBaseline>)> {
        let on = |bin: &Path, platform: &str| -> Arc<dyn RawBaseline> {
            Arc::new(GvisorBaseline {
                bin: bin.to_path_buf(),
                platform: platform.to_string(),
            })
        };
        let mut v = vec![
            ("new", on(&self.0.bin, "systrap")),
            ("new", on(&self.0.bin, "ptrace")),
        ];
        let host = PathBuf::from("/usr/bin/runsc");
        let old = old.old_runsc.clone().or_else(|| {
            matches!(kiln_host::runsc::probe_version(&host), Ok((v, _)) if !v.is_supported())
                .then_some(host)
        });
        if let Some(o) = old {
            v.push(("old", on(&o, "ptrace")));
        }
        v
    }

    /// A driver on this runtime with its state under `state_dir`, configured by `cfg` (a
    /// [`Self::driver_config`] changed for the bench).
    pub fn driver(&self, cfg: &DriverConfig, state_dir: &Path) -> Result<BenchDriver> {
        let d = Arc::new(GvisorDriver::new(GvisorConfig::from_settings(
            &cfg.gvisor,
            state_dir,
        ))?);
        Ok(BenchDriver {
            driver: d.clone(),
            raw: d,
        })
    }

    /// The environment of a `kiln serve` child that runs on this runtime.
    pub fn serve_env(&self) -> [(&'static str, std::ffi::OsString); 2] {
        [
            (kiln_host::runsc::RUNSC_ENV, self.0.bin.clone().into()),
            ("KILN_PLATFORM", self.0.platform.clone().into()),
        ]
    }

    /// The runtime's entries of a benchmark file's `environment`.
    pub fn environment(&self) -> serde_json::Value {
        serde_json::json!({"gvisorPlatform": self.0.platform})
    }
}

impl DriverConfig {
    /// Sandbox networking of the driver (`None`: none).
    pub fn set_network(&mut self, net: Option<kiln_net::NetConfig>) {
        self.gvisor.network = net;
    }

    /// Timer slack of the sandboxes' host tasks, busy and hinted idle (`None`: the kernel's).
    pub fn set_timer_slack(&mut self, busy: Option<Duration>, idle: Option<Duration>) {
        self.gvisor.timer_slack = busy;
        self.gvisor.idle_timer_slack = idle;
    }

    /// Timer slack of sandboxes hinted idle for long: `(after, slack)` (`None`: none).
    pub fn set_deep_idle(&mut self, deep: Option<(Duration, Duration)>) {
        self.gvisor.deep_idle =
            deep.map(|(after, slack)| kiln_gvisor::slack::DeepIdle { after, slack });
    }
}

/// Sandbox networking of a bench's driver with state in `state_dir`: `range` on the host,
/// `pool_size` slots kept ready, no operator rules or limits.
pub fn bench_network(
    state_dir: &Path,
    range: &str,
    pool_size: usize,
    dns_upstreams: Vec<std::net::Ipv4Addr>,
) -> anyhow::Result<kiln_net::NetConfig> {
    Ok(kiln_net::NetConfig {
        range: range.parse()?,
        pool_size,
        prefix: kiln_gvisor::net_config::prefix_for_state(state_dir),
        operator_allow: Vec::new(),
        dns_upstreams,
        max_connections: 0,
        egress_mib_per_sec: 0,
        // (Set by the server from its audit setting.)
        proxy_all_tcp: false,
    })
}

/// How many sandboxes have a directory in the drivers' state under `state_dir`.
pub fn sandboxes_on_disk(state_dir: &Path) -> usize {
    std::fs::read_dir(sandboxes_dir(state_dir))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Where the driver keeps its sandboxes' directories in the state under `state_dir`.
pub fn sandboxes_dir(state_dir: &Path) -> std::path::PathBuf {
    state_dir.join("gvisor/sandboxes")
}

/// The driver's directory of sandbox `id` in the state under `state_dir`.
pub fn sandbox_dir(state_dir: &Path, id: &str) -> std::path::PathBuf {
    sandboxes_dir(state_dir).join(id)
}

/// A server's configuration and the driver it runs on.
#[derive(Debug, Clone)]
pub struct ServerSetup {
    pub server: ServerConfig,
    pub driver: DriverConfig,
}

impl ServerSetup {
    /// Builds the driver (with the audit log on, every sandbox connection passes the egress
    /// proxy, which records it) and prepares the server on it.
    pub async fn prepare(self, templates: Arc<dyn Templates>) -> anyhow::Result<Server> {
        let (mut dcfg, dir) = (self.driver, self.server.state_dir.clone());
        if let Some(n) = dcfg.gvisor.network.as_mut() {
            n.proxy_all_tcp = self.server.audit.enabled;
        }
        let driver = tokio::task::spawn_blocking(move || build(&dcfg, &dir))
            .await
            .map_err(|e| anyhow::anyhow!("isolation driver setup: {e}"))?
            .map_err(|e| anyhow::anyhow!("isolation driver: {e}"))?;
        Ok(Server::prepare(self.server, driver, templates).await?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `auto` on a host whose KVM runs at hardware speed builds the gVisor driver (the microvm
    /// driver would refuse to start); with nothing working it is a refusal naming why.
    #[test]
    fn auto_on_hardware_kvm_builds_gvisor() {
        let state = tempfile::Builder::new()
            .prefix("kf")
            .tempdir_in("/tmp")
            .unwrap();
        let cfg = DriverConfig::default();
        let d = build_with_probe(&cfg, state.path(), || HostProbe {
            kvm: KvmState::HardwareSpeed("hardware speed (faked)".into()),
            gvisor: Ok("systrap".into()),
        })
        .unwrap();
        assert_eq!(d.name(), "gvisor");
        let e = build_with_probe(&cfg, state.path(), || HostProbe {
            kvm: KvmState::HardwareSpeed("hardware speed (faked)".into()),
            gvisor: Err("runsc is missing".into()),
        })
        .err()
        .expect("nothing works: a refusal");
        assert!(e.to_string().contains("runsc is missing"), "{e}");
    }
}
