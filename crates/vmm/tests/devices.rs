//! Device tests with the test guest: virtio-blk over a CoW overlay (base never written), read-only
//! mode, virtio-rng, vsock echo in both directions through the hybrid Unix sockets, and a guest
//! that writes garbage to every device register and queue.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use common::*;

fn make_base(path: &std::path::Path, len: usize) {
    let mut img = vec![0u8; len];
    let tag = b"KILN-BASE-SECTOR0\n";
    img[..tag.len()].copy_from_slice(tag);
    for (i, b) in img[4096..].iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    std::fs::write(path, img).unwrap();
}

fn allocated_bytes(path: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).unwrap().blocks() * 512
}

#[test]
fn block_cow_overlay_keeps_base_untouched() {
    if !kvm_usable() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.img");
    let ov = dir.path().join("vm1.overlay");
    make_base(&base, 8 << 20);
    let base_hash = sha256(&base);
    let a = Args::linux64("blk").disk_base(&base).disk_overlay(&ov);
    let (st, serial, stderr) = run_to_end(dir.path(), "vm1", a.clone());
    assert_eq!(st.code(), Some(0), "serial:\n{serial}\nstderr:\n{stderr}");
    assert!(serial.contains("blk capacity=16384 rw"), "{serial}");
    assert!(
        serial.contains("blk read0 status=0 data=KILN-BASE-SECTOR0"),
        "{serial}"
    );
    assert!(
        serial.contains("blk read1 status=0 data=\n"),
        "fresh overlay reads the base: {serial}"
    );
    assert!(serial.contains("blk write status=0"), "{serial}");
    assert!(serial.contains("blk flush status=0"), "{serial}");
    assert!(serial.contains("blk readback ok"), "{serial}");
    assert!(
        serial.contains("blk oob status=1"),
        "out-of-range read must fail: {serial}"
    );
    // the base is byte-for-byte unchanged; the write is in the overlay
    assert_eq!(sha256(&base), base_hash);
    let o = std::fs::read(&ov).unwrap();
    assert_eq!(o.len(), 8 << 20, "overlay has the disk's size");
    assert_eq!(&o[512..512 + 19], b"GUEST-WROTE-SECTOR1");
    // sector 0 was not written: the CoW copy of block 0 carries the base content there
    assert_eq!(&o[..17], b"KILN-BASE-SECTOR0");
    // sparse: only the two touched 4 KiB blocks (sectors 1..=8 span blocks 0 and 1)
    assert!(
        allocated_bytes(&ov) <= 64 * 1024,
        "overlay allocated {} bytes",
        allocated_bytes(&ov)
    );
    // a second boot with the same overlay sees the guest's earlier write
    let (st, serial, _) = run_to_end(dir.path(), "vm2", a);
    assert_eq!(st.code(), Some(0));
    assert!(
        serial.contains("blk read1 status=0 data=GUEST-WROTE-SECTOR1"),
        "{serial}"
    );
    assert_eq!(sha256(&base), base_hash);
}

#[test]
fn block_read_only_rejects_writes() {
    if !kvm_usable() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.img");
    make_base(&base, 1 << 20);
    let base_hash = sha256(&base);
    let (st, serial, stderr) = run_to_end(
        dir.path(),
        "vm",
        Args::pvh("blk").disk_base(&base).disk_ro(),
    );
    assert_eq!(st.code(), Some(0), "serial:\n{serial}\nstderr:\n{stderr}");
    assert!(serial.contains("blk capacity=2048 ro"), "{serial}");
    assert!(
        serial.contains("blk read0 status=0 data=KILN-BASE-SECTOR0"),
        "{serial}"
    );
    assert!(
        serial.contains("blk write status=1"),
        "write on a read-only disk must fail: {serial}"
    );
    assert_eq!(sha256(&base), base_hash);
}

#[test]
fn rng_delivers_fresh_host_bytes() {
    if !kvm_usable() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (st, serial, stderr) = run_to_end(dir.path(), "vm", Args::linux64("rng").rng());
    assert_eq!(st.code(), Some(0), "serial:\n{serial}\nstderr:\n{stderr}");
    let bytes: Vec<&str> = serial
        .lines()
        .filter(|l| l.starts_with("rng"))
        .map(|l| {
            assert!(l.contains("len=32"), "{l}");
            l.rsplit("bytes=").next().unwrap()
        })
        .collect();
    assert_eq!(bytes.len(), 2, "{serial}");
    assert_eq!(bytes[0].len(), 64);
    assert_ne!(bytes[0], bytes[1]);
    assert_ne!(bytes[0], "0".repeat(64));
}

#[test]
fn vsock_echo_both_directions() {
    if !kvm_usable() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let uds = dir.path().join("v.sock");
    // guest -> host: the guest connects to host port 5000, i.e. <uds>_5000
    let listener = host_listener(format!("{}_5000", uds.display()));
    let g2h = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let mut b = [0u8; 16];
        s.read_exact(&mut b).unwrap();
        s.write_all(&b).unwrap();
        b
    });
    let mut vm = spawn(
        dir.path(),
        "vm",
        Args::linux64("vsock kiln.vsock_port=5000").vsock(7, &uds),
    );
    vm.wait_serial("vsock listening 1234", Duration::from_secs(60));
    assert_eq!(&g2h.join().unwrap(), b"ping-from-guest\n");
    let s = vm.serial_text();
    assert!(s.contains("vsock cid=7"), "{s}");
    assert!(s.contains("vsock g2h echo: ping-from-guest"), "{s}");

    // host -> guest: CONNECT 1234, then 256 KiB through the guest's echo (exercises credit)
    let mut c = UnixStream::connect(&uds).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    c.write_all(b"CONNECT 1234\n").unwrap();
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while b[0] != b'\n' {
        c.read_exact(&mut b).unwrap();
        line.push(b[0]);
    }
    let line = String::from_utf8(line).unwrap();
    assert!(
        line.starts_with("OK ") && line.trim()[3..].parse::<u32>().is_ok(),
        "{line:?}"
    );
    let data: Vec<u8> = (0..256 * 1024u32).map(|i| (i * 7 % 253) as u8).collect();
    let mut reader = c.try_clone().unwrap();
    let want = data.len();
    let rd = std::thread::spawn(move || {
        let mut got = vec![0u8; want];
        reader.read_exact(&mut got).unwrap();
        got
    });
    c.write_all(&data).unwrap();
    let got = rd.join().unwrap();
    assert!(got == data, "echoed bytes differ");
    c.shutdown(std::net::Shutdown::Write).unwrap();
    let s = vm.wait_serial("vsock h2g done", Duration::from_secs(60));
    assert!(s.contains(&format!("echoed={}", 256 * 1024)), "{s}");
    assert_eq!(vm.wait_exit(Duration::from_secs(30)).code(), Some(0));
}

#[test]
fn vsock_rejects_bad_connect_lines_and_unknown_ports() {
    if !kvm_usable() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let uds = dir.path().join("v.sock");
    // nobody listens on <uds>_5000: the guest's connect is refused with RST
    let mut vm = spawn(dir.path(), "vm", Args::linux64("vsock").vsock(3, &uds));
    let s = vm.wait_serial("vsock g2h connect refused", Duration::from_secs(60));
    assert!(s.contains("op=3"), "{s}");
    assert_eq!(vm.wait_exit(Duration::from_secs(30)).code(), Some(0));
}

#[test]
fn garbage_from_guest_is_an_isolated_device_failure() {
    if !kvm_usable() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.img");
    make_base(&base, 1 << 20);
    let ov = dir.path().join("ov");
    let uds = dir.path().join("v.sock");
    let (st, serial, stderr) = run_to_end(
        dir.path(),
        "vm",
        Args::pvh("garbage")
            .disk_base(&base)
            .disk_overlay(&ov)
            .rng()
            .vsock(3, &uds),
    );
    assert_eq!(st.code(), Some(0), "serial:\n{serial}\nstderr:\n{stderr}");
    for id in [2, 4, 19] {
        assert!(
            serial.contains(&format!("garbage sent to device {id}")),
            "{serial}"
        );
    }
    assert!(
        serial.contains("after garbage blk read status=0 data=KILN-BASE-SECTOR0"),
        "{serial}"
    );
    assert!(serial.contains("garbage survived"), "{serial}");
}

fn main_thread_cpu_ticks(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/stat")).unwrap();
    let after = s.rsplit(')').next().unwrap();
    let f: Vec<&str> = after.split_whitespace().collect();
    // fields 14 and 15 (utime, stime) are at 11 and 12 after the ")"
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

#[test]
fn vsock_connections_before_the_driver_is_up_are_refused_without_spinning() {
    if !kvm_usable() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let uds = dir.path().join("v.sock");
    let mut vm = spawn(dir.path(), "vm", Args::linux64("count").vsock(3, &uds));
    vm.wait_serial("count=", Duration::from_secs(60));
    let mut c = UnixStream::connect(&uds).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    // the VMM may already have closed the socket (EPIPE): that is the refusal we expect
    let _ = c.write_all(b"CONNECT 1234\n");
    let mut b = [0u8; 16];
    assert_eq!(
        c.read(&mut b).unwrap_or(0),
        0,
        "the connection must be closed"
    );
    let pid = vm.pid();
    let t0 = main_thread_cpu_ticks(pid);
    std::thread::sleep(Duration::from_secs(1));
    let used = main_thread_cpu_ticks(pid) - t0;
    // the event loop must be idle (clock ticks are 1/100 s; a busy loop would use ~100)
    assert!(used < 50, "VMM event loop used {used} ticks in 1 s");
    vm.call(serde_json::json!({"op": "stop"}));
    vm.wait_exit(Duration::from_secs(30));
}
