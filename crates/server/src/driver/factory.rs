//! Choosing and building the isolation driver from configuration (`--driver`).

use std::path::Path;
use std::sync::Arc;

use super::{gvisor, microvm, Driver, DriverError, Result};

/// Which isolation driver `kiln serve` uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DriverKind {
    /// What `kiln doctor` recommends for this host.
    #[default]
    Auto,
    Gvisor,
    Microvm,
}

impl std::str::FromStr for DriverKind {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "gvisor" => Ok(Self::Gvisor),
            "microvm" => Ok(Self::Microvm),
            other => Err(format!(
                "unknown driver {other:?}: use gvisor, microvm or auto"
            )),
        }
    }
}

/// Driver configuration: the choice, plus each driver's own section.
#[derive(Debug, Clone, Default)]
pub struct DriverConfig {
    pub kind: DriverKind,
    pub gvisor: gvisor::GvisorSettings,
    pub microvm: microvm::MicrovmSettings,
}

/// What `auto` resolves to on this host, and why: the microVM driver only where KVM runs
/// guest kernel code at hardware speed (the same probe `kiln doctor` runs), else gVisor.
pub fn recommended() -> (DriverKind, String) {
    if !Path::new("/dev/kvm").exists() {
        return (DriverKind::Gvisor, "this host has no /dev/kvm".into());
    }
    match kiln_host::kvm::probe() {
        Ok(p) if p.hardware_speed() => (
            DriverKind::Microvm,
            format!(
                "KVM runs guest kernel code at hardware speed ({})",
                p.verdict()
            ),
        ),
        Ok(p) => (
            DriverKind::Gvisor,
            format!("KVM is not usable for Linux guests here ({})", p.verdict()),
        ),
        Err(e) => (DriverKind::Gvisor, format!("the KVM probe failed ({e})")),
    }
}

/// Builds the configured driver, its state under `state_dir/<driver>`.
pub fn build(cfg: &DriverConfig, state_dir: &Path) -> Result<Arc<dyn Driver>> {
    let kind = match cfg.kind {
        DriverKind::Auto => {
            let (kind, why) = recommended();
            tracing::info!(driver = ?kind, "driver auto: {why}");
            kind
        }
        k => k,
    };
    match kind {
        DriverKind::Gvisor | DriverKind::Auto => gvisor::build(&cfg.gvisor, state_dir),
        DriverKind::Microvm => microvm::build(&cfg.microvm, state_dir),
    }
}

impl From<DriverError> for std::io::Error {
    fn from(e: DriverError) -> Self {
        std::io::Error::other(e.to_string())
    }
}
