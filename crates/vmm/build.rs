//! Builds the freestanding test guests (guests/guest.rs and its modules + guests/boot.S) with the same rustc that
//! builds this crate, for the host target, linked by the system linker with guests/guest.ld.
//! Two variants: `kiln-test-guest-pvh.elf` (with the PVH entry note) and `kiln-test-guest-64.elf`
//! (without it, so the VMM uses the 64-bit Linux boot protocol). No downloads.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    let guests = manifest.join("guests");
    for f in [
        "guest.rs",
        "rt.rs",
        "boot_info.rs",
        "virtq.rs",
        "vsock.rs",
        "boot.S",
        "guest.ld",
    ] {
        println!("cargo:rerun-if-changed={}", guests.join(f).display());
    }
    let script = std::fs::read_to_string(guests.join("guest.ld")).expect("read guests/guest.ld");
    let no_pvh = script.replace(
        "    .note.pvh : { KEEP(*(.note.pvh)) } :image :note\n",
        "    /DISCARD/ : { *(.note.pvh) }\n",
    );
    assert_ne!(script, no_pvh, "guest.ld must contain the .note.pvh line");
    let ld64 = out.join("guest-64.ld");
    std::fs::write(&ld64, no_pvh).unwrap();
    build(
        &guests.join("guest.rs"),
        &guests.join("guest.ld"),
        &out.join("kiln-test-guest-pvh.elf"),
        &out,
    );
    build(
        &guests.join("guest.rs"),
        &ld64,
        &out.join("kiln-test-guest-64.elf"),
        &out,
    );
    println!(
        "cargo:rustc-env=KILN_TEST_GUEST_PVH={}",
        out.join("kiln-test-guest-pvh.elf").display()
    );
    println!(
        "cargo:rustc-env=KILN_TEST_GUEST_64={}",
        out.join("kiln-test-guest-64.elf").display()
    );
}

fn build(src: &Path, script: &Path, dst: &Path, out: &Path) {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let tmp = out.join(format!("{}.d", dst.file_name().unwrap().to_string_lossy()));
    std::fs::create_dir_all(&tmp).unwrap();
    let status = Command::new(rustc)
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .env_remove("RUSTFLAGS")
        .args([
            "--edition",
            "2021",
            "--crate-type",
            "bin",
            "--crate-name",
            "kiln_test_guest",
        ])
        .args(["--target", "x86_64-unknown-linux-gnu"])
        .args([
            "-C",
            "opt-level=2",
            "-C",
            "panic=abort",
            "-C",
            "debuginfo=0",
        ])
        .args(["-C", "relocation-model=static", "-C", "code-model=small"])
        .args([
            "-C",
            "link-arg=-nostdlib",
            "-C",
            "link-arg=-nostartfiles",
            "-C",
            "link-arg=-static",
        ])
        .args([
            "-C",
            "link-arg=-no-pie",
            "-C",
            "link-arg=-Wl,--build-id=none",
        ])
        .arg("-C")
        .arg(format!("link-arg=-Wl,-T,{}", script.display()))
        .arg("--out-dir")
        .arg(&tmp)
        .arg(src)
        .status()
        .expect("run rustc for the test guest");
    assert!(
        status.success(),
        "building the test guest {} failed",
        dst.display()
    );
    std::fs::copy(tmp.join("kiln_test_guest"), dst).unwrap();
}
