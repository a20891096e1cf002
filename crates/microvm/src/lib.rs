//! kiln-microvm: the `microvm` driver (kiln-vmm): settings and the availability check. kiln-vmm boots and
//! snapshots the project's test guests (crates/vmm), but serving sandboxes from it needs a
//! host whose KVM runs guest kernel code at hardware speed and the driver's wiring (vsock
//! CONNECT for [`Driver::connect`], the template's ext4 image as the root disk). Until
//! then it refuses with [`kiln_host::choose::microvm_readiness`]'s reason, the one `kiln doctor`
//! gives.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kiln_host::choose::{microvm_readiness, KvmState};

use kiln_driver::{Driver, DriverError, Result};

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
    let reason = match microvm_readiness(&KvmState::probe()) {
        Err(why) => format!("{why}; use --driver gvisor"),
        Ok(()) => "serving sandboxes from kiln-vmm is not wired into kiln serve yet; use \
                   --driver gvisor"
            .into(),
    };
    Err(DriverError::Unavailable {
        driver: "microvm",
        reason,
    })
}
