//! Initial vCPU register state for the two boot protocols, boot GDT and identity page tables.

use kvm_bindings::{kvm_fpu, kvm_regs, kvm_segment, kvm_sregs};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::layout::{BOOT_GDT, BOOT_STACK, PD, PDPT, PML4, ZERO_PAGE};

const CR0_PE: u64 = 1;
const CR0_ET: u64 = 1 << 4;
const CR0_PG: u64 = 1 << 31;
const CR4_PAE: u64 = 1 << 5;
const EFER_LME: u64 = 1 << 8;
const EFER_LMA: u64 = 1 << 10;

/// How the vCPU enters the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BootEntry {
    /// 64-bit Linux boot protocol: long mode, paging on, `%rsi` = zero page.
    Linux64 { entry: u64 },
    /// PVH: 32-bit protected mode, paging off, `%ebx` = `hvm_start_info`.
    Pvh { entry: u64, start_info: u64 },
}

/// GDT entry from flags/base/limit (the classic packing).
pub const fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    ((base as u64 & 0xff00_0000) << 32)
        | ((base as u64 & 0x00ff_ffff) << 16)
        | (limit as u64 & 0x0000_ffff)
        | ((limit as u64 & 0x000f_0000) << 32)
        | ((flags as u64 & 0xf0ff) << 40)
}

fn segment_from_gdt(entry: u64, index: u8) -> kvm_segment {
    kvm_segment {
        base: ((entry >> 16) & 0xff_ffff) | (((entry >> 56) & 0xff) << 24),
        limit: {
            let l = ((entry & 0xffff) | ((entry >> 32) & 0xf_0000)) as u32;
            if (entry >> 55) & 1 == 1 {
                (l << 12) | 0xfff
            } else {
                l
            }
        },
        selector: u16::from(index) * 8,
        type_: ((entry >> 40) & 0xf) as u8,
        present: ((entry >> 47) & 1) as u8,
        dpl: ((entry >> 45) & 3) as u8,
        db: ((entry >> 54) & 1) as u8,
        s: ((entry >> 44) & 1) as u8,
        l: ((entry >> 53) & 1) as u8,
        g: ((entry >> 55) & 1) as u8,
        avl: ((entry >> 52) & 1) as u8,
        unusable: if (entry >> 47) & 1 == 1 { 0 } else { 1 },
        padding: 0,
    }
}

/// General purpose registers at the kernel entry.
pub fn boot_regs(entry: BootEntry) -> kvm_regs {
    match entry {
        BootEntry::Linux64 { entry } => kvm_regs {
            rflags: 2,
            rip: entry,
            rsp: BOOT_STACK,
            rbp: BOOT_STACK,
            rsi: ZERO_PAGE,
            ..Default::default()
        },
        BootEntry::Pvh { entry, start_info } => kvm_regs {
            rflags: 2,
            rip: entry,
            rbx: start_info,
            ..Default::default()
        },
    }
}

/// FPU state expected by Linux at entry (default control word and MXCSR).
pub fn boot_fpu() -> kvm_fpu {
    kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    }
}

/// Writes the boot GDT and, for the 64-bit protocol, identity page tables for the first GiB, then
/// fills `sregs` (as read from the vCPU) for the entry mode.
pub fn setup_sregs(
    mem: &GuestMemoryMmap,
    entry: BootEntry,
    sregs: &mut kvm_sregs,
) -> Result<(), vm_memory::GuestMemoryError> {
    let long = matches!(entry, BootEntry::Linux64 { .. });
    let gdt: [u64; 4] = [
        gdt_entry(0, 0, 0),
        if long {
            gdt_entry(0xa09b, 0, 0xfffff)
        } else {
            gdt_entry(0xc09b, 0, 0xfffff)
        },
        gdt_entry(0xc093, 0, 0xfffff),
        gdt_entry(0x808b, 0, 0xfffff),
    ];
    for (i, e) in gdt.iter().enumerate() {
        mem.write_obj(*e, GuestAddress(BOOT_GDT + 8 * i as u64))?;
    }
    let code = segment_from_gdt(gdt[1], 1);
    let data = segment_from_gdt(gdt[2], 2);
    let tss = segment_from_gdt(gdt[3], 3);
    sregs.gdt.base = BOOT_GDT;
    sregs.gdt.limit = (gdt.len() * 8 - 1) as u16;
    sregs.idt.base = 0;
    sregs.idt.limit = 0;
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = tss;
    if long {
        // PML4[0] -> PDPT, PDPT[0] -> PD, PD: 512 x 2 MiB pages = identity map of 1 GiB.
        mem.write_obj(PDPT | 0x03, GuestAddress(PML4))?;
        mem.write_obj(PD | 0x03, GuestAddress(PDPT))?;
        for i in 0..512u64 {
            mem.write_obj((i << 21) | 0x83, GuestAddress(PD + i * 8))?;
        }
        sregs.cr3 = PML4;
        sregs.cr4 |= CR4_PAE;
        sregs.cr0 |= CR0_PE | CR0_PG | CR0_ET;
        sregs.efer |= EFER_LME | EFER_LMA;
    } else {
        sregs.cr0 = (sregs.cr0 | CR0_PE | CR0_ET) & !CR0_PG;
        sregs.cr4 = 0;
        sregs.efer = 0;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gdt_entries_decode_to_flat_segments() {
        let code = segment_from_gdt(gdt_entry(0xa09b, 0, 0xfffff), 1);
        assert_eq!(
            (code.l, code.db, code.g, code.present, code.type_),
            (1, 0, 1, 1, 0xb)
        );
        assert_eq!(code.limit, 0xffff_ffff);
        assert_eq!(code.selector, 8);
        let code32 = segment_from_gdt(gdt_entry(0xc09b, 0, 0xfffff), 1);
        assert_eq!((code32.l, code32.db), (0, 1));
    }
}
