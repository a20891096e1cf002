//! Helpers shared by the template integration tests.

#![allow(dead_code)]

pub mod oci;
pub mod registry;
pub mod token;

use std::path::{Path, PathBuf};

/// A minimal static x86_64 ELF executable (exit(0)), so tests need no toolchain for an agent.
pub fn fake_static_agent(dir: &Path, exit_code: u8) -> PathBuf {
    let mut elf = Vec::new();
    let base: u64 = 0x400000;
    let code: [u8; 12] = [
        0xb8, 60, 0, 0, 0, // mov eax, 60 (exit)
        0xbf, exit_code, 0, 0, 0, // mov edi, code
        0x0f, 0x05, // syscall
    ];
    let entry = base + 64 + 56;
    // ELF header
    elf.extend_from_slice(b"\x7fELF\x02\x01\x01\0\0\0\0\0\0\0\0\0");
    elf.extend_from_slice(&2u16.to_le_bytes()); // ET_EXEC
    elf.extend_from_slice(&0x3eu16.to_le_bytes()); // x86_64
    elf.extend_from_slice(&1u32.to_le_bytes());
    elf.extend_from_slice(&entry.to_le_bytes());
    elf.extend_from_slice(&64u64.to_le_bytes()); // phoff
    elf.extend_from_slice(&0u64.to_le_bytes()); // shoff
    elf.extend_from_slice(&0u32.to_le_bytes());
    elf.extend_from_slice(&64u16.to_le_bytes());
    elf.extend_from_slice(&56u16.to_le_bytes());
    elf.extend_from_slice(&1u16.to_le_bytes());
    elf.extend_from_slice(&[0; 6]);
    // PT_LOAD covering the whole file
    let total = (64 + 56 + code.len()) as u64;
    elf.extend_from_slice(&1u32.to_le_bytes());
    elf.extend_from_slice(&5u32.to_le_bytes()); // R+X
    elf.extend_from_slice(&0u64.to_le_bytes());
    elf.extend_from_slice(&base.to_le_bytes());
    elf.extend_from_slice(&base.to_le_bytes());
    elf.extend_from_slice(&total.to_le_bytes());
    elf.extend_from_slice(&total.to_le_bytes());
    elf.extend_from_slice(&0x1000u64.to_le_bytes());
    elf.extend_from_slice(&code);
    let p = dir.join(format!("agent-{exit_code}"));
    std::fs::write(&p, elf).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    p
}
