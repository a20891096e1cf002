//! Finding the kiln-agent binary a template gets, and checking that it is statically linked.

use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// Finds the kiln-agent binary to install: `explicit`, else `$KILN_AGENT_BIN`, else next to the
/// running executable or in the cargo target dir's static build. It must be statically linked,
/// because it runs inside root filesystems whose libc kiln does not control.
pub fn find_agent(explicit: Option<&Path>) -> Result<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(p) = explicit {
        candidates.push(p.to_path_buf());
    } else if let Some(p) = std::env::var_os("KILN_AGENT_BIN").filter(|v| !v.is_empty()) {
        candidates.push(PathBuf::from(p));
    } else if let Ok(exe) = std::env::current_exe() {
        let mut dir = exe.parent().map(Path::to_path_buf);
        // target/<profile>/kiln, or target/<profile>/deps/<test> for tests.
        for _ in 0..3 {
            let Some(d) = dir else { break };
            candidates.push(d.join("kiln-agent"));
            for profile in ["release", "debug"] {
                candidates.push(
                    d.join("x86_64-unknown-linux-gnu")
                        .join(profile)
                        .join("kiln-agent"),
                );
            }
            dir = d.parent().map(Path::to_path_buf);
        }
    }
    let build_cmd = "RUSTFLAGS='-C target-feature=+crt-static' cargo build --release -p kiln-agent --target x86_64-unknown-linux-gnu";
    let mut dynamic = None;
    for c in &candidates {
        if !c.is_file() {
            continue;
        }
        match is_static_elf(c) {
            Ok(true) => return Ok(c.clone()),
            Ok(false) => dynamic = Some(c.clone()),
            Err(e) => {
                return Err(Error::Agent(format!(
                    "{} is not a readable ELF binary ({e})",
                    c.display()
                )))
            }
        }
    }
    if let Some(d) = dynamic {
        return Err(Error::Agent(format!(
            "{} is dynamically linked; templates need a static agent. Build it with:\n    {build_cmd}",
            d.display()
        )));
    }
    Err(Error::Agent(format!(
        "not found (looked at: {}). Build it with:\n    {build_cmd}\nor set KILN_AGENT_BIN",
        candidates
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    )))
}

/// True when the ELF file has no program interpreter (PT_INTERP), i.e. is statically linked.
pub fn is_static_elf(p: &Path) -> std::io::Result<bool> {
    let data = std::fs::read(p)?;
    let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "not a 64-bit ELF file");
    if data.len() < 64 || &data[..4] != b"\x7fELF" || data[4] != 2 {
        return Err(bad());
    }
    let u16_at = |o: usize| u16::from_le_bytes([data[o], data[o + 1]]) as usize;
    let phoff = u64::from_le_bytes(data[0x20..0x28].try_into().map_err(|_| bad())?) as usize;
    let phentsize = u16_at(0x36);
    let phnum = u16_at(0x38);
    for i in 0..phnum {
        let off = phoff + i * phentsize;
        let Some(ph) = data.get(off..off + 4) else {
            return Err(bad());
        };
        if u32::from_le_bytes(ph.try_into().map_err(|_| bad())?) == 3 {
            return Ok(false);
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn static_check_tells_static_from_dynamic() {
        // /bin/sh on any Debian is dynamically linked.
        assert!(!is_static_elf(Path::new("/bin/sh")).unwrap());
        let t = tempfile::tempdir().unwrap();
        let junk = t.path().join("junk");
        std::fs::write(&junk, b"#!/bin/sh\n").unwrap();
        assert!(is_static_elf(&junk).is_err());
        let e = find_agent(Some(Path::new("/bin/sh")))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("dynamically linked") && e.contains("crt-static"),
            "{e}"
        );
        let e = find_agent(Some(&t.path().join("missing")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("not found"), "{e}");
    }
}
