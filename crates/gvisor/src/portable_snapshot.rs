//! A snapshot moved to another host: the files that make it whole there, and adopting such
//! files as a snapshot of this host.
//!
//! What moves (relative to the driver's directory): `layers/<snapshot>.img` (the frozen
//! layer's ext4 image, synced first) and `snapshots/<snapshot>/checkpoint/*` (runsc's image of
//! memory and processes; none for a snapshot of the disk only). `snapshot.json` does not move:
//! it names this host's paths. Adopting puts the image in place as the same frozen layer
//! (mounted from it), the memory image in the snapshot's directory, and writes `snapshot.json`
//! last, naming the layer and the template's root filesystem of the receiving host, so the
//! usual restore starts sandboxes from it.
//!
//! Only a snapshot of a sandbox with a disk quota (its layer an image) stacked directly on
//! its template moves: a sandbox restored from a snapshot stacks on further frozen layers.

use std::path::{Path, PathBuf};

use super::portable::{files_under, fresh_dir, syncfs, IMAGE_DIR};
use super::snapshot::{disk_usage, read_meta, write_meta};
use super::{check_id, disk, GvisorDriver};
use crate::driver::{io_err, DriverError, PortablePause, Result, SnapshotRef};

impl GvisorDriver {
    fn incoming_snapshot_path(&self, snap: &SnapshotRef) -> PathBuf {
        self.cfg
            .dir
            .join("incoming")
            .join(format!("snapshot-{}", snap.0))
    }

    pub(super) async fn export_snapshot(&self, snap: &SnapshotRef) -> Result<PortablePause> {
        let sdir = self.snapshot_dir(snap)?;
        let meta = read_meta(&sdir, snap)?;
        let layer = self.layer_dir(snap);
        let image = disk::layer_image(&layer);
        if meta.lowers.len() != 2 || meta.lowers[0] != layer || !image.is_file() {
            return Err(DriverError::NotImplemented(
                "moving a snapshot of a sandbox without a disk quota or restored from a snapshot",
            ));
        }
        // The layer's filesystem is mounted (read-only) from its image: what the source wrote
        // last may still be in the host's page cache.
        if super::mounts::is_mounted(&layer) {
            syncfs(&layer)?;
        }
        let root = self.cfg.dir.clone();
        let mut files = vec![image
            .strip_prefix(&root)
            .map_err(|_| DriverError::Other("a layer outside the driver's directory".into()))?
            .to_path_buf()];
        let memory = Path::new("snapshots").join(&snap.0).join(IMAGE_DIR);
        if root.join(&memory).join("checkpoint.img").is_file() {
            files_under(&root, &memory, &mut files)?;
        }
        Ok(PortablePause { dir: root, files })
    }

    pub(super) async fn fresh_incoming_snapshot(&self, snap: &SnapshotRef) -> Result<PathBuf> {
        check_id(&snap.0)?;
        if self.snapshot_dir(snap)?.exists() {
            return Err(DriverError::Other(format!(
                "snapshot {} is on this host already",
                snap.0
            )));
        }
        let dir = self.incoming_snapshot_path(snap);
        fresh_dir(&dir)?;
        Ok(dir)
    }

    pub(super) async fn adopt_incoming_snapshot(
        &self,
        snap: &SnapshotRef,
        rootfs: &Path,
    ) -> Result<u64> {
        let sdir = self.snapshot_dir(snap)?;
        let incoming = self.incoming_snapshot_path(snap);
        let layer = self.layer_dir(snap);
        // Nothing names the layer on disk until snapshot.json does: the clean-up leaves it.
        let _making = self.making.hold(layer.clone());
        let placed = self.place_snapshot(snap, &incoming, &sdir, rootfs).await;
        let _ = std::fs::remove_dir_all(&incoming);
        if placed.is_err() {
            let _ = std::fs::remove_dir_all(&sdir);
        }
        placed?;
        Ok(disk_usage(&sdir) + disk_usage(&disk::layer_image(&layer)))
    }

    /// Puts the files laid out in `incoming` in place as snapshot `snap` (directory `sdir`)
    /// stacked on `rootfs`; `snapshot.json` last.
    async fn place_snapshot(
        &self,
        snap: &SnapshotRef,
        incoming: &Path,
        sdir: &Path,
        rootfs: &Path,
    ) -> Result<()> {
        let layer = self.layer_dir(snap);
        let moved = incoming.join("layers").join(format!("{}.img", snap.0));
        let image = disk::layer_image(&layer);
        // A layer this host has already (an earlier copy of the snapshot still used by its
        // sandboxes) is the same bytes: it stays as it is.
        if !image.exists() {
            if !moved.is_file() {
                return Err(DriverError::Other(format!(
                    "the moved snapshot {} has no layer image",
                    snap.0
                )));
            }
            std::fs::create_dir_all(self.cfg.dir.join("layers"))
                .map_err(io_err("creating layers"))?;
            std::fs::rename(&moved, &image).map_err(io_err("placing the moved layer image"))?;
        }
        disk::ensure_layer(&layer).await?;
        std::fs::create_dir_all(sdir).map_err(io_err(format!("creating {}", sdir.display())))?;
        let memory = incoming.join("snapshots").join(&snap.0).join(IMAGE_DIR);
        let dest = sdir.join(IMAGE_DIR);
        if memory.join("checkpoint.img").is_file() {
            std::fs::rename(&memory, &dest).map_err(io_err("placing the moved memory image"))?;
        } else {
            std::fs::create_dir_all(&dest)
                .map_err(io_err(format!("creating {}", dest.display())))?;
        }
        write_meta(sdir, vec![layer, rootfs.to_path_buf()])
    }
}
