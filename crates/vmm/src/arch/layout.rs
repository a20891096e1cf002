//! Guest physical memory layout (all addresses are guest physical).
//!
//! ```text
//! 0x0000_0500  GDT (boot)            0x0000_7000  Linux zero page (boot_params)
//! 0x0000_6000  PVH hvm_start_info    0x0000_8ff0  boot stack top
//! 0x0000_6040  PVH memory map        0x0000_9000  PML4, 0xa000 PDPT, 0xb000 PD (1 GiB identity)
//! 0x0002_0000  kernel command line   0x0009_fc00  MP table (in the EBDA)
//! 0x0010_0000  high memory: the kernel is loaded at its ELF physical addresses from here on
//! 0xd000_0000  virtio-mmio devices, 4 KiB each (IRQ 5, 6, …), below the 3 GiB..4 GiB MMIO gap end
//! 0xfec0_0000  IOAPIC                0xfee0_0000  local APIC
//! ```
//! Guest RAM is one region from 0 up to the configured size (at most [`MAX_MEM_BYTES`], so it
//! never overlaps the MMIO gap).

pub const BOOT_GDT: u64 = 0x500;
pub const PVH_INFO: u64 = 0x6000;
pub const PVH_MEMMAP: u64 = 0x6040;
pub const ZERO_PAGE: u64 = 0x7000;
pub const BOOT_STACK: u64 = 0x8ff0;
pub const PML4: u64 = 0x9000;
pub const PDPT: u64 = 0xa000;
pub const PD: u64 = 0xb000;
pub const CMDLINE: u64 = 0x20000;
pub const CMDLINE_MAX: usize = 4096;
pub const EBDA_START: u64 = 0x9fc00;
pub const MPTABLE_START: u64 = EBDA_START;
pub const HIGHMEM_START: u64 = 0x10_0000;
pub const MMIO_BASE: u64 = 0xd000_0000;
pub const MMIO_DEV_SIZE: u64 = 0x1000;
pub const IRQ_BASE: u32 = 5;
pub const IOAPIC_ADDR: u32 = 0xfec0_0000;
pub const APIC_ADDR: u32 = 0xfee0_0000;
pub const MAX_MEM_BYTES: u64 = 3 << 30;
/// Smallest guest RAM the boot layout fits in (low structures + a small kernel).
pub const MIN_MEM_BYTES: u64 = 4 << 20;
