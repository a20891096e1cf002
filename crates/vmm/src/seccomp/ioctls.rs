//! The ioctl request numbers the filters allow, encoded from the KVM ABI (`_IO`/`_IOR`/`_IOWR` on
//! `KVMIO` with the kvm-bindings structure sizes), and the socket ioctls std uses.

use kvm_bindings::{
    kvm_clock_data, kvm_debugregs, kvm_fpu, kvm_irqchip, kvm_lapic_state, kvm_mp_state, kvm_msrs,
    kvm_pit_state2, kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave,
};
use vmm_sys_util::{ioctl_io_nr, ioctl_ior_nr, ioctl_iowr_nr};

const KVMIO: u32 = 0xAE;

ioctl_io_nr!(KVM_RUN, KVMIO, 0x80);
ioctl_ior_nr!(KVM_GET_REGS, KVMIO, 0x81, kvm_regs);
ioctl_ior_nr!(KVM_GET_SREGS, KVMIO, 0x83, kvm_sregs);
ioctl_iowr_nr!(KVM_GET_MSRS, KVMIO, 0x88, kvm_msrs);
ioctl_ior_nr!(KVM_GET_FPU, KVMIO, 0x8c, kvm_fpu);
ioctl_ior_nr!(KVM_GET_LAPIC, KVMIO, 0x8e, kvm_lapic_state);
ioctl_ior_nr!(KVM_GET_MP_STATE, KVMIO, 0x98, kvm_mp_state);
ioctl_ior_nr!(KVM_GET_VCPU_EVENTS, KVMIO, 0x9f, kvm_vcpu_events);
ioctl_ior_nr!(KVM_GET_DEBUGREGS, KVMIO, 0xa1, kvm_debugregs);
ioctl_ior_nr!(KVM_GET_XSAVE, KVMIO, 0xa4, kvm_xsave);
ioctl_ior_nr!(KVM_GET_XCRS, KVMIO, 0xa6, kvm_xcrs);
ioctl_iowr_nr!(KVM_GET_IRQCHIP, KVMIO, 0x62, kvm_irqchip);
ioctl_ior_nr!(KVM_GET_CLOCK, KVMIO, 0x7c, kvm_clock_data);
ioctl_ior_nr!(KVM_GET_PIT2, KVMIO, 0x9f, kvm_pit_state2);

/// ioctls of a running vCPU thread: KVM_RUN, and reading its own state for a snapshot.
pub fn vcpu() -> Vec<u64> {
    [
        KVM_RUN(),
        KVM_GET_REGS(),
        KVM_GET_SREGS(),
        KVM_GET_MSRS(),
        KVM_GET_FPU(),
        KVM_GET_LAPIC(),
        KVM_GET_MP_STATE(),
        KVM_GET_VCPU_EVENTS(),
        KVM_GET_DEBUGREGS(),
        KVM_GET_XSAVE(),
        KVM_GET_XCRS(),
    ]
    .to_vec()
}

/// ioctls of the VMM thread: VM-wide state for a snapshot, and non-blocking mode on sockets
/// (std's `set_nonblocking` is `FIONBIO`).
pub fn vmm() -> Vec<u64> {
    vec![
        KVM_GET_IRQCHIP(),
        KVM_GET_CLOCK(),
        KVM_GET_PIT2(),
        libc::FIONBIO,
    ]
}
