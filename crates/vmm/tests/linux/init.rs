//! /init for the Linux-boot test's rootfs: a static binary (Rust std, glibc static) that mounts
//! /proc, /sys and /dev, prints `kiln-init: ready` on the console, then answers commands over
//! vsock port 1024: each line received is run with `/bin/sh -c` when a shell exists in the
//! rootfs, else with the few built-ins below; the output goes back on the connection.
//! Built by tests/linux_boot.rs with `rustc -C target-feature=+crt-static`.

use std::ffi::CString;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::FromRawFd;

#[repr(C)]
struct SockaddrVm {
    family: u16,
    reserved1: u16,
    port: u32,
    cid: u32,
    zero: [u8; 4],
}

extern "C" {
    fn socket(domain: i32, ty: i32, proto: i32) -> i32;
    fn bind(fd: i32, addr: *const SockaddrVm, len: u32) -> i32;
    fn listen(fd: i32, backlog: i32) -> i32;
    fn accept(fd: i32, addr: *mut u8, len: *mut u32) -> i32;
    fn mount(src: *const i8, target: *const i8, fstype: *const i8, flags: u64, data: *const u8) -> i32;
    fn reboot(cmd: i32) -> i32;
}

fn mnt(src: &str, target: &str, fs: &str) {
    let _ = std::fs::create_dir_all(target);
    let (s, t, f) = (CString::new(src).unwrap(), CString::new(target).unwrap(), CString::new(fs).unwrap());
    // SAFETY: valid NUL-terminated strings; no mount data.
    unsafe { mount(s.as_ptr(), t.as_ptr(), f.as_ptr(), 0, std::ptr::null()) };
}

fn run(cmd: &str) -> String {
    if std::path::Path::new("/bin/sh").exists() {
        return match std::process::Command::new("/bin/sh").arg("-c").arg(cmd).output() {
            Ok(o) => String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr),
            Err(e) => format!("sh failed: {e}\n"),
        };
    }
    let mut parts = cmd.splitn(2, ' ');
    match (parts.next().unwrap_or(""), parts.next().unwrap_or("")) {
        ("echo", rest) => format!("{rest}\n"),
        ("cat", path) => std::fs::read_to_string(path.trim()).unwrap_or_else(|e| format!("cat: {e}\n")),
        (other, _) => format!("unknown command {other}\n"),
    }
}

fn main() {
    mnt("proc", "/proc", "proc");
    mnt("sysfs", "/sys", "sysfs");
    mnt("devtmpfs", "/dev", "devtmpfs");
    // SAFETY: plain socket syscalls with a correctly sized sockaddr_vm.
    let fd = unsafe {
        let fd = socket(40 /* AF_VSOCK */, 1 /* SOCK_STREAM */, 0);
        let addr = SockaddrVm { family: 40, reserved1: 0, port: 1024, cid: u32::MAX, zero: [0; 4] };
        if fd < 0 || bind(fd, &addr, std::mem::size_of::<SockaddrVm>() as u32) != 0 || listen(fd, 8) != 0 {
            println!("kiln-init: vsock listen failed");
            reboot(0x0123_4567);
        }
        fd
    };
    println!("kiln-init: ready");
    loop {
        // SAFETY: accept on our listening socket; the new fd is owned by the File below.
        let c = unsafe { accept(fd, std::ptr::null_mut(), std::ptr::null_mut()) };
        if c < 0 {
            continue;
        }
        // SAFETY: `c` is a fresh connected socket fd owned by nobody else.
        let stream = unsafe { std::fs::File::from_raw_fd(c) };
        let mut out = stream.try_clone().unwrap();
        for line in BufReader::new(stream).lines() {
            let Ok(line) = line else { break };
            if line.trim() == "poweroff" {
                // SAFETY: LINUX_REBOOT_CMD_RESTART; ends the VM (the VMM treats reset as exit).
                unsafe { reboot(0x0123_4567) };
            }
            let _ = out.write_all(run(&line).as_bytes());
            let _ = out.write_all(b"--end--\n");
        }
    }
}
