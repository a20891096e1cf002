//! Snapshot files. A snapshot is a directory:
//!
//! * `state.json` — first line `KILN-VMM-SNAPSHOT <format version> <sha256 of the rest>`, then
//!   JSON: VM config, vCPU state (regs, sregs, FPU, xsave, xcrs, LAPIC, MSRs, events, MP state),
//!   irqchip, PIT, clock, serial, and per-device transport/queue/device state;
//! * `memory` — guest RAM, sparse (holes for never-written pages), restored `MAP_PRIVATE`;
//! * `disk.overlay` — copy of the block device's CoW overlay at snapshot time (if any); each
//!   restored VM must be given its own overlay path, which is initialized from this file.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::config::VmConfig;
use crate::devices::legacy::serial::SerialPersist;
use crate::devices::virtio::mmio::TransportPersist;
use crate::vstate::vcpu::VcpuState;
use crate::vstate::vm::VmState;

pub const MAGIC: &str = "KILN-VMM-SNAPSHOT";
/// Bumped on any incompatible change of the state layout.
pub const FORMAT_VERSION: u32 = 1;

pub const STATE_FILE: &str = "state.json";
pub const MEMORY_FILE: &str = "memory";
pub const OVERLAY_FILE: &str = "disk.overlay";

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("snapshot {path}: {err}")]
    Io { path: String, err: std::io::Error },
    #[error("{path} is not a kiln-vmm snapshot (bad header)")]
    NotASnapshot { path: String },
    #[error("snapshot {path} has format version {found}, this kiln-vmm reads version {want}: take a new snapshot with this version")]
    Version {
        path: String,
        found: String,
        want: u32,
    },
    #[error("snapshot {path} is corrupt or truncated: {why}")]
    Corrupt { path: String, why: String },
}

#[derive(Clone, Serialize, Deserialize)]
pub struct DevicePersist {
    pub device_type: u32,
    pub transport: TransportPersist,
    pub state: serde_json::Value,
}

#[derive(Serialize, Deserialize)]
pub struct Snapshot {
    pub vmm_version: String,
    pub config: VmConfig,
    pub mem_size: u64,
    pub vm: VmState,
    pub vcpus: Vec<VcpuState>,
    pub serial: SerialPersist,
    pub devices: Vec<DevicePersist>,
}

pub fn state_path(dir: &Path) -> PathBuf {
    dir.join(STATE_FILE)
}

/// Writes `state.json` (atomically: temp file + rename).
pub fn write_state(dir: &Path, snap: &Snapshot) -> Result<(), SnapshotError> {
    let path = state_path(dir);
    let io = |err| SnapshotError::Io {
        path: path.display().to_string(),
        err,
    };
    let body = serde_json::to_vec(snap).map_err(|e| io(std::io::Error::other(e)))?;
    let sum = hex::encode(Sha256::digest(&body));
    let tmp = dir.join(".state.json.tmp");
    let mut f = std::fs::File::create(&tmp).map_err(io)?;
    writeln!(f, "{MAGIC} {FORMAT_VERSION} {sum}").map_err(io)?;
    f.write_all(&body).map_err(io)?;
    f.sync_all().map_err(io)?;
    std::fs::rename(&tmp, &path).map_err(io)?;
    Ok(())
}

/// Reads and verifies `state.json`.
pub fn read_state(dir: &Path) -> Result<Snapshot, SnapshotError> {
    let path = state_path(dir);
    let p = path.display().to_string();
    let data = std::fs::read(&path).map_err(|err| SnapshotError::Io {
        path: p.clone(),
        err,
    })?;
    let nl = data
        .iter()
        .position(|&c| c == b'\n')
        .ok_or(SnapshotError::NotASnapshot { path: p.clone() })?;
    let header = std::str::from_utf8(&data[..nl])
        .map_err(|_| SnapshotError::NotASnapshot { path: p.clone() })?;
    let mut parts = header.split(' ');
    if parts.next() != Some(MAGIC) {
        return Err(SnapshotError::NotASnapshot { path: p });
    }
    let version = parts.next().unwrap_or("");
    if version != FORMAT_VERSION.to_string() {
        return Err(SnapshotError::Version {
            path: p,
            found: version.to_string(),
            want: FORMAT_VERSION,
        });
    }
    let sum = parts.next().unwrap_or("");
    let body = &data[nl + 1..];
    if hex::encode(Sha256::digest(body)) != sum {
        return Err(SnapshotError::Corrupt {
            path: p,
            why: "checksum mismatch".into(),
        });
    }
    serde_json::from_slice(body).map_err(|e| SnapshotError::Corrupt {
        path: p,
        why: e.to_string(),
    })
}

/// Copy of `src` to `dst` that keeps holes as holes: only allocated extents (SEEK_DATA) are
/// copied, zeros included, so a CoW overlay keeps its "written blocks" exactly.
pub fn sparse_copy(src: &Path, dst: &Path) -> std::io::Result<u64> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileExt;
    let s = std::fs::File::open(src)?;
    let len = s.metadata()?.len();
    let d = std::fs::File::create(dst)?;
    d.set_len(len)?;
    let mut buf = vec![0u8; 1 << 20];
    let mut pos: i64 = 0;
    let mut written = 0u64;
    while (pos as u64) < len {
        // SAFETY: lseek on an fd we own.
        let start = unsafe { libc::lseek(s.as_raw_fd(), pos, libc::SEEK_DATA) };
        if start < 0 {
            break;
        }
        // SAFETY: as above.
        let end = unsafe { libc::lseek(s.as_raw_fd(), start, libc::SEEK_HOLE) };
        if end <= start {
            break;
        }
        let (mut off, end) = (start as u64, (end as u64).min(len));
        while off < end {
            let n = ((end - off) as usize).min(buf.len());
            s.read_exact_at(&mut buf[..n], off)?;
            d.write_all_at(&buf[..n], off)?;
            written += n as u64;
            off += n as u64;
        }
        pos = end as i64;
    }
    d.sync_all()?;
    Ok(written)
}
