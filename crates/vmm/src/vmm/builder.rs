//! Builder: turns boot or restore options into a `Vmm` whose vCPU threads are running (or
//! parked, when started paused).

use std::fs::File;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::device_manager::{build_devices, Devices};
use super::{ioe, BootOptions, RestoreOptions, Vmm, VmmError};
use crate::api::ApiServer;
use crate::arch::mptable;
use crate::config::VmConfig;
use crate::devices::legacy::serial::{SerialDevice, SerialOut};
use crate::memory::GuestRam;
use crate::snapshot;
use crate::vstate::vcpu::{self, Vcpu, VcpuHandle, VcpuRunCtx, VmExit};
use crate::vstate::vm::Vm;

/// Everything a built (booted or restored) VM consists of before its vCPU threads start.
struct VmParts {
    started_at: Instant,
    config: VmConfig,
    ram: GuestRam,
    vm: Vm,
    devices: Devices,
    vcpus: Vec<Vcpu>,
    api: Option<ApiServer>,
    /// Start the vCPU threads parked (the `start` API call runs them).
    paused: bool,
    seccomp: bool,
    /// Overlay file of the block device (copied into snapshots).
    overlay: Option<PathBuf>,
    /// Snapshot directory this VM's RAM is mapped from.
    restored_from: Option<PathBuf>,
}

fn serial_sink(path: &Option<PathBuf>) -> Result<SerialOut, VmmError> {
    Ok(match path {
        Some(p) => {
            Box::new(File::create(p).map_err(ioe(format!("serial output {}", p.display())))?)
        }
        None => Box::new(std::io::stdout()),
    })
}

fn check_config(c: &VmConfig) -> Result<(), VmmError> {
    if c.vcpus == 0 || c.vcpus > 32 {
        return Err(VmmError::Config(format!(
            "vcpus must be 1..=32, got {}",
            c.vcpus
        )));
    }
    if let Some(v) = &c.vsock {
        if v.cid < 3 || v.cid > u32::MAX as u64 {
            return Err(VmmError::Config(format!(
                "vsock guest cid must be 3..=2^32-1, got {}",
                v.cid
            )));
        }
    }
    Ok(())
}

impl Vmm {
    /// Fresh boot: memfd RAM → VM → devices → kernel + boot params → vCPUs.
    pub fn boot(opts: BootOptions) -> Result<Self, VmmError> {
        let started_at = Instant::now();
        let config = opts.config;
        check_config(&config)?;
        let kernel = config
            .kernel
            .clone()
            .ok_or_else(|| VmmError::Config("no kernel given (--kernel)".into()))?;
        if !kernel.is_file() {
            return Err(VmmError::Config(format!(
                "kernel image {} does not exist or is not a file",
                kernel.display()
            )));
        }
        let ram = GuestRam::new_memfd(config.mem_mib << 20)?;
        let vm = Vm::new(&ram)?;
        let api = match &opts.api_sock {
            Some(p) => {
                Some(ApiServer::bind(p).map_err(ioe(format!("API socket {}", p.display())))?)
            }
            None => None,
        };
        let out = serial_sink(&opts.serial_out)?;
        let built = build_devices(&vm, &ram.mem, &config, |irq| SerialDevice::new(irq, out))?;
        let cmdline = format!("{}{}", config.cmdline, built.cmdline_devices);
        let kernel = crate::loader::load_kernel(&ram.mem, ram.size, &kernel, cmdline.trim())?;
        mptable::setup(&ram.mem, config.vcpus, 24)?;
        let mut vcpus = Vec::new();
        for id in 0..config.vcpus {
            let v = Vcpu::new(&vm, id, config.vcpus)?;
            if id == 0 {
                v.setup_boot(&ram.mem, kernel.entry)?;
            } else {
                v.setup_lapic()?;
            }
            vcpus.push(v);
        }
        let overlay =
            config
                .disk
                .as_ref()
                .and_then(|d| if d.read_only { None } else { d.overlay.clone() });
        Self::finish(VmParts {
            started_at,
            config,
            ram,
            vm,
            devices: built,
            vcpus,
            api,
            paused: opts.start_paused,
            seccomp: opts.seccomp,
            overlay,
            restored_from: None,
        })
    }

    /// Restore: snapshot state → RAM mapped private from the memory file → VM → devices with their
    /// saved transport/queue state → vCPU state → (vsock transport reset) → run.
    pub fn restore(opts: RestoreOptions) -> Result<Self, VmmError> {
        let started_at = Instant::now();
        let snap = snapshot::read_state(&opts.dir)?;
        let mut config = snap.config.clone();
        check_config(&config)?;
        if snap.vcpus.len() != config.vcpus as usize {
            return Err(VmmError::Config(format!(
                "snapshot has state for {} vCPUs but its config says {}",
                snap.vcpus.len(),
                config.vcpus
            )));
        }
        let ram = GuestRam::restore_private(&opts.dir.join(snapshot::MEMORY_FILE), snap.mem_size)?;
        let vm = Vm::new(&ram)?;
        // Per-VM resources must be new paths: the overlay copy and the vsock socket.
        let mut overlay = None;
        if let Some(d) = config.disk.as_mut() {
            if !d.read_only && d.overlay.is_some() {
                let dst = opts.overlay.clone().ok_or_else(|| {
                    VmmError::Config("the snapshot has a writable disk: give this VM its own overlay path (--disk-overlay)".into())
                })?;
                snapshot::sparse_copy(&opts.dir.join(snapshot::OVERLAY_FILE), &dst).map_err(
                    ioe(format!("copying the snapshot overlay to {}", dst.display())),
                )?;
                d.overlay = Some(dst.clone());
                overlay = Some(dst);
            }
        }
        if let Some(v) = config.vsock.as_mut() {
            v.uds = opts.vsock_uds.clone().ok_or_else(|| {
                VmmError::Config("the snapshot has a vsock device: give this VM its own socket path (--vsock-uds)".into())
            })?;
        }
        let api = match &opts.api_sock {
            Some(p) => {
                Some(ApiServer::bind(p).map_err(ioe(format!("API socket {}", p.display())))?)
            }
            None => None,
        };
        let out = serial_sink(&opts.serial_out)?;
        let built = build_devices(&vm, &ram.mem, &config, |irq| {
            SerialDevice::restore(irq, out, &snap.serial)
        })?;
        if built.transports.len() != snap.devices.len() {
            return Err(VmmError::Config(
                "snapshot device list does not match its config".into(),
            ));
        }
        for (t, d) in built.transports.iter().zip(&snap.devices) {
            let mut t = t.lock().unwrap_or_else(|p| p.into_inner());
            if t.device.device_type() != d.device_type {
                return Err(VmmError::Config(
                    "snapshot device types do not match its config".into(),
                ));
            }
            // Device geometry (disk size, read-only mode, vsock cid) must match the snapshot.
            if t.device.save() != d.state {
                return Err(VmmError::Config(format!(
                    "device {} given at restore does not match the snapshot (saved {}, now {})",
                    d.device_type,
                    d.state,
                    t.device.save()
                )));
            }
            t.restore(&d.transport).map_err(VmmError::Config)?;
        }
        let mut vcpus = Vec::new();
        for id in 0..config.vcpus {
            vcpus.push(Vcpu::new(&vm, id, config.vcpus)?);
        }
        vm.restore(&snap.vm)?;
        for (v, st) in vcpus.iter().zip(&snap.vcpus) {
            v.restore(st)?;
        }
        for t in &built.transports {
            t.lock().unwrap_or_else(|p| p.into_inner()).restored();
        }
        Self::finish(VmParts {
            started_at,
            config,
            ram,
            vm,
            devices: built,
            vcpus,
            api,
            paused: opts.start_paused,
            seccomp: opts.seccomp,
            overlay,
            restored_from: Some(opts.dir.clone()),
        })
    }

    /// Starts one thread per vCPU (each installs its seccomp filter first) and assembles the
    /// `Vmm`.
    fn finish(parts: VmParts) -> Result<Self, VmmError> {
        let VmParts {
            started_at,
            config,
            ram,
            vm,
            devices: built,
            vcpus,
            api,
            paused,
            seccomp,
            overlay,
            restored_from,
        } = parts;
        vcpu::install_kick_handler().map_err(ioe("installing the vCPU kick signal handler"))?;
        let exit = Arc::new(VmExit::new().map_err(ioe("eventfd"))?);
        let first_run = Arc::new(Mutex::new(None));
        let pio = Arc::new(built.pio);
        let mmio = Arc::new(built.mmio);
        let vcpu_filter = if seccomp {
            Some(crate::seccomp::vcpu_filter().map_err(VmmError::Seccomp)?)
        } else {
            None
        };
        let mut handles = Vec::new();
        for v in vcpus {
            let ctx = VcpuRunCtx {
                pio: pio.clone(),
                mmio: mmio.clone(),
                exit: exit.clone(),
                first_run: first_run.clone(),
                seccomp: vcpu_filter.clone(),
            };
            handles.push(VcpuHandle::spawn(v, ctx, paused).map_err(ioe("spawning a vCPU thread"))?);
        }
        let setup_ms = started_at.elapsed().as_secs_f64() * 1e3;
        Ok(Vmm {
            started_at,
            config,
            ram,
            vm,
            serial: built.serial,
            transports: built.transports,
            vcpus: handles,
            exit,
            reset_evt: built.reset_evt,
            paused,
            first_run,
            overlay,
            api,
            seccomp,
            restored_from,
            setup_ms,
        })
    }
}
