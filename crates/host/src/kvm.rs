//! KVM speed probe: does this host run guest *kernel* code at hardware speed?
//!
//! Some hosts expose `/dev/kvm` through a software nested hypervisor (for example PVM), where
//! guest user mode runs natively but guest kernel mode is emulated roughly a thousand times
//! slower. A Linux guest cannot boot in practice there, so kiln must not pick the microVM driver.
//!
//! The probe builds a tiny 64-bit VM (identity-mapped page tables, a flat GDT, no firmware and no
//! kernel), then runs the same counted loop (`dec rcx; jnz`) twice: once with the vCPU in ring 0
//! and once in ring 3 (with IOPL=3 so the closing `out` still exits to the host). Each run grows
//! its loop count until it lasts long enough to time, and reports instructions per second.

use std::time::{Duration, Instant};

use kvm_bindings::{kvm_segment, kvm_userspace_memory_region, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd};
use serde::Serialize;

/// Guest kernel mode at or above this many instructions per second counts as hardware speed.
pub const HARDWARE_SPEED_IPS: f64 = 100e6;

const MEM_SIZE: usize = 4 << 20;
const PML4: u64 = 0x1000;
const PDPT: u64 = 0x2000;
const PD: u64 = 0x3000;
const GDT: u64 = 0x500;
const CODE: u64 = 0x10000;
const STACK_TOP: u64 = 0x80000;
const EXIT_PORT: u16 = 0x10;
/// `dec rcx; jnz -5; out 0x10, al; jmp $`
const LOOP_CODE: [u8; 9] = [0x48, 0xff, 0xc9, 0x75, 0xfb, 0xe6, 0x10, 0xeb, 0xfe];

/// What the probe measured.
#[derive(Debug, Clone, Serialize)]
pub struct KvmProbe {
    /// Guest instructions per second with the vCPU in ring 0.
    pub kernel_ips: f64,
    /// Guest instructions per second with the vCPU in ring 3.
    pub user_ips: f64,
    /// Loop instructions each measurement finally ran.
    pub kernel_instructions: u64,
    pub user_instructions: u64,
}

impl KvmProbe {
    /// True when guest kernel code runs fast enough to boot and run Linux.
    pub fn hardware_speed(&self) -> bool {
        self.kernel_ips >= HARDWARE_SPEED_IPS
    }

    /// One line explaining the verdict, with the measured rates.
    pub fn verdict(&self) -> String {
        let speed = if self.hardware_speed() {
            "hardware speed"
        } else {
            "emulated (far below hardware speed)"
        };
        format!(
            "guest kernel mode {} ({:.1} M instr/s), guest user mode {:.1} M instr/s",
            speed,
            self.kernel_ips / 1e6,
            self.user_ips / 1e6
        )
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("/dev/kvm is not available: {0}")]
    NoKvm(kvm_ioctls::Error),
    #[error("KVM refused to {what}: {err}")]
    Kvm {
        what: &'static str,
        err: kvm_ioctls::Error,
    },
    #[error("could not allocate probe guest memory: {0}")]
    Memory(std::io::Error),
    #[error("the probe guest stopped unexpectedly in {mode} mode: {exit}")]
    UnexpectedExit { mode: &'static str, exit: String },
    #[error("the probe guest did not finish within {0:?}")]
    Timeout(Duration),
}

fn kvm_err(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> ProbeError {
    move |err| ProbeError::Kvm { what, err }
}

/// Guest memory mapped into this process; unmapped on drop.
struct GuestMem {
    ptr: *mut u8,
    len: usize,
}

impl GuestMem {
    fn new(len: usize) -> Result<Self, ProbeError> {
        // SAFETY: anonymous private mapping with no address hint; the result is checked below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(ProbeError::Memory(std::io::Error::last_os_error()));
        }
        Ok(GuestMem {
            ptr: ptr.cast(),
            len,
        })
    }

    fn write(&mut self, gpa: u64, bytes: &[u8]) {
        let start = gpa as usize;
        assert!(start + bytes.len() <= self.len, "probe layout out of range");
        // SAFETY: the range was bounds-checked against the mapping just above, and the mapping is
        // exclusively owned by this struct.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.ptr.add(start), bytes.len()) }
    }

    fn write_u64(&mut self, gpa: u64, v: u64) {
        self.write(gpa, &v.to_le_bytes());
    }
}

impl Drop for GuestMem {
    fn drop(&mut self) {
        // SAFETY: ptr/len are exactly the mapping created in `new`; the VM that used it is
        // dropped before this struct (field order in `ProbeVm`).
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}

struct ProbeVm {
    vcpu: VcpuFd,
    _vm: kvm_ioctls::VmFd,
    _mem: GuestMem,
}

fn segment(selector: u16, dpl: u8, code: bool) -> kvm_segment {
    kvm_segment {
        base: 0,
        limit: 0xffff_ffff,
        selector,
        type_: if code { 0xb } else { 0x3 },
        present: 1,
        dpl,
        db: if code { 0 } else { 1 },
        s: 1,
        l: if code { 1 } else { 0 },
        g: 1,
        avl: 0,
        unusable: 0,
        padding: 0,
    }
}

impl ProbeVm {
    fn new() -> Result<Self, ProbeError> {
        let kvm = Kvm::new().map_err(ProbeError::NoKvm)?;
        let vm = kvm.create_vm().map_err(kvm_err("create a VM"))?;
        let mut mem = GuestMem::new(MEM_SIZE)?;

        // Identity map the first 4 MiB with two 2 MiB pages, user-accessible.
        const FLAGS: u64 = 0x7; // present | writable | user
        mem.write_u64(PML4, PDPT | FLAGS);
        mem.write_u64(PDPT, PD | FLAGS);
        mem.write_u64(PD, FLAGS | 0x80);
        mem.write_u64(PD + 8, (2 << 20) | FLAGS | 0x80);
        // GDT: null, kernel code, kernel data, user data, user code.
        let gdt: [u64; 5] = [
            0,
            0x00af_9a00_0000_ffff,
            0x00cf_9200_0000_ffff,
            0x00cf_f200_0000_ffff,
            0x00af_fa00_0000_ffff,
        ];
        for (i, d) in gdt.iter().enumerate() {
            mem.write_u64(GDT + 8 * i as u64, *d);
        }
        mem.write(CODE, &LOOP_CODE);

        let region = kvm_userspace_memory_region {
            slot: 0,
            flags: 0,
            guest_phys_addr: 0,
            memory_size: MEM_SIZE as u64,
            userspace_addr: mem.ptr as u64,
        };
        // SAFETY: the region points at `mem`, which lives as long as the VM (both are owned by
        // the returned ProbeVm and the VM fd is dropped first).
        unsafe { vm.set_user_memory_region(region) }.map_err(kvm_err("map probe guest memory"))?;

        let vcpu = vm.create_vcpu(0).map_err(kvm_err("create a vCPU"))?;
        let cpuid = kvm
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(kvm_err("report supported CPUID"))?;
        vcpu.set_cpuid2(&cpuid).map_err(kvm_err("set CPUID"))?;
        Ok(ProbeVm {
            vcpu,
            _vm: vm,
            _mem: mem,
        })
    }

    /// Runs `iterations` loop iterations in ring `ring` and returns the elapsed time.
    fn run(&mut self, ring: u8, iterations: u64) -> Result<Duration, ProbeError> {
        let mut sregs = self.vcpu.get_sregs().map_err(kvm_err("read sregs"))?;
        let (cs, ds) = if ring == 0 {
            (segment(0x08, 0, true), segment(0x10, 0, false))
        } else {
            (segment(0x23, 3, true), segment(0x1b, 3, false))
        };
        sregs.cs = cs;
        sregs.ds = ds;
        sregs.es = ds;
        sregs.fs = ds;
        sregs.gs = ds;
        sregs.ss = ds;
        sregs.gdt.base = GDT;
        sregs.gdt.limit = 5 * 8 - 1;
        sregs.cr3 = PML4;
        sregs.cr4 = 0x20; // PAE
        sregs.cr0 = 0x8000_0011; // PG | ET | PE
        sregs.efer = 0x500; // LME | LMA
        self.vcpu.set_sregs(&sregs).map_err(kvm_err("set sregs"))?;

        let mut regs = self.vcpu.get_regs().map_err(kvm_err("read regs"))?;
        regs.rip = CODE;
        regs.rsp = STACK_TOP;
        regs.rcx = iterations.max(1);
        regs.rflags = 0x2 | 0x3000; // reserved bit 1, IOPL 3
        self.vcpu.set_regs(&regs).map_err(kvm_err("set regs"))?;

        let mode = if ring == 0 { "kernel" } else { "user" };
        let start = Instant::now();
        loop {
            match self.vcpu.run() {
                Ok(VcpuExit::IoOut(port, _)) if port == EXIT_PORT => return Ok(start.elapsed()),
                Ok(VcpuExit::Intr) => continue,
                Ok(other) => {
                    return Err(ProbeError::UnexpectedExit {
                        mode,
                        exit: format!("{other:?}"),
                    })
                }
                Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => continue,
                Err(err) => {
                    return Err(ProbeError::Kvm {
                        what: "run the probe vCPU",
                        err,
                    })
                }
            }
        }
    }

    /// Grows the loop until a run lasts at least `min` (or the count reaches `max_iter`), and
    /// returns (instructions per second, instructions).
    fn measure(
        &mut self,
        ring: u8,
        min: Duration,
        max_iter: u64,
    ) -> Result<(f64, u64), ProbeError> {
        let mut iterations: u64 = 2_000;
        loop {
            let took = self.run(ring, iterations)?;
            if took >= min || iterations >= max_iter {
                let instr = 2 * iterations + 1;
                return Ok((instr as f64 / took.as_secs_f64().max(1e-9), instr));
            }
            // Aim straight for the target duration, at most 100x per step.
            let scale = (min.as_secs_f64() / took.as_secs_f64().max(1e-6)).clamp(2.0, 100.0);
            iterations = ((iterations as f64) * scale * 1.2) as u64;
            iterations = iterations.min(max_iter);
        }
    }
}

/// Runs the probe; gives up after `budget` (an emulating hypervisor can be very slow).
pub fn probe_with_budget(budget: Duration) -> Result<KvmProbe, ProbeError> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("kvm-probe".into())
        .spawn(move || {
            let result = (|| {
                let mut vm = ProbeVm::new()?;
                let (user_ips, user_instructions) =
                    vm.measure(3, Duration::from_millis(50), 4_000_000_000)?;
                let (kernel_ips, kernel_instructions) =
                    vm.measure(0, Duration::from_millis(50), 4_000_000_000)?;
                Ok(KvmProbe {
                    kernel_ips,
                    user_ips,
                    kernel_instructions,
                    user_instructions,
                })
            })();
            let _ = tx.send(result);
        })
        .map_err(ProbeError::Memory)?;
    rx.recv_timeout(budget)
        .unwrap_or(Err(ProbeError::Timeout(budget)))
}

/// Runs the probe with a 10 s budget.
pub fn probe() -> Result<KvmProbe, ProbeError> {
    probe_with_budget(Duration::from_secs(10))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdict_follows_threshold() {
        let slow = KvmProbe {
            kernel_ips: 1e6,
            user_ips: 2e9,
            kernel_instructions: 1,
            user_instructions: 1,
        };
        assert!(!slow.hardware_speed());
        assert!(slow.verdict().contains("emulated"), "{}", slow.verdict());
        let fast = KvmProbe {
            kernel_ips: 2e9,
            ..slow.clone()
        };
        assert!(fast.hardware_speed());
    }

    /// Runs the real probe where /dev/kvm exists; elsewhere says so (and asserts the error kind).
    #[test]
    fn probe_measures_both_modes_or_reports_no_kvm() {
        if !std::path::Path::new("/dev/kvm").exists() {
            match probe() {
                Err(ProbeError::NoKvm(_)) => {
                    eprintln!("skipped: /dev/kvm is absent on this host; checked NoKvm error only")
                }
                other => panic!("expected NoKvm without /dev/kvm, got {other:?}"),
            }
            return;
        }
        let p = probe().expect("probe should run where /dev/kvm exists");
        assert!(p.user_ips > 1e6, "user mode implausibly slow: {p:?}");
        assert!(p.kernel_ips > 1e4, "kernel mode implausibly slow: {p:?}");
        eprintln!("{}", p.verdict());
    }
}
