//! The per-sandbox disk quota: a sandbox's writable layer lives on its own ext4 filesystem, a
//! sparse image file of the sandbox's disk size loop-mounted on the host, so writes beyond the
//! size get ENOSPC inside the sandbox and nothing outside it fills up.
//!
//! Per sandbox (`disk_mb` > 0): `disk.img` (the image; it takes host space only for what is
//! written), mounted at `disk/`, holding the overlay's `upper/` and `work/`. Without a quota the
//! layer is `upper/` and `work/` in the sandbox directory, as before.
//!
//! Snapshots freeze the writable layer in place instead of renaming it (a rename cannot leave a
//! filesystem): `disk/upper` is bind-mounted read-only at `<state>/gvisor/layers/<snapshot>`
//! (the path a frozen layer always has), the image moves next to it as `<snapshot>.img`, and the
//! sandbox continues on a fresh image of the same size. A frozen layer's mount is taken down
//! (and its image removed) when the layer is garbage-collected; after a host reboot
//! [`ensure_layer`] mounts it again from its image.

use std::path::{Path, PathBuf};

use super::mounts::{is_mounted, mount_call, unmount};
use crate::driver::{io_err, DriverError, Result};

/// The image of a sandbox's writable filesystem (in the sandbox directory).
pub const IMAGE: &str = "disk.img";
/// Where the image is mounted (in the sandbox directory).
pub const MOUNT: &str = "disk";

/// The writable layer's `upper` and `work` directories of the sandbox in `dir`.
pub fn layer_dirs(dir: &Path) -> (PathBuf, PathBuf) {
    if dir.join(IMAGE).exists() {
        (dir.join(MOUNT).join("upper"), dir.join(MOUNT).join("work"))
    } else {
        (dir.join("upper"), dir.join("work"))
    }
}

/// The image file of frozen layer `layer` (`layers/<snapshot>.img`).
pub fn layer_image(layer: &Path) -> PathBuf {
    layer.with_extension("img")
}

async fn run(cmd: &str, args: &[&std::ffi::OsStr]) -> Result<()> {
    let out = tokio::process::Command::new(cmd)
        .args(args)
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .map_err(io_err(format!(
            "running {cmd} (install e2fsprogs and util-linux)"
        )))?;
    if !out.status.success() {
        return Err(DriverError::Other(format!(
            "{cmd} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// Makes a sparse ext4 image of `mb` MiB at `image`. No reserved blocks (the sandbox may use
/// all of it); the journal and inode tables are initialised lazily, so the image starts at a
/// few hundred KiB of host disk.
pub async fn make_image(image: &Path, mb: u32) -> Result<()> {
    let f =
        std::fs::File::create(image).map_err(io_err(format!("creating {}", image.display())))?;
    f.set_len(u64::from(mb) << 20)
        .map_err(io_err(format!("sizing {}", image.display())))?;
    drop(f);
    run(
        "mkfs.ext4",
        &[
            "-q".as_ref(),
            "-F".as_ref(),
            "-m".as_ref(),
            "0".as_ref(),
            "-E".as_ref(),
            "lazy_itable_init=1,lazy_journal_init=1,nodiscard".as_ref(),
            image.as_os_str(),
        ],
    )
    .await
}

/// The fresh image a sandbox continues on after its layer is frozen (made ahead of time by
/// [`make_next_image`], e.g. while the sandbox is being checkpointed).
const NEXT_IMAGE: &str = "disk.next.img";

/// Makes the fresh image of the sandbox in `dir`, of its disk's size, for [`freeze`] (nothing
/// for a sandbox without its own disk). On error nothing is left.
pub async fn make_next_image(dir: &Path) -> Result<()> {
    let image = dir.join(IMAGE);
    let Ok(meta) = std::fs::metadata(&image) else {
        return Ok(());
    };
    let fresh = dir.join(NEXT_IMAGE);
    let made = make_image(&fresh, (meta.len() >> 20) as u32).await;
    if made.is_err() {
        let _ = std::fs::remove_file(&fresh);
    }
    made
}

/// Removes an image [`make_next_image`] made that [`freeze`] did not use.
pub fn drop_next_image(dir: &Path) {
    let _ = std::fs::remove_file(dir.join(NEXT_IMAGE));
}

/// Loop-mounts `image` at `target` (the loop device goes away with the last unmount).
pub async fn mount_image(image: &Path, target: &Path) -> Result<()> {
    std::fs::create_dir_all(target).map_err(io_err(format!("creating {}", target.display())))?;
    run(
        "mount",
        &[
            "-t".as_ref(),
            "ext4".as_ref(),
            "-o".as_ref(),
            "loop,noatime".as_ref(),
            image.as_os_str(),
            target.as_os_str(),
        ],
    )
    .await
}

/// Creates the sandbox's disk of `mb` MiB in `dir` and mounts it, with empty `upper` and `work`.
pub async fn create(dir: &Path, mb: u32) -> Result<()> {
    let image = dir.join(IMAGE);
    make_image(&image, mb).await?;
    mount(dir).await
}

/// Mounts the sandbox's disk in `dir` (if not mounted yet) and makes sure the layer's
/// directories exist.
pub async fn mount(dir: &Path) -> Result<()> {
    let target = dir.join(MOUNT);
    if !is_mounted(&target) {
        mount_image(&dir.join(IMAGE), &target).await?;
    }
    let (upper, work) = layer_dirs(dir);
    for d in [&upper, &work] {
        std::fs::create_dir_all(d).map_err(io_err(format!("creating {}", d.display())))?;
    }
    Ok(())
}

/// Unmounts the sandbox's disk in `dir`, if it has one.
pub fn unmount_disk(dir: &Path) -> Result<()> {
    unmount(&dir.join(MOUNT))
}

fn bind_read_only(source: &Path, target: &Path) -> Result<()> {
    std::fs::create_dir_all(target).map_err(io_err(format!("creating {}", target.display())))?;
    mount_call(Some(source), target, None, libc::MS_BIND, None, || {
        format!("bind-mounting {} at {}", source.display(), target.display())
    })?;
    let flags = libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY;
    if let Err(e) = mount_call(None, target, None, flags, None, || {
        format!("making {} read-only", target.display())
    }) {
        let _ = unmount(target);
        return Err(e);
    }
    Ok(())
}

/// Freezes the (stopped, unmounted) overlay's writable layer of the sandbox in `dir` as the
/// read-only layer `layer`, and gives the sandbox a fresh disk of the same size. On an error
/// before the fresh disk is mounted, the sandbox's own disk is left as it was.
pub async fn freeze(dir: &Path, layer: &Path) -> Result<()> {
    let image = dir.join(IMAGE);
    let fresh = dir.join(NEXT_IMAGE);
    if !fresh.exists() {
        make_next_image(dir).await?;
    }
    if let Err(e) = freeze_last(dir, layer) {
        let _ = std::fs::remove_file(&fresh);
        return Err(e);
    }
    std::fs::rename(&fresh, &image).map_err(io_err(format!("renaming {}", fresh.display())))?;
    mount(dir).await
}

/// Freezes the (stopped, unmounted) overlay's writable layer of the sandbox in `dir` as the
/// read-only layer `layer`, leaving the sandbox without a disk (it ends). On an error before
/// its image moved, the sandbox's own disk is left as it was.
pub fn freeze_last(dir: &Path, layer: &Path) -> Result<()> {
    let image = dir.join(IMAGE);
    let (upper, _) = layer_dirs(dir);
    bind_read_only(&upper, layer)?;
    if let Err(e) = std::fs::rename(&image, layer_image(layer)) {
        let _ = unmount(layer);
        return Err(DriverError::Io {
            what: format!("moving {}", image.display()),
            source: e,
        });
    }
    // The frozen layer keeps the filesystem alive through its bind mount.
    unmount(&dir.join(MOUNT))
}

/// Mounts frozen layer `layer` from its image if it has one and is not mounted (after a host
/// reboot); layers frozen without a disk quota are plain directories and need nothing.
pub async fn ensure_layer(layer: &Path) -> Result<()> {
    let image = layer_image(layer);
    if !image.exists() || is_mounted(layer) {
        return Ok(());
    }
    let tmp = layer.with_extension("mnt");
    mount_image(&image, &tmp).await?;
    let r = bind_read_only(&tmp.join("upper"), layer);
    let _ = unmount(&tmp);
    let _ = std::fs::remove_dir(&tmp);
    r
}

/// Takes down frozen layer `layer`: its mount (if any), its directory and its image.
pub fn remove_layer(layer: &Path) -> std::io::Result<()> {
    if is_mounted(layer) {
        unmount(layer).map_err(|e| std::io::Error::other(e.to_string()))?;
    }
    match std::fs::remove_file(layer_image(layer)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    match std::fs::remove_dir_all(layer) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_paths() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(layer_dirs(d.path()).0, d.path().join("upper"));
        std::fs::write(d.path().join(IMAGE), b"").unwrap();
        assert_eq!(layer_dirs(d.path()).1, d.path().join("disk/work"));
        assert_eq!(
            layer_image(Path::new("/s/layers/snap1")),
            Path::new("/s/layers/snap1.img")
        );
    }
}
