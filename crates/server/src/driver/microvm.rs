//! The `microvm` driver (kiln-vmm): settings and the availability check. kiln-vmm boots and
//! snapshots the project's test guests (crates/vmm), but serving sandboxes from it needs a
//! host whose KVM runs guest kernel code at hardware speed and the driver's wiring (vsock
//! CONNECT for [`super::Driver::connect`], the template's ext4 image as the root disk).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::{Driver, DriverError, Result};

/// Settings of the microVM driver (`[microvm]` section).
#[derive(Debug, Clone, Default)]
pub struct MicrovmSettings {
    /// The kiln-vmm binary (default: next to `kiln`, else on PATH).
    pub vmm: Option<PathBuf>,
    /// Guest kernel image.
    pub kernel: Option<PathBuf>,
}

/// Builds the microVM driver, or says why it cannot run on this host.
pub fn build(_settings: &MicrovmSettings, _state_dir: &Path) -> Result<Arc<dyn Driver>> {
    if !Path::new("/dev/kvm").exists() {
        return Err(DriverError::Unavailable {
            driver: "microvm",
            reason: "there is no /dev/kvm; use --driver gvisor".into(),
        });
    }
    match kiln_host::kvm::probe() {
        Ok(p) if !p.hardware_speed() => Err(DriverError::Unavailable {
            driver: "microvm",
            reason: format!(
                "KVM does not run guest kernel code at hardware speed here ({}), so a Linux \
                 guest cannot boot; use --driver gvisor",
                p.verdict()
            ),
        }),
        Err(e) => Err(DriverError::Unavailable {
            driver: "microvm",
            reason: format!("the KVM probe failed ({e}); use --driver gvisor"),
        }),
        Ok(_) => Err(DriverError::Unavailable {
            driver: "microvm",
            reason: "serving sandboxes from kiln-vmm is not wired into kiln serve yet; use \
                     --driver gvisor"
                .into(),
        }),
    }
}
