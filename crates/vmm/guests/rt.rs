//! Freestanding support (mem* functions, panic handler), port I/O, the serial console, reset, and
//! volatile physical-memory access for the test guest.

use core::arch::asm;
use core::ptr::{read_volatile, write_volatile};
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
pub fn panic(_: &core::panic::PanicInfo) -> ! {
    puts("guest panic\n");
    reset()
}

// ---------------------------------------------------------------------------------------------
// port I/O, serial, reset

pub fn outb(port: u16, v: u8) {
    // SAFETY: ring 3 with IOPL=3 may do port I/O; the VMM emulates the port.
    unsafe { asm!("out dx, al", in("dx") port, in("al") v, options(nostack, nomem)) }
}

pub fn putc(c: u8) {
    outb(0x3f8, c);
}

pub fn puts(s: &str) {
    for b in s.bytes() {
        putc(b);
    }
}

pub fn put_bytes(s: &[u8]) {
    for &b in s {
        putc(b);
    }
}

pub fn put_dec(mut v: u64) {
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

pub fn put_hex(v: u64) {
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

pub fn put_hex_bytes(b: &[u8]) {
    for &x in b {
        let hi = x >> 4;
        let lo = x & 0xf;
        putc(if hi < 10 { b'0' + hi } else { b'a' + hi - 10 });
        putc(if lo < 10 { b'0' + lo } else { b'a' + lo - 10 });
    }
}

pub fn reset() -> ! {
    outb(0x64, 0xfe);
    loop {
        core::hint::spin_loop();
    }
}

pub unsafe fn rd8(a: u64) -> u8 {
    read_volatile(a as *const u8)
}
pub unsafe fn rd32(a: u64) -> u32 {
    read_volatile(a as *const u32)
}
pub unsafe fn rd64(a: u64) -> u64 {
    read_volatile(a as *const u64)
}
pub unsafe fn wr32(a: u64, v: u32) {
    write_volatile(a as *mut u32, v)
}
