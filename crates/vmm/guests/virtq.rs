//! A polled virtio-mmio (version 2) driver for the test guest: split queues of 16 descriptors in
//! static pages, device initialization, and the static data buffers.

use core::ptr::{read_volatile, write_volatile};
use core::sync::atomic::{fence, Ordering};

use crate::rt::*;
// ---------------------------------------------------------------------------------------------
// virtio-mmio driver (modern, polled)

pub const QSZ: usize = 16;

#[repr(C, align(4096))]
pub struct VirtQueue {
    pub desc: [[u64; 2]; QSZ],     // addr, (len u32 | flags u16 << 32 | next u16 << 48)
    pub avail: [u16; 3 + QSZ],     // flags, idx, ring[QSZ], used_event
    pub _pad: [u8; 4096 - 16 * QSZ - 2 * (3 + QSZ)],
    pub used: [u32; 2 + 2 * QSZ],  // flags|idx, ring (id, len)
}

pub struct Vq {
    pub q: *mut VirtQueue,
    pub base: u64,
    pub index: u32,
    pub avail_idx: u16,
    pub last_used: u16,
}

pub const F_NEXT: u16 = 1;
pub const F_WRITE: u16 = 2;

impl Vq {
    pub unsafe fn set_desc(&mut self, i: usize, addr: u64, len: u32, flags: u16, next: u16) {
        let d = &mut (*self.q).desc[i];
        write_volatile(&mut d[0], addr);
        write_volatile(&mut d[1], len as u64 | (flags as u64) << 32 | (next as u64) << 48);
    }
    pub unsafe fn push(&mut self, head: u16) {
        let a = &mut (*self.q).avail;
        write_volatile(&mut a[2 + (self.avail_idx as usize % QSZ)], head);
        fence(Ordering::SeqCst);
        self.avail_idx = self.avail_idx.wrapping_add(1);
        write_volatile(&mut a[1], self.avail_idx);
        fence(Ordering::SeqCst);
    }
    pub unsafe fn notify(&self) {
        wr32(self.base + 0x50, self.index);
    }
    pub unsafe fn used_idx(&self) -> u16 {
        (read_volatile(&(*self.q).used[0]) >> 16) as u16
    }
    /// Returns (descriptor head, written length) of the next used element, if any.
    pub unsafe fn pop(&mut self) -> Option<(u32, u32)> {
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
    pub unsafe fn wait(&mut self) -> (u32, u32) {
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
pub unsafe fn virtio_init(base: u64, want_low: u32, queues: &mut [VirtQueue], out: &mut [Vq]) -> u32 {
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

pub const EMPTY_VQ: Vq = Vq { q: core::ptr::null_mut(), base: 0, index: 0, avail_idx: 0, last_used: 0 };

#[repr(C, align(4096))]
pub struct Page(pub [u8; 4096]);

// SAFETY: all-zero bytes are a valid value for these plain-data arrays.
pub static mut QUEUES: [VirtQueue; 5] = unsafe { core::mem::zeroed() };
// SAFETY: as above.
pub static mut BUF: [Page; 40] = unsafe { core::mem::zeroed() };

pub fn buf(i: usize) -> u64 {
    // SAFETY: only the address is taken.
    unsafe { core::ptr::addr_of!(BUF[i]) as u64 }
}

pub unsafe fn buf_slice(i: usize, len: usize) -> &'static mut [u8] {
    core::slice::from_raw_parts_mut(buf(i) as *mut u8, len)
}
