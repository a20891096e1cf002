//! CPUID setup: the host-supported leaves from KVM, with per-vCPU APIC IDs and the hypervisor bit.

use kvm_bindings::CpuId;

/// Patches the supported CPUID table for vCPU `id` of `count`.
pub fn patch(cpuid: &mut CpuId, id: u8, count: u8) {
    for e in cpuid.as_mut_slice().iter_mut() {
        match e.function {
            1 => {
                // EBX[31:24] initial APIC ID, EBX[23:16] logical processor count.
                e.ebx = (e.ebx & 0x0000_ffff) | (u32::from(id) << 24) | (u32::from(count) << 16);
                // ECX[31]: running under a hypervisor. EDX[28] HTT when more than one vCPU.
                e.ecx |= 1 << 31;
                if count > 1 {
                    e.edx |= 1 << 28;
                }
            }
            0xb | 0x1f => {
                // x2APIC ID of this vCPU.
                e.edx = u32::from(id);
            }
            _ => {}
        }
    }
}
