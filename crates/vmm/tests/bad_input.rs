//! Bad input: each case is a clear error (exit status 1 and a message naming the problem), never
//! a crash. Guest-side garbage is covered in devices.rs.

mod common;

use std::time::Duration;

use common::*;
use serde_json::json;

fn fails_with(dir: &std::path::Path, name: &str, args: Args, needle: &str) {
    let (st, serial, stderr) = run_to_end(dir, name, args);
    assert_eq!(
        st.code(),
        Some(1),
        "{name}: expected a clean error exit; stderr:\n{stderr}\nserial:\n{serial}"
    );
    assert!(
        stderr.contains(needle),
        "{name}: stderr should mention {needle:?}:\n{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{name}: {stderr}");
}

#[test]
fn missing_or_invalid_kernel() {
    if !kvm_usable() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    fails_with(d, "nokernel", Args::empty(), "no kernel given");
    fails_with(
        d,
        "missing",
        Args::empty().arg("--kernel").arg("/nonexistent/vmlinux"),
        "does not exist",
    );
    let junk = d.join("junk");
    std::fs::write(&junk, b"this is not an ELF file at all").unwrap();
    fails_with(d, "junk", Args::empty().arg("--kernel").arg(&junk), "ELF");
    let kernel = || Args::empty().arg("--kernel").arg(guest64());
    fails_with(d, "mem", kernel().mem_mib(1), "out of range");
    fails_with(d, "vcpus", kernel().vcpus(0), "vcpus");
    fails_with(d, "cid", kernel().vsock(2, &d.join("s")), "cid");
}

#[test]
fn disk_image_not_multiple_of_512() {
    if !kvm_usable() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("odd.img");
    std::fs::write(&img, vec![0u8; 1000]).unwrap();
    let kernel = || Args::empty().arg("--kernel").arg(guest64());
    fails_with(
        dir.path(),
        "odd",
        kernel().disk_base(&img).disk_ro(),
        "not a multiple of 512",
    );
    fails_with(
        dir.path(),
        "nodisk",
        kernel().disk_base(std::path::Path::new("/nonexistent.img")),
        "/nonexistent.img",
    );
}

/// Takes a small snapshot of the counting guest.
fn take_snapshot(d: &std::path::Path) -> std::path::PathBuf {
    let snap = d.join("snap");
    let mut vm = spawn(d, "orig", Args::linux64("count").mem_mib(32));
    vm.wait_serial("count=", Duration::from_secs(60));
    vm.call(json!({"op": "snapshot", "dir": snap, "resume": false}));
    vm.call(json!({"op": "stop"}));
    vm.wait_exit(Duration::from_secs(30));
    snap
}

#[test]
fn corrupt_truncated_or_foreign_snapshots() {
    if !kvm_usable() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let snap = take_snapshot(d);
    let state = std::fs::read(snap.join("state.json")).unwrap();
    let copy = |name: &str| {
        let c = d.join(name);
        std::fs::create_dir_all(&c).unwrap();
        for f in ["state.json", "memory"] {
            std::fs::copy(snap.join(f), c.join(f)).unwrap();
        }
        c
    };

    // a flipped byte in the state
    let c = copy("flipped");
    let mut s = state.clone();
    let i = s.len() / 2;
    s[i] ^= 0x01;
    std::fs::write(c.join("state.json"), &s).unwrap();
    fails_with(d, "flipped", Args::restore(&c), "corrupt or truncated");

    // truncated state
    let c = copy("trunc");
    std::fs::write(c.join("state.json"), &state[..state.len() / 3]).unwrap();
    fails_with(d, "trunc", Args::restore(&c), "corrupt or truncated");

    // truncated memory file
    let c = copy("truncmem");
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(c.join("memory"))
        .unwrap();
    f.set_len(1 << 20).unwrap();
    fails_with(d, "truncmem", Args::restore(&c), "truncated");

    // another format version
    let c = copy("version");
    let text = String::from_utf8(state.clone()).unwrap();
    std::fs::write(
        c.join("state.json"),
        text.replacen("KILN-VMM-SNAPSHOT 1 ", "KILN-VMM-SNAPSHOT 999 ", 1),
    )
    .unwrap();
    fails_with(d, "version", Args::restore(&c), "format version 999");

    // not a snapshot at all / missing
    let c = copy("garbage");
    std::fs::write(c.join("state.json"), b"\x7fELF garbage").unwrap();
    fails_with(d, "garbage", Args::restore(&c), "not a kiln-vmm snapshot");
    fails_with(
        d,
        "missingdir",
        Args::restore(std::path::Path::new("/nonexistent-snapshot")),
        "/nonexistent-snapshot",
    );

    // valid checksum over a body that does not describe a VM
    let c = copy("wrongbody");
    let body = b"{\"hello\":1}";
    use sha2::Digest;
    let sum = hex::encode(sha2::Sha256::digest(body));
    let mut f = format!("KILN-VMM-SNAPSHOT 1 {sum}\n").into_bytes();
    f.extend_from_slice(body);
    std::fs::write(c.join("state.json"), f).unwrap();
    fails_with(d, "wrongbody", Args::restore(&c), "corrupt or truncated");

    // the untouched snapshot still restores
    let mut vm = spawn(d, "good", Args::restore(&snap));
    vm.wait_serial("count=", Duration::from_secs(60));
    vm.call(json!({"op": "stop"}));
    assert_eq!(vm.wait_exit(Duration::from_secs(30)).code(), Some(0));
}

#[test]
fn api_rejects_garbage_requests() {
    if !kvm_usable() {
        return;
    }
    use std::io::{Read, Write};
    let dir = tempfile::tempdir().unwrap();
    let mut vm = spawn(dir.path(), "vm", Args::linux64("count").paused());
    vm.wait_api();
    let mut s = std::os::unix::net::UnixStream::connect(&vm.api).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(b"not json\n{\"op\":\"snapshot\"}\n\xff\xfe\n")
        .unwrap();
    let mut got = String::new();
    let mut b = [0u8; 4096];
    while got.matches('\n').count() < 3 {
        let n = s.read(&mut b).unwrap();
        assert!(n > 0);
        got.push_str(&String::from_utf8_lossy(&b[..n]));
    }
    for line in got.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        assert_eq!(v["ok"], false, "{line}");
    }
    // an oversized line is refused and the connection closed; the VMM keeps serving
    let mut s2 = std::os::unix::net::UnixStream::connect(&vm.api).unwrap();
    let _ = s2.write_all(&vec![b'a'; 200 * 1024]);
    let st = vm.call(json!({"op": "stats"}));
    assert_eq!(st["state"], "paused");
    // snapshot into an unwritable place is an error, not a crash
    let r = kiln_vmm::api::call(
        &vm.api,
        &json!({"op": "snapshot", "dir": "/proc/kiln-no-such-dir/x"}),
    )
    .unwrap();
    assert_eq!(r["ok"], false, "{r}");
    vm.call(json!({"op": "stop"}));
    assert_eq!(vm.wait_exit(Duration::from_secs(30)).code(), Some(0));
}
