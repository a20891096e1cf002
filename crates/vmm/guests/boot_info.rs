//! Boot information for the test guest: command line, e820 memory and MP-table CPU count from
//! the Linux zero page or the PVH start info, and virtio-mmio devices found on the command line.

use core::ptr::read_volatile;

use crate::rt::*;
// ---------------------------------------------------------------------------------------------
// boot information

pub struct Boot {
    pub kind: u32,
    pub cmdline: &'static [u8],
    pub mem_bytes: u64,
    pub cpus: u32,
}

pub unsafe fn cstr(addr: u64) -> &'static [u8] {
    let mut n = 0;
    while n < 4096 && rd8(addr + n as u64) != 0 {
        n += 1;
    }
    core::slice::from_raw_parts(addr as *const u8, n)
}

pub unsafe fn boot_info(kind: u32, info: u64) -> Boot {
    let mut cmdline: &'static [u8] = &[];
    let mut mem = 0u64;
    if kind == 1 {
        // Linux zero page: cmd_line_ptr at 0x228, e820 entries (20 bytes) at 0x2d0, count at 0x1e8.
        let p = rd32(info + 0x228) as u64;
        if p != 0 {
            cmdline = cstr(p);
        }
        let n = rd8(info + 0x1e8) as u64;
        for i in 0..n.min(128) {
            let e = info + 0x2d0 + i * 20;
            if rd32(e + 16) == 1 {
                mem += rd64(e + 8);
            }
        }
    } else if kind == 2 {
        // hvm_start_info: magic, version, flags, nr_modules, modlist_paddr(16),
        // cmdline_paddr(24), rsdp_paddr(32), memmap_paddr(40), memmap_entries(48);
        // memmap entries are 24 bytes (addr, size, type).
        if rd32(info) == 0x336e_c578 {
            let p = rd64(info + 24);
            if p != 0 {
                cmdline = cstr(p);
            }
            let mm = rd64(info + 40);
            let n = rd32(info + 48) as u64;
            for i in 0..n.min(128) {
                let e = mm + i * 24;
                if rd32(e + 16) == 1 {
                    mem += rd64(e + 8);
                }
            }
        }
    }
    Boot { kind, cmdline, mem_bytes: mem, cpus: count_cpus() }
}

/// Counts processor entries in the MP table (found through its floating pointer in 0xf0000..).
pub unsafe fn count_cpus() -> u32 {
    for (start, end) in [(0x9fc00u64, 0xa0000u64), (0xf0000, 0x100000)] {
        let n = scan_mp(start, end);
        if n > 0 {
            return n;
        }
    }
    0
}

pub unsafe fn scan_mp(start: u64, end: u64) -> u32 {
    let mut a = start;
    while a < end {
        if rd32(a) == u32::from_le_bytes(*b"_MP_") {
            let cfg = rd32(a + 4) as u64;
            if cfg == 0 || rd32(cfg) != u32::from_le_bytes(*b"PCMP") {
                return 0;
            }
            let count = read_volatile((cfg + 34) as *const u16) as u64;
            let mut e = cfg + 44;
            let mut cpus = 0;
            for _ in 0..count {
                match rd8(e) {
                    0 => {
                        cpus += 1;
                        e += 20
                    }
                    _ => e += 8,
                }
            }
            return cpus;
        }
        a += 16;
    }
    0
}

pub fn find_arg(cmdline: &'static [u8], key: &[u8]) -> Option<&'static [u8]> {
    for word in cmdline.split(|&c| c == b' ') {
        if word.len() > key.len() && word.starts_with(key) && word[key.len()] == b'=' {
            return Some(&word[key.len() + 1..]);
        }
    }
    None
}

pub fn parse_num(s: &[u8]) -> u64 {
    let (digits, radix) = if s.starts_with(b"0x") { (&s[2..], 16) } else { (s, 10) };
    let mut v = 0u64;
    for &c in digits {
        let d = match c {
            b'0'..=b'9' => c - b'0',
            b'a'..=b'f' => c - b'a' + 10,
            b'A'..=b'F' => c - b'A' + 10,
            _ => break,
        };
        v = v.wrapping_mul(radix).wrapping_add(d as u64);
    }
    v
}

/// Finds the base address of the virtio-mmio device with `device_id` among the cmdline entries
/// `virtio_mmio.device=<size>@<base>:<irq>`.
pub unsafe fn find_virtio(cmdline: &'static [u8], device_id: u32) -> Option<u64> {
    for word in cmdline.split(|&c| c == b' ') {
        let key = b"virtio_mmio.device=";
        if !word.starts_with(key) {
            continue;
        }
        let rest = &word[key.len()..];
        let at = rest.iter().position(|&c| c == b'@')?;
        let base = parse_num(&rest[at + 1..]);
        if rd32(base) == 0x7472_6976 && rd32(base + 8) == device_id {
            return Some(base);
        }
    }
    None
}
