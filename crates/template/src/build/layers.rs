//! Stage 2 of a build: what kiln adds on top of the base stage (kiln-agent, the compat preload
//! library) and the ext4 image of the result.

use std::fs::File;
use std::path::Path;
use std::process::Command;

use super::progress::Log;
use crate::{io_err, Result};

/// Source of the preload library installed in every template (see the file's comment).
pub(crate) const COMPAT_SOURCE: &str = include_str!("../../compat/kiln-compat.c");
/// Where the compat library lives inside every template.
pub const COMPAT_PATH_IN_ROOTFS: &str = "usr/lib/kiln/libkiln-compat.so";
/// Where the agent lives inside every template.
pub const AGENT_PATH_IN_ROOTFS: &str = "usr/bin/kiln-agent";

pub(super) fn install_agent(agent: &Path, rootfs: &Path) -> Result<()> {
    let dest = rootfs.join(AGENT_PATH_IN_ROOTFS);
    // The base stage is hard-linked: replace the entry, never write through a shared inode.
    let _ = std::fs::remove_file(&dest);
    std::fs::copy(agent, &dest).map_err(io_err(format!(
        "copying {} to {}",
        agent.display(),
        dest.display()
    )))?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&dest, std::fs::Permissions::from_mode(0o755))
        .map_err(io_err("chmod kiln-agent"))?;
    install_sudo_shim(rootfs)
}

/// Where templates that have sudo get kiln's sudo shim instead.
pub const SUDO_PATH_IN_ROOTFS: &str = "usr/bin/sudo";

/// gVisor sets "no new privileges" on every process, so setuid sudo cannot work: when the
/// template has sudo, `/usr/bin/sudo` becomes a link to kiln-agent, which runs as a shim for
/// the agent's privilege broker (crates/agent/src/sudo/).
fn install_sudo_shim(rootfs: &Path) -> Result<()> {
    let dest = rootfs.join(SUDO_PATH_IN_ROOTFS);
    if dest.symlink_metadata().is_err() {
        return Ok(());
    }
    // Replace the entry (the base stage is hard-linked).
    std::fs::remove_file(&dest).map_err(io_err(format!("removing {}", dest.display())))?;
    std::os::unix::fs::symlink("kiln-agent", &dest)
        .map_err(io_err(format!("linking {} to kiln-agent", dest.display())))
}

/// Compiles the compat preload library with the host C compiler (freestanding: it links against
/// nothing) and registers it in `/etc/ld.so.preload`.
pub(crate) fn install_compat(
    staging: &Path,
    rootfs: &Path,
    log: &mut Log,
) -> std::result::Result<(), ()> {
    let src = staging.join("kiln-compat.c");
    std::fs::write(&src, COMPAT_SOURCE).map_err(|e| log.line(&format!("write source: {e}")))?;
    let dest = rootfs.join(COMPAT_PATH_IN_ROOTFS);
    if let Some(dir) = dest.parent() {
        std::fs::create_dir_all(dir).map_err(|e| log.line(&format!("mkdir: {e}")))?;
    }
    let _ = std::fs::remove_file(&dest);
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = Command::new(&cc)
        .args(["-shared", "-fPIC", "-nostdlib", "-O2", "-Wall", "-o"])
        .arg(&dest)
        .arg(&src)
        .output()
        .map_err(|e| log.line(&format!("running {cc} (install gcc): {e}")))?;
    log.write(&out.stdout);
    log.write(&out.stderr);
    let _ = std::fs::remove_file(&src);
    if !out.status.success() {
        log.line(&format!("{cc} exited with {}", out.status));
        return Err(());
    }
    let preload = rootfs.join("etc/ld.so.preload");
    let mut lines = std::fs::read_to_string(&preload).unwrap_or_default();
    let entry = format!("/{COMPAT_PATH_IN_ROOTFS}");
    if !lines.lines().any(|l| l.trim() == entry) {
        lines.push_str(&entry);
        lines.push('\n');
    }
    // Replace, never write through: the base stage is hard-linked.
    let _ = std::fs::remove_file(&preload);
    std::fs::write(&preload, lines).map_err(|e| log.line(&format!("write ld.so.preload: {e}")))
}

/// Bytes used by a tree (hard links counted once).
pub(crate) fn tree_size(root: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut seen = std::collections::HashSet::new();
    let mut total = 0u64;
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let Ok(md) = e.path().symlink_metadata() else {
                continue;
            };
            if md.is_dir() {
                stack.push(e.path());
            }
            if seen.insert((md.dev(), md.ino())) {
                total += md.blocks() * 512;
            }
        }
    }
    total
}

pub(crate) fn make_ext4(
    rootfs: &Path,
    image: &Path,
    used: u64,
    log: &mut Log,
) -> std::result::Result<(), ()> {
    // Room for metadata plus 1 GiB of free space; the file is sparse, so this costs nothing.
    let size = (used + used / 4 + (1 << 30)).div_ceil(1 << 20) << 20;
    let f = File::create(image).map_err(|e| log.line(&format!("create image: {e}")))?;
    f.set_len(size)
        .map_err(|e| log.line(&format!("size image: {e}")))?;
    drop(f);
    let out = Command::new("mkfs.ext4")
        .args(["-q", "-F", "-L", "kiln-root", "-d"])
        .arg(rootfs)
        .arg(image)
        .output()
        .map_err(|e| log.line(&format!("running mkfs.ext4: {e}")))?;
    log.write(&out.stdout);
    log.write(&out.stderr);
    if out.status.success() {
        Ok(())
    } else {
        log.line(&format!("mkfs.ext4 exited with {}", out.status));
        Err(())
    }
}
