//! The VMM: builds a VM (fresh boot or snapshot restore), then runs the event loop that serves
//! device queue notifications, device host sockets and the control API until the VM ends.
//!
//! One concern per submodule, as in Firecracker's `src/vmm`: [`builder`] (boot / restore → a
//! running `Vmm`), [`device_manager`] (legacy + virtio-mmio devices wired to KVM), [`event_loop`]
//! (epoll + control API), [`persist`] (snapshots); this file holds the `Vmm` state, pause/resume
//! and stats.

mod builder;
mod device_manager;
mod event_loop;
mod persist;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vmm_sys_util::eventfd::EventFd;

use crate::api::ApiServer;
use crate::arch::mptable;
use crate::config::VmConfig;
use crate::devices::legacy::serial::SerialDevice;
use crate::devices::virtio::mmio::MmioTransport;
use crate::memory::GuestRam;
use crate::vstate::vcpu::{VcpuCmd, VcpuHandle, VcpuReply, VmExit};
use crate::vstate::vm::Vm;

/// Options of a fresh boot.
pub struct BootOptions {
    pub config: VmConfig,
    /// Serial console output file (created/truncated); stdout when absent.
    pub serial_out: Option<PathBuf>,
    pub api_sock: Option<PathBuf>,
    /// Create vCPUs paused; the `start` API call runs them.
    pub start_paused: bool,
    pub seccomp: bool,
}

/// Options of a restore from a snapshot directory.
pub struct RestoreOptions {
    pub dir: PathBuf,
    pub serial_out: Option<PathBuf>,
    pub api_sock: Option<PathBuf>,
    /// This VM's own CoW overlay (initialized from the snapshot's copy). Required when the
    /// snapshot has a writable disk.
    pub overlay: Option<PathBuf>,
    /// This VM's own vsock socket (required when the snapshot has vsock).
    pub vsock_uds: Option<PathBuf>,
    pub start_paused: bool,
    pub seccomp: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum VmmError {
    #[error("configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Memory(#[from] crate::memory::MemoryError),
    #[error(transparent)]
    Vm(#[from] crate::vstate::vm::VmError),
    #[error(transparent)]
    Vcpu(#[from] crate::vstate::vcpu::VcpuError),
    #[error(transparent)]
    Load(#[from] crate::loader::LoadError),
    #[error(transparent)]
    Disk(#[from] crate::devices::virtio::block::DiskError),
    #[error(transparent)]
    Snapshot(#[from] crate::snapshot::SnapshotError),
    #[error(transparent)]
    Mptable(#[from] mptable::MptableError),
    #[error("{what}: {err}")]
    Io { what: String, err: std::io::Error },
    #[error("seccomp: {0}")]
    Seccomp(String),
}

pub(crate) fn ioe(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> VmmError {
    let what = what.into();
    move |err| VmmError::Io { what, err }
}

pub struct Vmm {
    started_at: Instant,
    config: VmConfig,
    ram: GuestRam,
    vm: Vm,
    serial: Arc<Mutex<SerialDevice>>,
    transports: Vec<Arc<Mutex<MmioTransport>>>,
    vcpus: Vec<VcpuHandle>,
    exit: Arc<VmExit>,
    reset_evt: EventFd,
    paused: bool,
    first_run: Arc<Mutex<Option<Instant>>>,
    /// Overlay file of the block device (to copy into snapshots).
    overlay: Option<PathBuf>,
    api: Option<ApiServer>,
    seccomp: bool,
    restored_from: Option<PathBuf>,
    setup_ms: f64,
}

impl Vmm {
    fn pause_all(&mut self) -> Result<(), String> {
        for v in &self.vcpus {
            match v.request(VcpuCmd::Pause, Duration::from_secs(10)) {
                Some(VcpuReply::Paused) => {}
                _ => return Err(format!("vCPU {} did not pause", v.id)),
            }
        }
        self.paused = true;
        Ok(())
    }

    fn resume_all(&mut self) {
        for v in &self.vcpus {
            v.send(VcpuCmd::Resume);
        }
        self.paused = false;
    }

    pub fn stats(&self) -> serde_json::Value {
        let guest_rss = self.ram.resident_bytes();
        let total_rss = proc_status_kb("VmRSS:") * 1024;
        let first_run_ms = self
            .first_run
            .lock()
            .ok()
            .and_then(|f| f.map(|t| t.duration_since(self.started_at).as_secs_f64() * 1e3));
        serde_json::json!({
            "state": if self.paused { "paused" } else { "running" },
            "vcpus": self.config.vcpus,
            "mem_bytes": self.ram.size,
            "guest_rss_bytes": guest_rss,
            "rss_bytes": total_rss,
            "vmm_rss_bytes": total_rss.saturating_sub(guest_rss),
            "serial_bytes": self.serial.lock().map(|s| s.bytes_out).unwrap_or(0),
            "setup_ms": self.setup_ms,
            "start_to_first_run_ms": first_run_ms,
            "uptime_ms": self.started_at.elapsed().as_secs_f64() * 1e3,
            "restored_from": self.restored_from,
            "seccomp": self.seccomp,
            "devices": self.transports.iter().map(|t| {
                let t = t.lock().unwrap_or_else(|p| p.into_inner());
                serde_json::json!({"type": t.device.device_type(), "errors": t.errors, "metrics": t.device.metrics()})
            }).collect::<Vec<_>>(),
        })
    }
}

/// A field of /proc/self/status in kB.
pub fn proc_status_kb(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix(field)
                    .map(|v| v.trim().trim_end_matches("kB").trim().parse().unwrap_or(0))
            })
        })
        .unwrap_or(0)
}
