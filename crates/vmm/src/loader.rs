//! Kernel loading and boot information: an ELF vmlinux goes in at its physical addresses; if it
//! carries a PVH entry note the vCPU starts there with an `hvm_start_info`, else at the ELF entry
//! with a Linux zero page (64-bit boot protocol). Both get the command line and an e820 map.

use std::fs::File;
use std::path::Path;

use linux_loader::configurator::linux::LinuxBootConfigurator;
use linux_loader::configurator::pvh::PvhBootConfigurator;
use linux_loader::configurator::{BootConfigurator, BootParams};
use linux_loader::loader::bootparam::{boot_e820_entry, boot_params};
use linux_loader::loader::elf::start_info::{hvm_memmap_table_entry, hvm_start_info};
use linux_loader::loader::elf::{Elf, PvhBootCapability};
use linux_loader::loader::{load_cmdline, Cmdline, KernelLoader};
use vm_memory::{Address, GuestAddress, GuestMemoryMmap};

use crate::arch::layout::*;
use crate::arch::regs::BootEntry;

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("kernel image {path}: {err}")]
    Open { path: String, err: std::io::Error },
    #[error("loading kernel {path} failed: {err} (an uncompressed ELF vmlinux is required)")]
    Elf {
        path: String,
        err: linux_loader::loader::Error,
    },
    #[error("kernel command line: {0}")]
    Cmdline(String),
    #[error("writing boot parameters failed: {0}")]
    Boot(String),
}

/// Where the kernel will be entered, and through which protocol.
pub struct LoadedKernel {
    pub entry: BootEntry,
}

/// Loads `kernel` and writes the command line and boot parameters for `mem_size` bytes of RAM.
pub fn load_kernel(
    mem: &GuestMemoryMmap,
    mem_size: u64,
    kernel: &Path,
    cmdline: &str,
) -> Result<LoadedKernel, LoadError> {
    let path = kernel.display().to_string();
    let mut f = File::open(kernel).map_err(|err| LoadError::Open {
        path: path.clone(),
        err,
    })?;
    let res = Elf::load(mem, None, &mut f, Some(GuestAddress(HIGHMEM_START))).map_err(|err| {
        LoadError::Elf {
            path: path.clone(),
            err,
        }
    })?;
    let mut cl = Cmdline::new(CMDLINE_MAX).map_err(|e| LoadError::Cmdline(e.to_string()))?;
    if !cmdline.is_empty() {
        cl.insert_str(cmdline)
            .map_err(|e| LoadError::Cmdline(e.to_string()))?;
    }
    load_cmdline(mem, GuestAddress(CMDLINE), &cl).map_err(|e| LoadError::Cmdline(e.to_string()))?;
    let cmdline_len = cl
        .as_cstring()
        .map(|c| c.as_bytes_with_nul().len())
        .unwrap_or(1);
    let low_end = EBDA_START;
    match res.pvh_boot_cap {
        PvhBootCapability::PvhEntryPresent(entry) => {
            let start = hvm_start_info {
                magic: 0x336e_c578,
                version: 1,
                cmdline_paddr: CMDLINE,
                memmap_paddr: PVH_MEMMAP,
                memmap_entries: 2,
                ..Default::default()
            };
            let memmap = [
                hvm_memmap_table_entry {
                    addr: 0,
                    size: low_end,
                    type_: 1,
                    reserved: 0,
                },
                hvm_memmap_table_entry {
                    addr: HIGHMEM_START,
                    size: mem_size - HIGHMEM_START,
                    type_: 1,
                    reserved: 0,
                },
            ];
            let mut params = BootParams::new(&start, GuestAddress(PVH_INFO));
            params.set_sections(&memmap, GuestAddress(PVH_MEMMAP));
            PvhBootConfigurator::write_bootparams::<GuestMemoryMmap>(&params, mem)
                .map_err(|e| LoadError::Boot(e.to_string()))?;
            Ok(LoadedKernel {
                entry: BootEntry::Pvh {
                    entry: entry.raw_value(),
                    start_info: PVH_INFO,
                },
            })
        }
        _ => {
            let mut bp = boot_params::default();
            if let Some(hdr) = res.setup_header {
                bp.hdr = hdr;
            }
            bp.hdr.type_of_loader = 0xff;
            bp.hdr.boot_flag = 0xaa55;
            bp.hdr.header = 0x5372_6448; // "HdrS"
            bp.hdr.cmd_line_ptr = CMDLINE as u32;
            bp.hdr.cmdline_size = cmdline_len as u32;
            bp.hdr.kernel_alignment = 0x0100_0000;
            let e820 = [
                boot_e820_entry {
                    addr: 0,
                    size: low_end,
                    r#type: 1,
                },
                boot_e820_entry {
                    addr: HIGHMEM_START,
                    size: mem_size - HIGHMEM_START,
                    r#type: 1,
                },
            ];
            bp.e820_table[..2].copy_from_slice(&e820);
            bp.e820_entries = 2;
            let params = BootParams::new(&bp, GuestAddress(ZERO_PAGE));
            LinuxBootConfigurator::write_bootparams::<GuestMemoryMmap>(&params, mem)
                .map_err(|e| LoadError::Boot(e.to_string()))?;
            Ok(LoadedKernel {
                entry: BootEntry::Linux64 {
                    entry: res.kernel_load.raw_value(),
                },
            })
        }
    }
}
