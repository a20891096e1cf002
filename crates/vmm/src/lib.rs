//! kiln-vmm: a KVM microVM monitor for kiln's `microvm` isolation driver, built on rust-vmm
//! crates (kvm-ioctls, kvm-bindings, vm-memory, linux-loader, vm-superio, virtio-queue,
//! vmm-sys-util, seccompiler).
//!
//! The boot path, top to bottom ([`vmm::Vmm::boot`]): guest RAM in a memfd ([`memory`]) → KVM VM
//! with in-kernel irqchip and PIT ([`vstate::vm`]) → ELF kernel + PVH or 64-bit boot params
//! ([`loader`]) → MP table ([`arch::mptable`]) → devices: 8250 serial, i8042, virtio-mmio blk /
//! vsock / rng announced on the command line ([`devices`]) → vCPUs with CPUID, MSRs, registers
//! ([`vstate::vcpu`]), one thread each → the event loop ([`vmm::Vmm::run`]) serving ioeventfds,
//! device sockets and the control API ([`api`]).
//!
//! With `--jail`, [`jail::enter`] first confines the process (private root of bind mounts, fresh
//! namespaces, unprivileged uid/gid); every thread then runs under its own [`seccomp`] filter.
//!
//! Restore ([`vmm::Vmm::restore`]) maps the snapshot's memory file `MAP_PRIVATE`, so any number
//! of VMM processes fork one snapshot copy-on-write.

#![warn(clippy::undocumented_unsafe_blocks)]

pub mod api;
pub mod arch;
pub mod bench;
pub mod config;
pub mod devices;
pub mod jail;
pub mod loader;
pub mod memory;
pub mod seccomp;
pub mod snapshot;
pub mod vmm;
pub mod vstate;

/// Paths of the test guests built by build.rs (freestanding x86_64 programs, see `guests/`).
pub mod test_guests {
    /// Variant with a PVH entry note.
    pub const PVH: &str = env!("KILN_TEST_GUEST_PVH");
    /// Variant without the note: booted through the 64-bit Linux boot protocol.
    pub const LINUX64: &str = env!("KILN_TEST_GUEST_64");
}
