//! Building the isolation driver from configuration (`--driver`). What `auto` resolves to is
//! [`kiln_host::choose`]'s decision, the one `kiln doctor` reports.

use std::path::Path;
use std::sync::Arc;

pub use kiln_host::choose::DriverKind;
use kiln_host::choose::{self, DriverChoice, HostProbe, KvmState};

use super::{gvisor, microvm, Driver, DriverError, Result};

/// Driver configuration: the choice, plus each driver's own section.
#[derive(Debug, Clone, Default)]
pub struct DriverConfig {
    pub kind: DriverKind,
    pub gvisor: gvisor::GvisorSettings,
    pub microvm: microvm::MicrovmSettings,
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
        Some(DriverChoice::Microvm) => microvm::build(&cfg.microvm, state_dir),
        _ => gvisor::build(&cfg.gvisor, state_dir),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `auto` on a host whose KVM runs at hardware speed builds the gVisor driver (the microvm
    /// driver would refuse to start).
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
