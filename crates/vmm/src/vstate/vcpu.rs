//! vCPUs: creation and boot setup (CPUID, MSRs, registers, LAPIC), one thread per vCPU running
//! KVM_RUN and dispatching port-I/O and MMIO exits to the device buses, pause/resume/save control.

use std::sync::mpsc::{Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvm_bindings::{
    kvm_debugregs, kvm_fpu, kvm_lapic_state, kvm_mp_state, kvm_msr_entry, kvm_regs, kvm_sregs,
    kvm_vcpu_events, kvm_xcrs, kvm_xsave, Msrs, KVM_MAX_CPUID_ENTRIES,
};
use kvm_ioctls::{VcpuExit, VcpuFd};
use serde::{Deserialize, Serialize};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use crate::arch::{cpuid, regs};
use crate::devices::bus::Bus;
use crate::vstate::vm::{Vm, VmError};

/// MSRs set at boot and saved in snapshots (those the host KVM can read are kept).
const MSRS: &[u32] = &[
    0x174,       // IA32_SYSENTER_CS
    0x175,       // IA32_SYSENTER_ESP
    0x176,       // IA32_SYSENTER_EIP
    0xc000_0081, // STAR
    0xc000_0082, // LSTAR
    0xc000_0083, // CSTAR
    0xc000_0084, // SYSCALL_MASK
    0xc000_0102, // KERNEL_GS_BASE
    0x10,        // TSC
    0x1a0,       // IA32_MISC_ENABLE
    0x277,       // PAT
    0x4b56_4d00, // KVM wall clock (new)
    0x4b56_4d01, // KVM system time (new)
    0x4b56_4d02, // KVM async PF
    0x4b56_4d03, // KVM steal time
    0x4b56_4d04, // KVM PV EOI
];

#[derive(Debug, thiserror::Error)]
pub enum VcpuError {
    #[error("vCPU {id}: KVM_{op} failed: {err}")]
    Ioctl {
        id: u8,
        op: &'static str,
        err: kvm_ioctls::Error,
    },
    #[error("vCPU {0}: boot setup failed: {1}")]
    Setup(u8, String),
    #[error(transparent)]
    Vm(#[from] VmError),
}

/// FPU/SSE state (serializable mirror of `kvm_fpu`).
#[derive(Clone, Serialize, Deserialize)]
pub struct FpuState {
    pub fpr: [[u8; 16]; 8],
    pub fcw: u16,
    pub fsw: u16,
    pub ftwx: u8,
    pub last_opcode: u16,
    pub last_ip: u64,
    pub last_dp: u64,
    pub xmm: [[u8; 16]; 16],
    pub mxcsr: u32,
}

impl From<&kvm_fpu> for FpuState {
    fn from(f: &kvm_fpu) -> Self {
        FpuState {
            fpr: f.fpr,
            fcw: f.fcw,
            fsw: f.fsw,
            ftwx: f.ftwx,
            last_opcode: f.last_opcode,
            last_ip: f.last_ip,
            last_dp: f.last_dp,
            xmm: f.xmm,
            mxcsr: f.mxcsr,
        }
    }
}

impl From<&FpuState> for kvm_fpu {
    fn from(f: &FpuState) -> Self {
        kvm_fpu {
            fpr: f.fpr,
            fcw: f.fcw,
            fsw: f.fsw,
            ftwx: f.ftwx,
            last_opcode: f.last_opcode,
            last_ip: f.last_ip,
            last_dp: f.last_dp,
            xmm: f.xmm,
            mxcsr: f.mxcsr,
            ..Default::default()
        }
    }
}

/// Saved state of one vCPU.
#[derive(Serialize, Deserialize)]
pub struct VcpuState {
    pub id: u8,
    pub regs: kvm_regs,
    pub sregs: kvm_sregs,
    pub fpu: FpuState,
    pub xsave: Option<kvm_xsave>,
    pub xcrs: Option<kvm_xcrs>,
    pub debugregs: Option<kvm_debugregs>,
    pub lapic: kvm_lapic_state,
    pub msrs: Vec<(u32, u64)>,
    pub events: kvm_vcpu_events,
    pub mp_state: kvm_mp_state,
}

pub struct Vcpu {
    pub id: u8,
    pub fd: VcpuFd,
    /// MSR indexes this host lets us read (subset of [`MSRS`]).
    msr_list: Vec<u32>,
}

fn e(id: u8, op: &'static str) -> impl Fn(kvm_ioctls::Error) -> VcpuError {
    move |err| VcpuError::Ioctl { id, op, err }
}

impl Vcpu {
    /// Creates vCPU `id` with CPUID configured.
    pub fn new(vm: &Vm, id: u8, count: u8) -> Result<Self, VcpuError> {
        let fd = vm
            .fd
            .create_vcpu(u64::from(id))
            .map_err(e(id, "CREATE_VCPU"))?;
        let mut cpuid = vm
            .kvm
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(e(id, "GET_SUPPORTED_CPUID"))?;
        cpuid::patch(&mut cpuid, id, count);
        fd.set_cpuid2(&cpuid).map_err(e(id, "SET_CPUID2"))?;
        let mut msr_list = Vec::new();
        for &idx in MSRS {
            let mut m = Msrs::from_entries(&[kvm_msr_entry {
                index: idx,
                ..Default::default()
            }])
            .map_err(|_| VcpuError::Setup(id, "MSR list".into()))?;
            if fd.get_msrs(&mut m).unwrap_or(0) == 1 {
                msr_list.push(idx);
            }
        }
        Ok(Vcpu { id, fd, msr_list })
    }

    /// Boot state for the BSP: registers for the entry protocol, FPU, boot MSRs, LAPIC LINTs.
    pub fn setup_boot(
        &self,
        mem: &GuestMemoryMmap,
        entry: regs::BootEntry,
    ) -> Result<(), VcpuError> {
        let id = self.id;
        self.setup_lapic()?;
        let boot_msrs: Vec<kvm_msr_entry> = self
            .msr_list
            .iter()
            .filter(|&&i| i < 0x4b56_4d00)
            .map(|&index| kvm_msr_entry {
                index,
                data: if index == 0x1a0 {
                    1
                } else if index == 0x277 {
                    0x0007_0406_0007_0406
                } else {
                    0
                },
                ..Default::default()
            })
            .collect();
        let m =
            Msrs::from_entries(&boot_msrs).map_err(|_| VcpuError::Setup(id, "MSR list".into()))?;
        self.fd.set_msrs(&m).map_err(e(id, "SET_MSRS"))?;
        let mut sregs = self.fd.get_sregs().map_err(e(id, "GET_SREGS"))?;
        regs::setup_sregs(mem, entry, &mut sregs)
            .map_err(|err| VcpuError::Setup(id, err.to_string()))?;
        self.fd.set_sregs(&sregs).map_err(e(id, "SET_SREGS"))?;
        self.fd
            .set_regs(&regs::boot_regs(entry))
            .map_err(e(id, "SET_REGS"))?;
        self.fd
            .set_fpu(&regs::boot_fpu())
            .map_err(e(id, "SET_FPU"))?;
        Ok(())
    }

    /// Application processors wait for INIT/SIPI; only their LAPIC needs the LINT setup.
    pub fn setup_lapic(&self) -> Result<(), VcpuError> {
        let id = self.id;
        let mut lapic = self.fd.get_lapic().map_err(e(id, "GET_LAPIC"))?;
        // LVT LINT0 (0x350): ExtINT; LVT LINT1 (0x360): NMI.
        set_lapic_reg(&mut lapic, 0x350, |v| (v & !0x700) | (7 << 8));
        set_lapic_reg(&mut lapic, 0x360, |v| (v & !0x700) | (4 << 8));
        self.fd.set_lapic(&lapic).map_err(e(id, "SET_LAPIC"))?;
        Ok(())
    }

    pub fn save(&self) -> Result<VcpuState, VcpuError> {
        let id = self.id;
        let mp_state = self.fd.get_mp_state().map_err(e(id, "GET_MP_STATE"))?;
        let regs = self.fd.get_regs().map_err(e(id, "GET_REGS"))?;
        let sregs = self.fd.get_sregs().map_err(e(id, "GET_SREGS"))?;
        let fpu = FpuState::from(&self.fd.get_fpu().map_err(e(id, "GET_FPU"))?);
        let xsave = self.fd.get_xsave().ok();
        let xcrs = self.fd.get_xcrs().ok();
        let debugregs = self.fd.get_debug_regs().ok();
        let lapic = self.fd.get_lapic().map_err(e(id, "GET_LAPIC"))?;
        let entries: Vec<kvm_msr_entry> = self
            .msr_list
            .iter()
            .map(|&index| kvm_msr_entry {
                index,
                ..Default::default()
            })
            .collect();
        let mut m =
            Msrs::from_entries(&entries).map_err(|_| VcpuError::Setup(id, "MSR list".into()))?;
        let n = self.fd.get_msrs(&mut m).map_err(e(id, "GET_MSRS"))?;
        let msrs = m.as_slice()[..n]
            .iter()
            .map(|m| (m.index, m.data))
            .collect();
        let events = self
            .fd
            .get_vcpu_events()
            .map_err(e(id, "GET_VCPU_EVENTS"))?;
        Ok(VcpuState {
            id,
            regs,
            sregs,
            fpu,
            xsave,
            xcrs,
            debugregs,
            lapic,
            msrs,
            events,
            mp_state,
        })
    }

    pub fn restore(&self, st: &VcpuState) -> Result<(), VcpuError> {
        let id = self.id;
        self.fd
            .set_mp_state(st.mp_state)
            .map_err(e(id, "SET_MP_STATE"))?;
        self.fd.set_sregs(&st.sregs).map_err(e(id, "SET_SREGS"))?;
        self.fd.set_regs(&st.regs).map_err(e(id, "SET_REGS"))?;
        self.fd
            .set_fpu(&kvm_fpu::from(&st.fpu))
            .map_err(e(id, "SET_FPU"))?;
        if let Some(x) = &st.xsave {
            // SAFETY: `x` is a complete kvm_xsave (legacy 4 KiB layout) read by KVM_GET_XSAVE.
            if let Err(err) = unsafe { self.fd.set_xsave(x) } {
                tracing::warn!(vcpu = id, %err, "KVM_SET_XSAVE failed; FPU state from KVM_SET_FPU is used");
            }
        }
        if let Some(x) = &st.xcrs {
            let _ = self.fd.set_xcrs(x);
        }
        if let Some(d) = &st.debugregs {
            let _ = self.fd.set_debug_regs(d);
        }
        self.fd.set_lapic(&st.lapic).map_err(e(id, "SET_LAPIC"))?;
        let entries: Vec<kvm_msr_entry> = st
            .msrs
            .iter()
            .map(|&(index, data)| kvm_msr_entry {
                index,
                data,
                ..Default::default()
            })
            .collect();
        let m =
            Msrs::from_entries(&entries).map_err(|_| VcpuError::Setup(id, "MSR list".into()))?;
        self.fd.set_msrs(&m).map_err(e(id, "SET_MSRS"))?;
        self.fd
            .set_vcpu_events(&st.events)
            .map_err(e(id, "SET_VCPU_EVENTS"))?;
        Ok(())
    }
}

fn set_lapic_reg(l: &mut kvm_lapic_state, off: usize, f: impl Fn(u32) -> u32) {
    let b: Vec<u8> = l.regs[off..off + 4].iter().map(|&c| c as u8).collect();
    let v = f(u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    for (i, x) in v.to_le_bytes().iter().enumerate() {
        l.regs[off + i] = *x as _;
    }
}

// ---------------------------------------------------------------------------------------------
// vCPU threads

pub enum VcpuCmd {
    Pause,
    Resume,
    Save,
    Exit,
}

pub enum VcpuReply {
    Paused,
    Saved(Box<Result<VcpuState, String>>),
}

/// Why the VM ended (first reason wins).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum ExitReason {
    /// Guest reset through the i8042 controller or a KVM system event.
    GuestReset,
    /// Triple fault / shutdown.
    GuestShutdown,
    /// Stopped through the API.
    Stopped,
    /// A vCPU hit an error KVM could not handle.
    Error(String),
}

pub struct VmExit {
    pub evt: EventFd,
    pub reason: Mutex<Option<ExitReason>>,
}

impl VmExit {
    pub fn new() -> std::io::Result<Self> {
        Ok(VmExit {
            evt: EventFd::new(libc::EFD_NONBLOCK)?,
            reason: Mutex::new(None),
        })
    }
    pub fn exit(&self, r: ExitReason) {
        let mut g = self.reason.lock().unwrap_or_else(|p| p.into_inner());
        if g.is_none() {
            *g = Some(r);
        }
        let _ = self.evt.write(1);
    }
}

pub struct VcpuHandle {
    pub id: u8,
    tx: Sender<VcpuCmd>,
    rx: Receiver<VcpuReply>,
    thread: Option<JoinHandle<()>>,
}

/// Signal used to kick vCPU threads out of KVM_RUN.
pub fn kick_signal() -> i32 {
    libc::SIGRTMIN()
}

extern "C" fn noop_handler(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

/// Installs the (empty) kick signal handler; KVM_RUN then returns EINTR on a kick.
pub fn install_kick_handler() -> std::io::Result<()> {
    vmm_sys_util::signal::register_signal_handler(kick_signal(), noop_handler)
        .map_err(|e| std::io::Error::from_raw_os_error(e.errno()))
}

pub struct VcpuRunCtx {
    pub pio: Arc<Bus>,
    pub mmio: Arc<Bus>,
    pub exit: Arc<VmExit>,
    pub first_run: Arc<Mutex<Option<Instant>>>,
    pub seccomp: Option<seccompiler::BpfProgram>,
}

impl VcpuHandle {
    /// Starts the vCPU's thread and returns once the thread has installed its seccomp filter,
    /// so no thread of a running VMM is ever unfiltered (the stats' `seccomp: true` holds for
    /// every thread the moment the API answers).
    pub fn spawn(vcpu: Vcpu, ctx: VcpuRunCtx, paused: bool) -> std::io::Result<Self> {
        let (tx, crx) = std::sync::mpsc::channel();
        let (ctx_tx, rx) = std::sync::mpsc::channel();
        let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
        let id = vcpu.id;
        let thread = std::thread::Builder::new()
            .name(format!("vcpu{id}"))
            .spawn(move || vcpu_loop(vcpu, ctx, crx, ctx_tx, ready_tx, paused))?;
        match ready_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(msg)) => return Err(std::io::Error::other(msg)),
            Err(_) => {
                return Err(std::io::Error::other(format!(
                    "vCPU {id}: the thread ended before it was ready"
                )))
            }
        }
        Ok(VcpuHandle {
            id,
            tx,
            rx,
            thread: Some(thread),
        })
    }

    fn kick(&self) {
        if let Some(t) = &self.thread {
            use std::os::unix::thread::JoinHandleExt;
            // SAFETY: the pthread handle belongs to a thread we own and have not joined.
            unsafe { libc::pthread_kill(t.as_pthread_t(), kick_signal()) };
        }
    }

    /// Sends `cmd` and waits for a reply, kicking the thread out of KVM_RUN until it answers.
    pub fn request(&self, cmd: VcpuCmd, timeout: Duration) -> Option<VcpuReply> {
        self.tx.send(cmd).ok()?;
        let deadline = Instant::now() + timeout;
        loop {
            self.kick();
            match self.rx.recv_timeout(Duration::from_millis(5)) {
                Ok(r) => return Some(r),
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) if Instant::now() < deadline => {
                    continue
                }
                Err(_) => return None,
            }
        }
    }

    pub fn send(&self, cmd: VcpuCmd) {
        let _ = self.tx.send(cmd);
    }

    pub fn stop(&mut self) {
        let _ = self.tx.send(VcpuCmd::Exit);
        if let Some(t) = self.thread.take() {
            let deadline = Instant::now() + Duration::from_secs(5);
            while !t.is_finished() && Instant::now() < deadline {
                use std::os::unix::thread::JoinHandleExt;
                // SAFETY: the thread is alive and not joined yet.
                unsafe { libc::pthread_kill(t.as_pthread_t(), kick_signal()) };
                std::thread::sleep(Duration::from_millis(2));
            }
            if t.is_finished() {
                let _ = t.join();
            }
        }
    }
}

fn vcpu_loop(
    mut vcpu: Vcpu,
    ctx: VcpuRunCtx,
    rx: Receiver<VcpuCmd>,
    tx: Sender<VcpuReply>,
    ready: std::sync::mpsc::SyncSender<Result<(), String>>,
    mut paused: bool,
) {
    if let Some(p) = &ctx.seccomp {
        if let Err(err) = seccompiler::apply_filter(p) {
            let msg = format!("vCPU {}: installing seccomp filter failed: {err}", vcpu.id);
            let _ = ready.send(Err(msg));
            return;
        }
    }
    // The spawner waits for this; it holds the only receiver, so the send cannot block.
    let _ = ready.send(Ok(()));
    drop(ready);
    let mut ran = false;
    loop {
        // Commands first; block while paused.
        loop {
            let cmd = if paused {
                match rx.recv() {
                    Ok(c) => c,
                    Err(_) => return,
                }
            } else {
                match rx.try_recv() {
                    Ok(c) => c,
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => return,
                }
            };
            match cmd {
                VcpuCmd::Pause => {
                    paused = true;
                    let _ = tx.send(VcpuReply::Paused);
                }
                VcpuCmd::Resume => paused = false,
                VcpuCmd::Save => {
                    // An exit handled just before the pause (port I/O, MMIO) is only completed by
                    // the next KVM_RUN: enter once with immediate_exit so the saved registers are
                    // past that instruction and nothing runs twice after restore.
                    if ran {
                        vcpu.fd.set_kvm_immediate_exit(1);
                        let _ = vcpu.fd.run();
                        vcpu.fd.set_kvm_immediate_exit(0);
                    }
                    let st = vcpu.save().map_err(|e| e.to_string());
                    let _ = tx.send(VcpuReply::Saved(Box::new(st)));
                }
                VcpuCmd::Exit => return,
            }
        }
        if !ran {
            ran = true;
            let mut f = ctx.first_run.lock().unwrap_or_else(|p| p.into_inner());
            if f.is_none() {
                *f = Some(Instant::now());
            }
        }
        match vcpu.fd.run() {
            Ok(exit) => match exit {
                VcpuExit::IoIn(port, data) => {
                    ctx.pio.read(u64::from(port), data);
                }
                VcpuExit::IoOut(port, data) => {
                    ctx.pio.write(u64::from(port), data);
                }
                VcpuExit::MmioRead(addr, data) => {
                    ctx.mmio.read(addr, data);
                }
                VcpuExit::MmioWrite(addr, data) => {
                    ctx.mmio.write(addr, data);
                }
                VcpuExit::Hlt => {
                    // With the in-kernel LAPIC a HLT is handled by KVM; seeing it here means
                    // the guest stopped for good.
                    ctx.exit.exit(ExitReason::GuestShutdown);
                    paused = true;
                }
                VcpuExit::Shutdown => {
                    if let (Ok(r), Ok(s)) = (vcpu.fd.get_regs(), vcpu.fd.get_sregs()) {
                        tracing::warn!(
                            vcpu = vcpu.id,
                            rip = r.rip,
                            cr0 = s.cr0,
                            efer = s.efer,
                            "guest shutdown (triple fault)"
                        );
                    }
                    ctx.exit.exit(ExitReason::GuestShutdown);
                    paused = true;
                }
                VcpuExit::SystemEvent(kind, _) => {
                    ctx.exit
                        .exit(if kind == kvm_bindings::KVM_SYSTEM_EVENT_RESET {
                            ExitReason::GuestReset
                        } else {
                            ExitReason::GuestShutdown
                        });
                    paused = true;
                }
                VcpuExit::FailEntry(reason, cpu) => {
                    ctx.exit.exit(ExitReason::Error(format!(
                        "vCPU {}: KVM entry failed (hardware reason {reason:#x}, cpu {cpu})",
                        vcpu.id
                    )));
                    paused = true;
                }
                VcpuExit::InternalError => {
                    ctx.exit.exit(ExitReason::Error(format!(
                        "vCPU {}: KVM internal error (emulation failure at guest rip {:#x})",
                        vcpu.id,
                        vcpu.fd.get_regs().map(|r| r.rip).unwrap_or(0)
                    )));
                    paused = true;
                }
                other => {
                    tracing::debug!(vcpu = vcpu.id, exit = ?other, "unhandled vCPU exit ignored");
                }
            },
            Err(err) if err.errno() == libc::EINTR || err.errno() == libc::EAGAIN => {
                vcpu.fd.set_kvm_immediate_exit(0);
            }
            Err(err) => {
                ctx.exit.exit(ExitReason::Error(format!(
                    "vCPU {}: KVM_RUN failed: {err}",
                    vcpu.id
                )));
                paused = true;
            }
        }
    }
}
