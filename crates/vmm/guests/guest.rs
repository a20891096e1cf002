//! kiln-vmm test guest: a freestanding x86_64 program booted by kiln-vmm through its real boot path
//! (PVH or the 64-bit Linux boot protocol). The boot stub (boot.S) drops to ring 3 with IOPL=3; this
//! file is the ring-3 workload. It reads the kernel command line handed over by the VMM, finds its
//! virtio-mmio devices in the `virtio_mmio.device=` entries there, and runs the mode named by
//! `kiln.test=`. Devices are driven by polling used rings (no interrupts), port I/O is direct.
//!
//! Output goes to the 8250 UART at 0x3f8 as lines the tests parse; the run ends with an i8042
//! reset (`out 0x64, 0xfe`), which ends the VM.
#![no_std]
#![no_main]
#![allow(clippy::missing_safety_doc, static_mut_refs)]

use core::arch::{asm, global_asm};
use core::ptr::{read_volatile, write_volatile};
use core::sync::atomic::{fence, Ordering};

global_asm!(include_str!("boot.S"));

// ---------------------------------------------------------------------------------------------
// freestanding support

#[no_mangle]
pub unsafe extern "C" fn memcpy(dst: *mut u8, src: *const u8, n: usize) -> *mut u8 {
    asm!("rep movsb", inout("rcx") n => _, inout("rdi") dst => _, inout("rsi") src => _, options(nostack));
    dst
}

#[no_mangle]
pub unsafe extern "C" fn memmove(dst: *mut u8, src: *const u8, n: usize) -> *mut u8 {
    if (dst as usize) <= (src as usize) || (dst as usize) >= (src as usize) + n {
        return memcpy(dst, src, n);
    }
    let mut i = n;
    while i > 0 {
        i -= 1;
        write_volatile(dst.add(i), read_volatile(src.add(i)));
    }
    dst
}

#[no_mangle]
pub unsafe extern "C" fn memset(dst: *mut u8, c: i32, n: usize) -> *mut u8 {
    asm!("rep stosb", inout("rcx") n => _, inout("rdi") dst => _, in("al") c as u8, options(nostack));
    dst
}

#[no_mangle]
pub unsafe extern "C" fn memcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
    let mut i = 0;
    while i < n {
        let x = read_volatile(a.add(i));
        let y = read_volatile(b.add(i));
        if x != y {
            return x as i32 - y as i32;
        }
        i += 1;
    }
    0
}

#[no_mangle]
pub unsafe extern "C" fn bcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
    memcmp(a, b, n)
}

/// Referenced by the prebuilt `core` (built with unwinding); never called since this program is
/// built with `panic=abort`.
#[no_mangle]
pub extern "C" fn rust_eh_personality() {}

#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    puts("guest panic\n");
    reset()
}

// ---------------------------------------------------------------------------------------------
// port I/O, serial, reset

fn outb(port: u16, v: u8) {
    // SAFETY: ring 3 with IOPL=3 may do port I/O; the VMM emulates the port.
    unsafe { asm!("out dx, al", in("dx") port, in("al") v, options(nostack, nomem)) }
}

fn putc(c: u8) {
    outb(0x3f8, c);
}

fn puts(s: &str) {
    for b in s.bytes() {
        putc(b);
    }
}

fn put_bytes(s: &[u8]) {
    for &b in s {
        putc(b);
    }
}

fn put_dec(mut v: u64) {
    let mut buf = [0u8; 20];
    let mut i = buf.len();
    if v == 0 {
        putc(b'0');
        return;
    }
    while v > 0 {
        i -= 1;
        buf[i] = b'0' + (v % 10) as u8;
        v /= 10;
    }
    put_bytes(&buf[i..]);
}

fn put_hex(v: u64) {
    puts("0x");
    let mut started = false;
    for i in (0..16).rev() {
        let d = ((v >> (i * 4)) & 0xf) as u8;
        if d != 0 || started || i == 0 {
            started = true;
            putc(if d < 10 { b'0' + d } else { b'a' + d - 10 });
        }
    }
}

fn put_hex_bytes(b: &[u8]) {
    for &x in b {
        let hi = x >> 4;
        let lo = x & 0xf;
        putc(if hi < 10 { b'0' + hi } else { b'a' + hi - 10 });
        putc(if lo < 10 { b'0' + lo } else { b'a' + lo - 10 });
    }
}

fn reset() -> ! {
    outb(0x64, 0xfe);
    loop {
        core::hint::spin_loop();
    }
}

unsafe fn rd8(a: u64) -> u8 {
    read_volatile(a as *const u8)
}
unsafe fn rd32(a: u64) -> u32 {
    read_volatile(a as *const u32)
}
unsafe fn rd64(a: u64) -> u64 {
    read_volatile(a as *const u64)
}
unsafe fn wr32(a: u64, v: u32) {
    write_volatile(a as *mut u32, v)
}

// ---------------------------------------------------------------------------------------------
// boot information

struct Boot {
    kind: u32,
    cmdline: &'static [u8],
    mem_bytes: u64,
    cpus: u32,
}

unsafe fn cstr(addr: u64) -> &'static [u8] {
    let mut n = 0;
    while n < 4096 && rd8(addr + n as u64) != 0 {
        n += 1;
    }
    core::slice::from_raw_parts(addr as *const u8, n)
}

unsafe fn boot_info(kind: u32, info: u64) -> Boot {
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
unsafe fn count_cpus() -> u32 {
    for (start, end) in [(0x9fc00u64, 0xa0000u64), (0xf0000, 0x100000)] {
        let n = scan_mp(start, end);
        if n > 0 {
            return n;
        }
    }
    0
}

unsafe fn scan_mp(start: u64, end: u64) -> u32 {
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

fn find_arg(cmdline: &'static [u8], key: &[u8]) -> Option<&'static [u8]> {
    for word in cmdline.split(|&c| c == b' ') {
        if word.len() > key.len() && word.starts_with(key) && word[key.len()] == b'=' {
            return Some(&word[key.len() + 1..]);
        }
    }
    None
}

fn parse_num(s: &[u8]) -> u64 {
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
unsafe fn find_virtio(cmdline: &'static [u8], device_id: u32) -> Option<u64> {
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

// ---------------------------------------------------------------------------------------------
// virtio-mmio driver (modern, polled)

const QSZ: usize = 16;

#[repr(C, align(4096))]
struct VirtQueue {
    desc: [[u64; 2]; QSZ],     // addr, (len u32 | flags u16 << 32 | next u16 << 48)
    avail: [u16; 3 + QSZ],     // flags, idx, ring[QSZ], used_event
    _pad: [u8; 4096 - 16 * QSZ - 2 * (3 + QSZ)],
    used: [u32; 2 + 2 * QSZ],  // flags|idx, ring (id, len)
}

struct Vq {
    q: *mut VirtQueue,
    base: u64,
    index: u32,
    avail_idx: u16,
    last_used: u16,
}

const F_NEXT: u16 = 1;
const F_WRITE: u16 = 2;

impl Vq {
    unsafe fn set_desc(&mut self, i: usize, addr: u64, len: u32, flags: u16, next: u16) {
        let d = &mut (*self.q).desc[i];
        write_volatile(&mut d[0], addr);
        write_volatile(&mut d[1], len as u64 | (flags as u64) << 32 | (next as u64) << 48);
    }
    unsafe fn push(&mut self, head: u16) {
        let a = &mut (*self.q).avail;
        write_volatile(&mut a[2 + (self.avail_idx as usize % QSZ)], head);
        fence(Ordering::SeqCst);
        self.avail_idx = self.avail_idx.wrapping_add(1);
        write_volatile(&mut a[1], self.avail_idx);
        fence(Ordering::SeqCst);
    }
    unsafe fn notify(&self) {
        wr32(self.base + 0x50, self.index);
    }
    unsafe fn used_idx(&self) -> u16 {
        (read_volatile(&(*self.q).used[0]) >> 16) as u16
    }
    /// Returns (descriptor head, written length) of the next used element, if any.
    unsafe fn pop(&mut self) -> Option<(u32, u32)> {
        if self.used_idx() == self.last_used {
            return None;
        }
        fence(Ordering::SeqCst);
        let slot = self.last_used as usize % QSZ;
        let id = read_volatile(&(*self.q).used[1 + 2 * slot]);
        let len = read_volatile(&(*self.q).used[2 + 2 * slot]);
        self.last_used = self.last_used.wrapping_add(1);
        Some((id, len))
    }
    unsafe fn wait(&mut self) -> (u32, u32) {
        let mut spins = 0u64;
        loop {
            if let Some(x) = self.pop() {
                return x;
            }
            spins += 1;
            if spins == 4_000_000_000 {
                puts("virtio timeout\n");
                reset();
            }
            core::hint::spin_loop();
        }
    }
}

/// Initializes a virtio-mmio device (version 2): negotiates VERSION_1 plus `want` feature bits,
/// sets up `n` queues backed by `queues`. Returns the device-offered low feature word.
unsafe fn virtio_init(base: u64, want_low: u32, queues: &mut [VirtQueue], out: &mut [Vq]) -> u32 {
    wr32(base + 0x70, 0);
    wr32(base + 0x70, 1);
    wr32(base + 0x70, 1 | 2);
    wr32(base + 0x14, 0);
    let f0 = rd32(base + 0x10);
    wr32(base + 0x24, 0);
    wr32(base + 0x20, f0 & want_low);
    wr32(base + 0x24, 1);
    wr32(base + 0x20, 1); // VIRTIO_F_VERSION_1
    wr32(base + 0x70, 1 | 2 | 8);
    if rd32(base + 0x70) & 8 == 0 {
        puts("virtio features rejected\n");
        reset();
    }
    for (i, q) in queues.iter_mut().enumerate() {
        let p = q as *mut VirtQueue;
        memset(p as *mut u8, 0, core::mem::size_of::<VirtQueue>());
        wr32(base + 0x30, i as u32);
        if rd32(base + 0x34) < QSZ as u32 {
            puts("virtio queue too small\n");
            reset();
        }
        wr32(base + 0x38, QSZ as u32);
        let desc = p as u64;
        let avail = core::ptr::addr_of!((*p).avail) as u64;
        let used = core::ptr::addr_of!((*p).used) as u64;
        wr32(base + 0x80, desc as u32);
        wr32(base + 0x84, (desc >> 32) as u32);
        wr32(base + 0x90, avail as u32);
        wr32(base + 0x94, (avail >> 32) as u32);
        wr32(base + 0xa0, used as u32);
        wr32(base + 0xa4, (used >> 32) as u32);
        wr32(base + 0x44, 1);
        out[i] = Vq { q: p, base, index: i as u32, avail_idx: 0, last_used: 0 };
    }
    wr32(base + 0x70, 1 | 2 | 4 | 8);
    f0
}

const EMPTY_VQ: Vq = Vq { q: core::ptr::null_mut(), base: 0, index: 0, avail_idx: 0, last_used: 0 };

#[repr(C, align(4096))]
struct Page([u8; 4096]);

// SAFETY: all-zero bytes are a valid value for these plain-data arrays.
static mut QUEUES: [VirtQueue; 5] = unsafe { core::mem::zeroed() };
// SAFETY: as above.
static mut BUF: [Page; 40] = unsafe { core::mem::zeroed() };

fn buf(i: usize) -> u64 {
    // SAFETY: only the address is taken.
    unsafe { core::ptr::addr_of!(BUF[i]) as u64 }
}

unsafe fn buf_slice(i: usize, len: usize) -> &'static mut [u8] {
    core::slice::from_raw_parts_mut(buf(i) as *mut u8, len)
}

// ---------------------------------------------------------------------------------------------
// entry

#[no_mangle]
pub unsafe extern "C" fn kiln_guest_main(kind: u32, info: u64) -> ! {
    let boot = boot_info(kind, info);
    puts("kiln-guest: ring 3 up, boot=");
    puts(match boot.kind {
        1 => "linux64",
        2 => "pvh",
        _ => "unknown",
    });
    puts(" mem=");
    put_dec(boot.mem_bytes);
    puts(" cpus=");
    put_dec(boot.cpus as u64);
    puts("\n");
    let mode = find_arg(boot.cmdline, b"kiln.test").unwrap_or(b"hello");
    match mode {
        b"hello" => {
            puts("hello from the kiln test guest\n");
            reset()
        }
        b"count" => count(parse_num(find_arg(boot.cmdline, b"kiln.count_shift").unwrap_or(b"22")).clamp(4, 40)),
        b"blk" => blk(&boot),
        b"rng" => rng(&boot),
        b"vsock" => vsock(&boot),
        b"garbage" => garbage(&boot),
        b"restore" => restore(&boot),
        b"fault" => {
            // A ring-3 write to a non-present address: an unhandled exception, i.e. triple fault.
            write_volatile(0xffff_ff80_0000_0000u64 as *mut u64, 1);
            reset()
        }
        _ => {
            puts("unknown mode\n");
            reset()
        }
    }
}

#[no_mangle]
pub static mut KILN_COUNTER: u64 = 0;

/// Counts forever in memory, printing every 2^`shift` increments. Used by the snapshot/fork
/// tests and the benchmark.
unsafe fn count(shift: u64) -> ! {
    puts("counter at ");
    put_hex(core::ptr::addr_of!(KILN_COUNTER) as u64);
    puts("\n");
    loop {
        let c = read_volatile(core::ptr::addr_of!(KILN_COUNTER)) + 1;
        write_volatile(core::ptr::addr_of_mut!(KILN_COUNTER), c);
        if c & ((1 << shift) - 1) == 0 {
            puts("count=");
            put_dec(c);
            puts("\n");
        }
    }
}

// --- virtio-blk -------------------------------------------------------------------------------

unsafe fn blk_req(vq: &mut Vq, typ: u32, sector: u64, data: u64, len: u32) -> u8 {
    // header in BUF[0], status byte in BUF[1]
    let h = buf(0);
    write_volatile(h as *mut u32, typ);
    write_volatile((h + 4) as *mut u32, 0);
    write_volatile((h + 8) as *mut u64, sector);
    let st = buf(1);
    write_volatile(st as *mut u8, 0xff);
    if len > 0 {
        vq.set_desc(0, h, 16, F_NEXT, 1);
        let flags = if typ == 0 || typ == 8 { F_WRITE } else { 0 };
        vq.set_desc(1, data, len, flags | F_NEXT, 2);
        vq.set_desc(2, st, 1, F_WRITE, 0);
    } else {
        vq.set_desc(0, h, 16, F_NEXT, 2);
        vq.set_desc(2, st, 1, F_WRITE, 0);
    }
    vq.push(0);
    vq.notify();
    vq.wait();
    read_volatile(st as *const u8)
}

unsafe fn blk(boot: &Boot) -> ! {
    let Some(base) = find_virtio(boot.cmdline, 2) else {
        puts("no virtio-blk\n");
        reset()
    };
    let mut vqs = [EMPTY_VQ];
    let feats = virtio_init(base, 1 << 5 | 1 << 9, &mut QUEUES[..1], &mut vqs);
    let ro = feats & (1 << 5) != 0;
    let vq = &mut vqs[0];
    let cap = rd64(base + 0x100);
    puts("blk capacity=");
    put_dec(cap);
    puts(if ro { " ro\n" } else { " rw\n" });
    // read sector 0 (base image content)
    let s = blk_req(vq, 0, 0, buf(2), 512);
    puts("blk read0 status=");
    put_dec(s as u64);
    puts(" data=");
    let d = buf_slice(2, 512);
    let n = d.iter().position(|&c| c == 0 || c == b'\n').unwrap_or(32).min(64);
    put_bytes(&d[..n]);
    puts("\n");
    // read sector 1 (may hold data written by an earlier boot with the same overlay)
    let s = blk_req(vq, 0, 1, buf(3), 512);
    let d = buf_slice(3, 512);
    let n = d.iter().position(|&c| c == 0 || c == b'\n').unwrap_or(32).min(64);
    puts("blk read1 status=");
    put_dec(s as u64);
    puts(" data=");
    put_bytes(&d[..n]);
    puts("\n");
    // write sectors 1..=8 (4 KiB, crossing a CoW block boundary) with a pattern
    let w = buf_slice(4, 4096);
    for (i, b) in w.iter_mut().enumerate() {
        *b = b'a' + (i % 26) as u8;
    }
    let msg = b"GUEST-WROTE-SECTOR1\n";
    w[..msg.len()].copy_from_slice(msg);
    let s = blk_req(vq, 1, 1, buf(4), 4096);
    puts("blk write status=");
    put_dec(s as u64);
    puts("\n");
    let s = blk_req(vq, 4, 0, 0, 0);
    puts("blk flush status=");
    put_dec(s as u64);
    puts("\n");
    // read back, compare
    let s = blk_req(vq, 0, 1, buf(5), 4096);
    let same = memcmp(buf(4) as *const u8, buf(5) as *const u8, 4096) == 0;
    if !ro {
        puts(if s == 0 && same { "blk readback ok\n" } else { "blk readback MISMATCH\n" });
    }
    // out of range read must fail with IOERR
    let s = blk_req(vq, 0, cap, buf(2), 512);
    puts("blk oob status=");
    put_dec(s as u64);
    puts("\n");
    reset()
}

// --- virtio-rng -------------------------------------------------------------------------------

unsafe fn rng(boot: &Boot) -> ! {
    let Some(base) = find_virtio(boot.cmdline, 4) else {
        puts("no virtio-rng\n");
        reset()
    };
    let mut vqs = [EMPTY_VQ];
    virtio_init(base, 0, &mut QUEUES[..1], &mut vqs);
    let vq = &mut vqs[0];
    for round in 0..2 {
        memset(buf(2) as *mut u8, 0, 32);
        vq.set_desc(0, buf(2), 32, F_WRITE, 0);
        vq.push(0);
        vq.notify();
        let (_, len) = vq.wait();
        puts("rng");
        put_dec(round);
        puts(" len=");
        put_dec(len as u64);
        puts(" bytes=");
        put_hex_bytes(buf_slice(2, 32));
        puts("\n");
    }
    reset()
}

// --- virtio-vsock -----------------------------------------------------------------------------

const HDR: usize = 44;
const OP_REQUEST: u16 = 1;
const OP_RESPONSE: u16 = 2;
const OP_RST: u16 = 3;
const OP_SHUTDOWN: u16 = 4;
const OP_RW: u16 = 5;
const OP_CREDIT_UPDATE: u16 = 6;
const OP_CREDIT_REQUEST: u16 = 7;
const RX_BUFS: usize = 8;
const GUEST_BUF_ALLOC: u32 = 64 * 1024;

#[derive(Clone, Copy, Default)]
struct Pkt {
    src_cid: u64,
    dst_cid: u64,
    src_port: u32,
    dst_port: u32,
    len: u32,
    op: u16,
    buf_alloc: u32,
    fwd_cnt: u32,
}

struct Vsock {
    rx: Vq,
    tx: Vq,
    cid: u64,
    /// bytes consumed from the host per connection, and host credit
    fwd_cnt: u32,
    tx_cnt: u32,
    peer_buf_alloc: u32,
    peer_fwd_cnt: u32,
}

unsafe fn put_hdr(a: u64, p: &Pkt) {
    let b = core::slice::from_raw_parts_mut(a as *mut u8, HDR);
    b[0..8].copy_from_slice(&p.src_cid.to_le_bytes());
    b[8..16].copy_from_slice(&p.dst_cid.to_le_bytes());
    b[16..20].copy_from_slice(&p.src_port.to_le_bytes());
    b[20..24].copy_from_slice(&p.dst_port.to_le_bytes());
    b[24..28].copy_from_slice(&p.len.to_le_bytes());
    b[28..30].copy_from_slice(&1u16.to_le_bytes());
    b[30..32].copy_from_slice(&p.op.to_le_bytes());
    b[32..36].copy_from_slice(&0u32.to_le_bytes());
    b[36..40].copy_from_slice(&p.buf_alloc.to_le_bytes());
    b[40..44].copy_from_slice(&p.fwd_cnt.to_le_bytes());
}

unsafe fn get_hdr(a: u64) -> Pkt {
    let b = core::slice::from_raw_parts(a as *const u8, HDR);
    let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
    let u64_at = |o: usize| u32_at(o) as u64 | (u32_at(o + 4) as u64) << 32;
    Pkt {
        src_cid: u64_at(0),
        dst_cid: u64_at(8),
        src_port: u32_at(16),
        dst_port: u32_at(20),
        len: u32_at(24),
        op: u16::from_le_bytes([b[30], b[31]]),
        buf_alloc: u32_at(36),
        fwd_cnt: u32_at(40),
    }
}

impl Vsock {
    /// Posts RX buffer `i` (BUF[8+i], one page: header + up to 4052 payload bytes).
    unsafe fn post_rx(&mut self, i: usize) {
        self.rx.set_desc(i, buf(8 + i), 4096, F_WRITE, 0);
        self.rx.push(i as u16);
    }
    unsafe fn send(&mut self, mut p: Pkt, data: &[u8]) {
        p.src_cid = self.cid;
        p.dst_cid = 2;
        p.len = data.len() as u32;
        p.buf_alloc = GUEST_BUF_ALLOC;
        p.fwd_cnt = self.fwd_cnt;
        let a = buf(30);
        put_hdr(a, &p);
        memcpy((a + HDR as u64) as *mut u8, data.as_ptr(), data.len());
        self.tx.set_desc(0, a, (HDR + data.len()) as u32, 0, 0);
        self.tx.push(0);
        self.tx.notify();
        self.tx.wait();
        if p.op == OP_RW {
            self.tx_cnt = self.tx_cnt.wrapping_add(data.len() as u32);
        }
    }
    /// Waits for the next packet; returns it and the payload address. The buffer is re-posted
    /// by `done`.
    unsafe fn recv(&mut self) -> (Pkt, u64, usize) {
        let (id, _len) = self.rx.wait();
        let a = buf(8 + id as usize);
        let p = get_hdr(a);
        self.peer_buf_alloc = p.buf_alloc;
        self.peer_fwd_cnt = p.fwd_cnt;
        (p, a + HDR as u64, id as usize)
    }
    unsafe fn done(&mut self, id: usize) {
        self.post_rx(id);
        self.rx.notify();
    }
    fn peer_credit(&self) -> u32 {
        self.peer_buf_alloc.wrapping_sub(self.tx_cnt.wrapping_sub(self.peer_fwd_cnt))
    }
}

unsafe fn vsock(boot: &Boot) -> ! {
    let Some(base) = find_virtio(boot.cmdline, 19) else {
        puts("no virtio-vsock\n");
        reset()
    };
    let mut vqs = [EMPTY_VQ, EMPTY_VQ, EMPTY_VQ];
    virtio_init(base, 0, &mut QUEUES[..3], &mut vqs);
    let [rx, tx, _ev] = vqs;
    let cid = rd64(base + 0x100);
    let mut v = Vsock { rx, tx, cid, fwd_cnt: 0, tx_cnt: 0, peer_buf_alloc: 0, peer_fwd_cnt: 0 };
    for i in 0..RX_BUFS {
        v.post_rx(i);
    }
    v.rx.notify();
    puts("vsock cid=");
    put_dec(cid);
    puts("\n");

    // guest -> host: connect to host port given on the cmdline, send a line, read the echo.
    let host_port = parse_num(find_arg(boot.cmdline, b"kiln.vsock_port").unwrap_or(b"5000")) as u32;
    let gport = 40000u32;
    v.send(Pkt { src_port: gport, dst_port: host_port, op: OP_REQUEST, ..Pkt::default() }, &[]);
    let (p, _, id) = v.recv();
    v.done(id);
    if p.op != OP_RESPONSE {
        puts("vsock g2h connect refused op=");
        put_dec(p.op as u64);
        puts("\n");
        reset();
    }
    puts("vsock g2h connected\n");
    v.send(Pkt { src_port: gport, dst_port: host_port, op: OP_RW, ..Pkt::default() }, b"ping-from-guest\n");
    let mut got = [0u8; 64];
    let mut n = 0;
    while n < 16 {
        let (p, data, id) = v.recv();
        if p.op == OP_RW && p.dst_port == gport {
            let l = (p.len as usize).min(64 - n);
            memcpy(got.as_mut_ptr().add(n), data as *const u8, l);
            n += l;
            v.fwd_cnt = v.fwd_cnt.wrapping_add(p.len);
        }
        v.done(id);
    }
    puts("vsock g2h echo: ");
    put_bytes(&got[..n]);
    v.send(Pkt { src_port: gport, dst_port: host_port, op: OP_SHUTDOWN, ..Pkt::default() }, &[]);

    // host -> guest: listen on port 1234, echo everything back until the host shuts down.
    v.fwd_cnt = 0;
    v.tx_cnt = 0;
    puts("vsock listening 1234\n");
    let mut peer_port = 0u32;
    let mut echoed = 0u64;
    loop {
        let (p, data, id) = v.recv();
        if p.dst_port != 1234 {
            v.done(id);
            continue;
        }
        match p.op {
            OP_REQUEST => {
                peer_port = p.src_port;
                v.done(id);
                v.fwd_cnt = 0;
                v.tx_cnt = 0;
                v.send(Pkt { src_port: 1234, dst_port: peer_port, op: OP_RESPONSE, ..Pkt::default() }, &[]);
                puts("vsock h2g accepted\n");
            }
            OP_RW => {
                let len = p.len as usize;
                let mut chunk = [0u8; 4096];
                memcpy(chunk.as_mut_ptr(), data as *const u8, len.min(4096));
                v.done(id);
                v.fwd_cnt = v.fwd_cnt.wrapping_add(p.len);
                // respect host credit before echoing
                while v.peer_credit() < len as u32 {
                    v.send(Pkt { src_port: 1234, dst_port: peer_port, op: OP_CREDIT_REQUEST, ..Pkt::default() }, &[]);
                    let (q, _, qid) = v.recv();
                    v.done(qid);
                    if q.op == OP_RST || q.op == OP_SHUTDOWN {
                        break;
                    }
                }
                v.send(Pkt { src_port: 1234, dst_port: peer_port, op: OP_RW, ..Pkt::default() }, &chunk[..len.min(4096)]);
                echoed += len as u64;
                // tell the host how much we consumed so it keeps sending
                v.send(Pkt { src_port: 1234, dst_port: peer_port, op: OP_CREDIT_UPDATE, ..Pkt::default() }, &[]);
            }
            OP_SHUTDOWN | OP_RST => {
                v.done(id);
                v.send(Pkt { src_port: 1234, dst_port: peer_port, op: OP_RST, ..Pkt::default() }, &[]);
                puts("vsock h2g done echoed=");
                put_dec(echoed);
                puts("\n");
                reset();
            }
            _ => v.done(id),
        }
    }
}

// --- garbage ----------------------------------------------------------------------------------

/// Writes garbage to every virtio-mmio register and puts invalid descriptors on the queues, then
/// checks that the block device (after a reset by the driver) still serves a correct read.
unsafe fn garbage(boot: &Boot) -> ! {
    let mut seed = 0x1234_5678_9abc_def0u64;
    let mut rnd = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for id in [2u32, 4, 19] {
        let Some(base) = find_virtio(boot.cmdline, id) else { continue };
        // random register writes, including queue addresses and notifies
        for _ in 0..2000 {
            let off = (rnd() % 0x200) & !3;
            wr32(base + off, rnd() as u32);
        }
        // a "valid" setup whose descriptors are garbage: out of range, loops, huge lengths
        let mut vqs = [EMPTY_VQ, EMPTY_VQ, EMPTY_VQ];
        let nq = if id == 19 { 3 } else { 1 };
        virtio_init(base, 0, &mut QUEUES[..nq], &mut vqs[..nq]);
        for vq in vqs[..nq].iter_mut() {
            vq.set_desc(0, 0xffff_ffff_f000, 0xffff_ffff, F_NEXT | F_WRITE, 1);
            vq.set_desc(1, buf(2), 0x8000_0000, F_NEXT, 0); // loop back to 0
            vq.push(0);
            vq.set_desc(2, buf(2), 16, F_NEXT, 77); // next out of range
            vq.push(2);
            vq.push(200); // head out of range
            vq.set_desc(3, 0x7fff_ffff_0000, 4096, F_WRITE, 0); // beyond guest memory
            vq.push(3);
            vq.notify();
            for _ in 0..1000 {
                vq.pop();
            }
        }
        // garbage straight into the ring indices
        for _ in 0..100 {
            let q = &mut QUEUES[0];
            write_volatile(&mut q.avail[1], rnd() as u16);
            wr32(base + 0x50, rnd() as u32 % 4);
        }
        puts("garbage sent to device ");
        put_dec(id as u64);
        puts("\n");
    }
    // block device must still work after a clean re-initialization
    if let Some(base) = find_virtio(boot.cmdline, 2) {
        let mut vqs = [EMPTY_VQ];
        virtio_init(base, 0, &mut QUEUES[..1], &mut vqs);
        let s = blk_req(&mut vqs[0], 0, 0, buf(2), 512);
        let d = buf_slice(2, 512);
        let n = d.iter().position(|&c| c == 0 || c == b'\n').unwrap_or(32).min(64);
        puts("after garbage blk read status=");
        put_dec(s as u64);
        puts(" data=");
        put_bytes(&d[..n]);
        puts("\n");
    }
    puts("garbage survived\n");
    reset()
}

// --- restore ----------------------------------------------------------------------------------

/// Snapshot/restore with devices: writes the disk and sets up vsock before the snapshot, then
/// waits (counting) for the vsock TRANSPORT_RESET event that a restored VMM sends; afterwards
/// checks the disk, a vsock round trip and fresh rng bytes.
unsafe fn restore(boot: &Boot) -> ! {
    let (Some(blk_base), Some(vs_base), Some(rng_base)) =
        (find_virtio(boot.cmdline, 2), find_virtio(boot.cmdline, 19), find_virtio(boot.cmdline, 4))
    else {
        puts("restore mode needs blk, vsock and rng\n");
        reset()
    };
    let mut bq = [EMPTY_VQ];
    virtio_init(blk_base, 0, &mut QUEUES[0..1], &mut bq);
    let w = buf_slice(4, 512);
    w.fill(0);
    w[..16].copy_from_slice(b"BEFORE-SNAPSHOT\n");
    let s = blk_req(&mut bq[0], 1, 1, buf(4), 512);
    puts("restore: blk write status=");
    put_dec(s as u64);
    puts("\n");

    let mut vqs = [EMPTY_VQ, EMPTY_VQ, EMPTY_VQ];
    virtio_init(vs_base, 0, &mut QUEUES[1..4], &mut vqs);
    let [rx, tx, mut ev] = vqs;
    let cid = rd64(vs_base + 0x100);
    let mut v = Vsock { rx, tx, cid, fwd_cnt: 0, tx_cnt: 0, peer_buf_alloc: 0, peer_fwd_cnt: 0 };
    for i in 0..RX_BUFS {
        v.post_rx(i);
    }
    v.rx.notify();
    write_volatile(buf(31) as *mut u32, 0xffff_ffff);
    ev.set_desc(0, buf(31), 8, F_WRITE, 0);
    ev.push(0);
    ev.notify();

    let mut rq = [EMPTY_VQ];
    virtio_init(rng_base, 0, &mut QUEUES[4..5], &mut rq);

    puts("restore: ready for snapshot\n");
    let mut spins = 0u64;
    let (id, len) = loop {
        if let Some(x) = ev.pop() {
            break x;
        }
        spins += 1;
        let c = read_volatile(core::ptr::addr_of!(KILN_COUNTER)) + 1;
        write_volatile(core::ptr::addr_of_mut!(KILN_COUNTER), c);
        if spins & ((1 << 24) - 1) == 0 {
            puts("restore: waiting\n");
        }
    };
    puts("restore: vsock event head=");
    put_dec(id as u64);
    puts(" len=");
    put_dec(len as u64);
    puts(" id=");
    put_dec(read_volatile(buf(31) as *const u32) as u64);
    puts("\n");

    let s = blk_req(&mut bq[0], 0, 1, buf(5), 512);
    let d = buf_slice(5, 512);
    let n = d.iter().position(|&c| c == 0 || c == b'\n').unwrap_or(32).min(64);
    puts("restore: blk read1 status=");
    put_dec(s as u64);
    puts(" data=");
    put_bytes(&d[..n]);
    puts("\n");

    rq[0].set_desc(0, buf(2), 16, F_WRITE, 0);
    rq[0].push(0);
    rq[0].notify();
    rq[0].wait();
    puts("restore: rng=");
    put_hex_bytes(buf_slice(2, 16));
    puts("\n");
    // write the rng bytes to sector 2: each fork's overlay gets its own content
    let w = buf_slice(4, 512);
    w.fill(0);
    put_hex_into(&mut w[..32], buf_slice(2, 16));
    let s = blk_req(&mut bq[0], 1, 2, buf(4), 512);
    puts("restore: blk write2 status=");
    put_dec(s as u64);
    puts("\n");

    let host_port = parse_num(find_arg(boot.cmdline, b"kiln.vsock_port").unwrap_or(b"5000")) as u32;
    let gport = 41000u32;
    v.send(Pkt { src_port: gport, dst_port: host_port, op: OP_REQUEST, ..Pkt::default() }, &[]);
    let (p, _, rid) = v.recv();
    v.done(rid);
    if p.op != OP_RESPONSE {
        puts("restore: vsock connect refused\n");
        reset();
    }
    v.send(Pkt { src_port: gport, dst_port: host_port, op: OP_RW, ..Pkt::default() }, b"after-restore\n");
    let (p, data, rid) = v.recv();
    puts("restore: vsock reply=");
    if p.op == OP_RW {
        put_bytes(core::slice::from_raw_parts(data as *const u8, (p.len as usize).min(64)));
    } else {
        puts("op ");
        put_dec(p.op as u64);
        puts("\n");
    }
    v.done(rid);
    v.send(Pkt { src_port: gport, dst_port: host_port, op: OP_RST, ..Pkt::default() }, &[]);
    puts("restore: done\n");
    reset()
}

fn put_hex_into(dst: &mut [u8], src: &[u8]) {
    for (i, &x) in src.iter().enumerate() {
        let hex = |d: u8| if d < 10 { b'0' + d } else { b'a' + d - 10 };
        if 2 * i + 1 < dst.len() {
            dst[2 * i] = hex(x >> 4);
            dst[2 * i + 1] = hex(x & 0xf);
        }
    }
}
