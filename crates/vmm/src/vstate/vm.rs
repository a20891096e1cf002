//! The KVM VM: memory slot, in-kernel irqchip (PIC + IOAPIC) and PIT, irqfd/ioeventfd wiring,
//! and the VM-wide part of a snapshot.

use kvm_bindings::{
    kvm_clock_data, kvm_irqchip, kvm_pit_config, kvm_pit_state2, kvm_userspace_memory_region,
    KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE, KVM_PIT_SPEAKER_DUMMY,
};
use kvm_ioctls::{Cap, IoEventAddress, Kvm, VmFd};
use serde::{Deserialize, Serialize};
use vmm_sys_util::eventfd::EventFd;

use crate::memory::GuestRam;

#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("opening /dev/kvm failed: {0} (is KVM available and accessible?)")]
    Kvm(kvm_ioctls::Error),
    #[error("KVM API version {0} is not supported (need 12)")]
    ApiVersion(i32),
    #[error("KVM lacks a required capability: {0}")]
    MissingCap(&'static str),
    #[error("KVM_{op} failed: {err}")]
    Ioctl {
        op: &'static str,
        err: kvm_ioctls::Error,
    },
}

fn io(op: &'static str) -> impl Fn(kvm_ioctls::Error) -> VmError {
    move |err| VmError::Ioctl { op, err }
}

/// VM-wide state saved in a snapshot.
#[derive(Clone, Serialize, Deserialize)]
pub struct VmState {
    pub pic_master: kvm_irqchip,
    pub pic_slave: kvm_irqchip,
    pub ioapic: kvm_irqchip,
    pub pit: kvm_pit_state2,
    pub clock: kvm_clock_data,
    /// Host wall-clock time (ns since the epoch) when the snapshot was taken.
    pub saved_at_ns: u64,
}

pub struct Vm {
    pub kvm: Kvm,
    pub fd: VmFd,
}

impl Vm {
    /// Opens /dev/kvm, creates the VM with an in-kernel irqchip and PIT, and maps `ram` at 0.
    pub fn new(ram: &GuestRam) -> Result<Self, VmError> {
        let kvm = Kvm::new().map_err(VmError::Kvm)?;
        let v = kvm.get_api_version();
        if v != 12 {
            return Err(VmError::ApiVersion(v));
        }
        for (cap, name) in [
            (Cap::Irqchip, "IRQCHIP"),
            (Cap::UserMemory, "USER_MEMORY"),
            (Cap::Ioeventfd, "IOEVENTFD"),
            (Cap::Irqfd, "IRQFD"),
            (Cap::Pit2, "PIT2"),
        ] {
            if !kvm.check_extension(cap) {
                return Err(VmError::MissingCap(name));
            }
        }
        let fd = kvm.create_vm().map_err(io("CREATE_VM"))?;
        fd.set_tss_address(0xfffb_d000)
            .map_err(io("SET_TSS_ADDR"))?;
        fd.create_irq_chip().map_err(io("CREATE_IRQCHIP"))?;
        let pit = kvm_pit_config {
            flags: KVM_PIT_SPEAKER_DUMMY,
            ..Default::default()
        };
        fd.create_pit2(pit).map_err(io("CREATE_PIT2"))?;
        let region = kvm_userspace_memory_region {
            slot: 0,
            flags: 0,
            guest_phys_addr: 0,
            memory_size: ram.size,
            userspace_addr: ram.host_addr() as u64,
        };
        // SAFETY: the region describes a live mapping of `ram.size` bytes owned by `ram`, which
        // outlives the VM (the VMM keeps both until the process exits).
        unsafe { fd.set_user_memory_region(region) }.map_err(io("SET_USER_MEMORY_REGION"))?;
        Ok(Vm { kvm, fd })
    }

    pub fn register_irqfd(&self, evt: &EventFd, gsi: u32) -> Result<(), VmError> {
        self.fd.register_irqfd(evt, gsi).map_err(io("IRQFD"))
    }

    pub fn register_ioevent(
        &self,
        evt: &EventFd,
        addr: u64,
        datamatch: u32,
    ) -> Result<(), VmError> {
        self.fd
            .register_ioevent(evt, &IoEventAddress::Mmio(addr), datamatch)
            .map_err(io("IOEVENTFD"))
    }

    pub fn save(&self) -> Result<VmState, VmError> {
        let mut pic_master = kvm_irqchip {
            chip_id: KVM_IRQCHIP_PIC_MASTER,
            ..Default::default()
        };
        let mut pic_slave = kvm_irqchip {
            chip_id: KVM_IRQCHIP_PIC_SLAVE,
            ..Default::default()
        };
        let mut ioapic = kvm_irqchip {
            chip_id: KVM_IRQCHIP_IOAPIC,
            ..Default::default()
        };
        self.fd
            .get_irqchip(&mut pic_master)
            .map_err(io("GET_IRQCHIP"))?;
        self.fd
            .get_irqchip(&mut pic_slave)
            .map_err(io("GET_IRQCHIP"))?;
        self.fd
            .get_irqchip(&mut ioapic)
            .map_err(io("GET_IRQCHIP"))?;
        let pit = self.fd.get_pit2().map_err(io("GET_PIT2"))?;
        let mut clock = self.fd.get_clock().map_err(io("GET_CLOCK"))?;
        // Only the flags KVM accepts back on SET_CLOCK are kept.
        clock.flags &= kvm_bindings::KVM_CLOCK_REALTIME;
        Ok(VmState {
            pic_master,
            pic_slave,
            ioapic,
            pit,
            clock,
            saved_at_ns: now_ns(),
        })
    }

    /// Restores VM-wide state. The guest clock is advanced by the wall time that passed since the
    /// snapshot (KVM_CLOCK_REALTIME when the snapshot carried it, else by adding the elapsed time).
    pub fn restore(&self, st: &VmState) -> Result<(), VmError> {
        self.fd.set_pit2(&st.pit).map_err(io("SET_PIT2"))?;
        let mut clock = st.clock;
        if clock.flags & kvm_bindings::KVM_CLOCK_REALTIME == 0 {
            clock.clock = clock
                .clock
                .saturating_add(now_ns().saturating_sub(st.saved_at_ns));
        }
        self.fd.set_clock(&clock).map_err(io("SET_CLOCK"))?;
        self.fd
            .set_irqchip(&st.pic_master)
            .map_err(io("SET_IRQCHIP"))?;
        self.fd
            .set_irqchip(&st.pic_slave)
            .map_err(io("SET_IRQCHIP"))?;
        self.fd.set_irqchip(&st.ioapic).map_err(io("SET_IRQCHIP"))?;
        Ok(())
    }
}

pub fn now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}
