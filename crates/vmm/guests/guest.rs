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

use core::arch::global_asm;
use core::ptr::{read_volatile, write_volatile};

global_asm!(include_str!("boot.S"));

mod boot_info;
mod rt;
mod virtq;
mod vsock;

use boot_info::*;
use rt::*;
use virtq::*;
use vsock::*;

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
