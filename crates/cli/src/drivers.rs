//! The binary's driver wiring: the isolation driver `kiln serve` and the benches run, built from
//! `--driver` and each driver's settings and handed to the server as an `Arc<dyn Driver>`
//! (kiln-server never names a driver). What `auto` resolves to is [`kiln_host::choose`]'s
//! decision, the one `kiln doctor` reports.

use std::path::Path;
use std::sync::Arc;

use kiln_driver::{Driver, DriverError, Result};
use kiln_gvisor::GvisorSettings;
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
