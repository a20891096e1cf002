//! VM configuration (from the command line or a snapshot).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DiskConfig {
    /// Base image, opened read-only, never written.
    pub base: PathBuf,
    /// Per-VM sparse copy-on-write overlay (created if missing). Absent = read-only disk.
    pub overlay: Option<PathBuf>,
    #[serde(default)]
    pub read_only: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VsockConfig {
    /// Guest context id (>= 3).
    pub cid: u64,
    /// Host Unix socket: host→guest connections connect here and send `CONNECT <port>\n`;
    /// guest→host connections to port P go to `<uds>_P`.
    pub uds: PathBuf,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VmConfig {
    pub kernel: Option<PathBuf>,
    #[serde(default)]
    pub cmdline: String,
    pub mem_mib: u64,
    pub vcpus: u8,
    pub disk: Option<DiskConfig>,
    pub vsock: Option<VsockConfig>,
    #[serde(default)]
    pub rng: bool,
}

impl Default for VmConfig {
    fn default() -> Self {
        VmConfig {
            kernel: None,
            cmdline: String::new(),
            mem_mib: 128,
            vcpus: 1,
            disk: None,
            vsock: None,
            rng: false,
        }
    }
}
