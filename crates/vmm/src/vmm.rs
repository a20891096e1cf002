//! The VMM: builds a VM (fresh boot or snapshot restore), then runs the event loop that serves
//! device queue notifications, device host sockets and the control API until the VM ends.

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vm_memory::GuestMemoryMmap;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use crate::api::{ApiRequest, ApiServer};
use crate::arch::layout::{IRQ_BASE, MMIO_BASE, MMIO_DEV_SIZE};
use crate::arch::mptable;
use crate::config::VmConfig;
use crate::devices::bus::Bus;
use crate::devices::legacy::i8042::{I8042, I8042_LEN, I8042_PORT};
use crate::devices::legacy::serial::{SerialDevice, SerialOut, COM1_IRQ, COM1_PORT};
use crate::devices::virtio::block::{Block, CowDisk};
use crate::devices::virtio::mmio::MmioTransport;
use crate::devices::virtio::rng::Rng;
use crate::devices::virtio::vsock::Vsock;
use crate::devices::virtio::{Interrupt, VirtioDevice};
use crate::devices::IrqLine;
use crate::memory::GuestRam;
use crate::snapshot::{self, DevicePersist, Snapshot};
use crate::vstate::vcpu::{
    self, ExitReason, Vcpu, VcpuCmd, VcpuHandle, VcpuReply, VcpuRunCtx, VmExit,
};
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

fn ioe(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> VmmError {
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

fn serial_sink(path: &Option<PathBuf>) -> Result<SerialOut, VmmError> {
    Ok(match path {
        Some(p) => {
            Box::new(File::create(p).map_err(ioe(format!("serial output {}", p.display())))?)
        }
        None => Box::new(std::io::stdout()),
    })
}

struct Built {
    pio: Bus,
    mmio: Bus,
    serial: Arc<Mutex<SerialDevice>>,
    transports: Vec<Arc<Mutex<MmioTransport>>>,
    reset_evt: EventFd,
    cmdline_devices: String,
}

/// Creates the devices of `config` (legacy + virtio) and wires them to KVM.
fn build_devices(
    vm: &Vm,
    mem: &GuestMemoryMmap,
    config: &VmConfig,
    serial: impl FnOnce(IrqLine) -> SerialDevice,
) -> Result<Built, VmmError> {
    let mut pio = Bus::default();
    let mut mmio = Bus::default();
    let com1 = IrqLine::new(COM1_IRQ).map_err(ioe("eventfd"))?;
    vm.register_irqfd(&com1.evt, COM1_IRQ)?;
    let serial = Arc::new(Mutex::new(serial(com1)));
    pio.insert(COM1_PORT, 8, serial.clone())
        .map_err(|e| VmmError::Config(e.to_string()))?;
    let reset_evt = EventFd::new(libc::EFD_NONBLOCK).map_err(ioe("eventfd"))?;
    let i8042 = Arc::new(Mutex::new(I8042::new(
        reset_evt.try_clone().map_err(ioe("eventfd"))?,
    )));
    pio.insert(I8042_PORT, I8042_LEN, i8042)
        .map_err(|e| VmmError::Config(e.to_string()))?;

    let mut devs: Vec<Box<dyn VirtioDevice>> = Vec::new();
    if let Some(d) = &config.disk {
        let disk = CowDisk::open(&d.base, d.overlay.as_deref(), d.read_only)?;
        devs.push(Box::new(Block::new(disk, "kiln-disk0")));
    }
    if let Some(v) = &config.vsock {
        devs.push(Box::new(
            Vsock::new(v.cid, &v.uds).map_err(ioe(format!("vsock socket {}", v.uds.display())))?,
        ));
    }
    if config.rng {
        devs.push(Box::new(Rng::default()));
    }
    let shared = Arc::new(mem.clone());
    let mut transports = Vec::new();
    let mut cmdline_devices = String::new();
    for (i, dev) in devs.into_iter().enumerate() {
        let base = MMIO_BASE + i as u64 * MMIO_DEV_SIZE;
        let irq = IRQ_BASE + i as u32;
        let line = IrqLine::new(irq).map_err(ioe("eventfd"))?;
        vm.register_irqfd(&line.evt, irq)?;
        let t = MmioTransport::new(dev, shared.clone(), Interrupt { line, status: 0 })
            .map_err(ioe("eventfd"))?;
        for (q, evt) in t.queue_evts.iter().enumerate() {
            vm.register_ioevent(evt, base + 0x50, q as u32)?;
        }
        let t = Arc::new(Mutex::new(t));
        mmio.insert(base, MMIO_DEV_SIZE, t.clone())
            .map_err(|e| VmmError::Config(e.to_string()))?;
        transports.push(t);
        cmdline_devices.push_str(&format!(" virtio_mmio.device=4K@{base:#x}:{irq}"));
    }
    Ok(Built {
        pio,
        mmio,
        serial,
        transports,
        reset_evt,
        cmdline_devices,
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
        Self::finish(
            started_at,
            config,
            ram,
            vm,
            built,
            vcpus,
            api,
            opts.start_paused,
            opts.seccomp,
            overlay,
            None,
        )
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
        Self::finish(
            started_at,
            config,
            ram,
            vm,
            built,
            vcpus,
            api,
            opts.start_paused,
            opts.seccomp,
            overlay,
            Some(opts.dir.clone()),
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn finish(
        started_at: Instant,
        config: VmConfig,
        ram: GuestRam,
        vm: Vm,
        built: Built,
        vcpus: Vec<Vcpu>,
        api: Option<ApiServer>,
        paused: bool,
        seccomp: bool,
        overlay: Option<PathBuf>,
        restored_from: Option<PathBuf>,
    ) -> Result<Self, VmmError> {
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

    /// Takes a snapshot into `dir` (created if missing). The VM is paused while the state and
    /// memory are written and resumed afterwards if it was running and `resume` is true.
    pub fn snapshot(&mut self, dir: &Path, resume: bool) -> Result<serde_json::Value, String> {
        let t0 = Instant::now();
        let was_running = !self.paused;
        if was_running {
            self.pause_all()?;
        }
        let res = self.snapshot_paused(dir);
        let pause_ms = t0.elapsed().as_secs_f64() * 1e3;
        if was_running && resume {
            self.resume_all();
        }
        let (mem_written, state_ms) = res?;
        Ok(serde_json::json!({
            "dir": dir,
            "snapshot_ms": pause_ms,
            "state_ms": state_ms,
            "memory_bytes_written": mem_written,
            "resumed": was_running && resume,
        }))
    }

    fn snapshot_paused(&mut self, dir: &Path) -> Result<(u64, f64), String> {
        let t0 = Instant::now();
        std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        // This VM's RAM is mapped from the snapshot it was restored from: overwriting that file
        // would corrupt this VM and every other fork of it.
        if let Some(src) = &self.restored_from {
            let same = match (std::fs::canonicalize(src), std::fs::canonicalize(dir)) {
                (Ok(a), Ok(b)) => a == b,
                _ => false,
            };
            if same {
                return Err(format!(
                    "{} is the snapshot this VM was restored from; write the new snapshot elsewhere",
                    dir.display()
                ));
            }
        }
        let mut vcpus = Vec::new();
        for v in &self.vcpus {
            match v.request(VcpuCmd::Save, Duration::from_secs(10)) {
                Some(VcpuReply::Saved(st)) => vcpus.push((*st)?),
                _ => return Err(format!("vCPU {} did not save its state", v.id)),
            }
        }
        let vm = self.vm.save().map_err(|e| e.to_string())?;
        let serial = self.serial.lock().unwrap_or_else(|p| p.into_inner()).save();
        let devices = self
            .transports
            .iter()
            .map(|t| {
                let t = t.lock().unwrap_or_else(|p| p.into_inner());
                DevicePersist {
                    device_type: t.device.device_type(),
                    transport: t.save(),
                    state: t.device.save(),
                }
            })
            .collect();
        let state_ms = t0.elapsed().as_secs_f64() * 1e3;
        let written = self
            .ram
            .dump(&dir.join(snapshot::MEMORY_FILE))
            .map_err(|e| e.to_string())?;
        if let Some(ov) = &self.overlay {
            snapshot::sparse_copy(ov, &dir.join(snapshot::OVERLAY_FILE))
                .map_err(|e| format!("copying the overlay: {e}"))?;
        }
        let snap = Snapshot {
            vmm_version: env!("CARGO_PKG_VERSION").to_string(),
            config: self.config.clone(),
            mem_size: self.ram.size,
            vm,
            vcpus,
            serial,
            devices,
        };
        snapshot::write_state(dir, &snap).map_err(|e| e.to_string())?;
        Ok((written, state_ms))
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

    fn handle_api(&mut self, req: ApiRequest) -> (serde_json::Value, bool) {
        let ok = |v: serde_json::Value| {
            let mut v = v;
            if let Some(o) = v.as_object_mut() {
                o.insert("ok".into(), true.into());
            }
            v
        };
        let err = |e: String| serde_json::json!({"ok": false, "error": e});
        match req {
            ApiRequest::Start | ApiRequest::Resume => {
                if self.paused {
                    self.resume_all();
                }
                (ok(serde_json::json!({"state": "running"})), false)
            }
            ApiRequest::Pause => match self.pause_all() {
                Ok(()) => (ok(serde_json::json!({"state": "paused"})), false),
                Err(e) => (err(e), false),
            },
            ApiRequest::Snapshot { dir, resume } => {
                match self.snapshot(&dir, resume.unwrap_or(true)) {
                    Ok(v) => (ok(v), false),
                    Err(e) => (err(format!("snapshot failed: {e}")), false),
                }
            }
            ApiRequest::Stats => (ok(self.stats()), false),
            ApiRequest::Stop => (ok(serde_json::json!({"state": "stopped"})), true),
        }
    }

    /// Runs the event loop until the VM ends; returns why it ended.
    pub fn run(mut self) -> Result<ExitReason, VmmError> {
        const T_EXIT: u64 = 1;
        const T_RESET: u64 = 2;
        const T_API: u64 = 3;
        const T_CONN: u64 = 1 << 40;
        const T_QUEUE: u64 = 2 << 40;
        const T_HOST: u64 = 3 << 40;
        let epoll = Epoll::new().map_err(ioe("epoll"))?;
        let add = |fd: i32, tok: u64| {
            epoll
                .ctl(
                    ControlOperation::Add,
                    fd,
                    EpollEvent::new(EventSet::IN, tok),
                )
                .map_err(ioe("epoll_ctl"))
        };
        add(self.exit.evt.as_raw_fd(), T_EXIT)?;
        add(self.reset_evt.as_raw_fd(), T_RESET)?;
        if let Some(api) = &self.api {
            add(api.listener.as_raw_fd(), T_API)?;
        }
        for (d, t) in self.transports.iter().enumerate() {
            let t = t.lock().unwrap_or_else(|p| p.into_inner());
            for (q, evt) in t.queue_evts.iter().enumerate() {
                add(evt.as_raw_fd(), T_QUEUE | (d as u64) << 16 | q as u64)?;
            }
            if let Some(fd) = t.device.host_fd() {
                add(fd, T_HOST | d as u64)?;
            }
        }
        if self.seccomp {
            let f = crate::seccomp::vmm_filter().map_err(VmmError::Seccomp)?;
            seccompiler::apply_filter(&f).map_err(|e| VmmError::Seccomp(e.to_string()))?;
        }
        let mut conns: HashMap<u64, crate::api::ApiConn> = HashMap::new();
        let mut next_conn = 0u64;
        let mut events = vec![EpollEvent::default(); 64];
        let reason = 'outer: loop {
            let n = match epoll.wait(-1, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    return Err(VmmError::Io {
                        what: "epoll_wait".into(),
                        err: e,
                    })
                }
            };
            for ev in events.iter().take(n) {
                let tok = ev.data();
                match tok {
                    T_EXIT => {
                        let r = self
                            .exit
                            .reason
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .clone();
                        break 'outer r.unwrap_or(ExitReason::GuestShutdown);
                    }
                    T_RESET => break 'outer ExitReason::GuestReset,
                    T_API => {
                        if let Some(api) = &self.api {
                            while let Some(c) = api.accept() {
                                let tok = T_CONN | next_conn;
                                next_conn += 1;
                                if add(c.stream.as_raw_fd(), tok).is_ok() {
                                    conns.insert(tok, c);
                                }
                            }
                        }
                    }
                    t if t & (0xff << 40) == T_CONN => {
                        let Some(c) = conns.get_mut(&t) else { continue };
                        let (reqs, closed) = c.read_requests();
                        let mut stop = false;
                        for r in reqs {
                            let resp = match r {
                                Ok(req) => {
                                    let (resp, s) = self.handle_api(req);
                                    stop |= s;
                                    resp
                                }
                                Err(e) => serde_json::json!({"ok": false, "error": e}),
                            };
                            if let Some(c) = conns.get_mut(&t) {
                                c.respond(&resp);
                            }
                        }
                        if closed {
                            if let Some(c) = conns.remove(&t) {
                                let _ = epoll.ctl(
                                    ControlOperation::Delete,
                                    c.stream.as_raw_fd(),
                                    EpollEvent::default(),
                                );
                            }
                        }
                        if stop {
                            break 'outer ExitReason::Stopped;
                        }
                    }
                    t if t & (0xff << 40) == T_QUEUE => {
                        let d = ((t >> 16) & 0xffff) as usize;
                        let q = (t & 0xffff) as usize;
                        if let Some(tr) = self.transports.get(d) {
                            tr.lock().unwrap_or_else(|p| p.into_inner()).queue_event(q);
                        }
                    }
                    t if t & (0xff << 40) == T_HOST => {
                        let d = (t & 0xffff) as usize;
                        if let Some(tr) = self.transports.get(d) {
                            tr.lock().unwrap_or_else(|p| p.into_inner()).host_event();
                        }
                    }
                    _ => {}
                }
            }
        };
        for v in self.vcpus.iter_mut() {
            v.stop();
        }
        let _ = std::io::stdout().flush();
        Ok(reason)
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
