//! Ready-made disk images: formatting a sandbox's ext4 image (`mkfs.ext4`, 10–55 ms measured
//! on the 2-core test host) is taken off the create path by keeping [`DEPTH`] formatted sparse
//! images of each disk size in use, made in the background like warm sandboxes. A create takes
//! one (a rename) and only mounts it; the pool refills behind it. A size seen for the first time,
//! or a pool drained by a burst of creates, is formatted on the spot as before.
//!
//! The images live in `<state>/gvisor/disk-pool/<mb>-<n>.img` (a few hundred KiB of host disk
//! each: sparse, inode tables initialised lazily) and are never mounted there, so the pool holds
//! no host resources beyond those files; it is emptied at start and on shutdown.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::disk;
use crate::driver::Result;

/// Images kept ready per disk size.
pub const DEPTH: usize = 2;
/// Most distinct sizes pooled at once (templates may each have their own).
const MAX_SIZES: usize = 4;

/// The pool of formatted images.
pub struct DiskPool {
    dir: PathBuf,
    ready: Mutex<HashMap<u32, Vec<PathBuf>>>,
    filling: Mutex<HashSet<u32>>,
    seq: AtomicU64,
}

impl DiskPool {
    /// A pool in `dir`, emptied of what an earlier server left.
    pub fn new(dir: PathBuf) -> Self {
        let _ = std::fs::remove_dir_all(&dir);
        Self {
            dir,
            ready: Default::default(),
            filling: Default::default(),
            seq: AtomicU64::new(0),
        }
    }

    fn ready(&self) -> std::sync::MutexGuard<'_, HashMap<u32, Vec<PathBuf>>> {
        self.ready.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A ready image of `mb` MiB, if the pool has one.
    fn take(&self, mb: u32) -> Option<PathBuf> {
        self.ready().get_mut(&mb)?.pop()
    }

    /// Creates the disk of `mb` MiB of the sandbox in `dir` and mounts it (as
    /// [`disk::create`]), from a ready image when there is one; refills the pool behind it.
    pub async fn create(self: &Arc<Self>, dir: &Path, mb: u32) -> Result<()> {
        let taken = self
            .take(mb)
            .and_then(|img| std::fs::rename(&img, dir.join(disk::IMAGE)).ok());
        self.refill(mb);
        match taken {
            Some(()) => disk::mount(dir).await,
            None => disk::create(dir, mb).await,
        }
    }

    /// Tops the pool of `mb` MiB images up to [`DEPTH`] in the background (once at a time).
    pub fn refill(self: &Arc<Self>, mb: u32) {
        {
            let ready = self.ready();
            if !ready.contains_key(&mb) && ready.len() >= MAX_SIZES {
                return;
            }
        }
        if !self
            .filling
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(mb)
        {
            return;
        }
        let me = Arc::clone(self);
        tokio::spawn(async move {
            while me.ready().get(&mb).map_or(0, Vec::len) < DEPTH {
                let n = me.seq.fetch_add(1, Ordering::Relaxed);
                let img = me.dir.join(format!("{mb}-{n}.img"));
                let made = async {
                    std::fs::create_dir_all(&me.dir).map_err(|e| e.to_string())?;
                    disk::make_image(&img, mb).await.map_err(|e| e.to_string())
                }
                .await;
                if let Err(e) = made {
                    tracing::warn!("preparing a disk image for the pool: {e}");
                    let _ = std::fs::remove_file(&img);
                    break;
                }
                me.ready().entry(mb).or_default().push(img);
            }
            me.filling
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&mb);
        });
    }

    /// Removes every ready image (on shutdown).
    pub fn clear(&self) {
        self.ready().clear();
        let _ = std::fs::remove_dir_all(&self.dir);
    }

    /// Ready images of `mb` MiB.
    #[cfg(test)]
    pub fn len(&self, mb: u32) -> usize {
        self.ready().get(&mb).map_or(0, Vec::len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn refills_in_the_background_and_hands_out_formatted_images() {
        if crate::driver::gvisor::disk::mkfs_missing() {
            eprintln!("skipped: mkfs.ext4 is not installed");
            assert!(
                std::env::var_os("KILN_ALLOW_SKIPS").is_some(),
                "mkfs.ext4 is missing"
            );
            return;
        }
        let d = tempfile::tempdir().unwrap();
        let pool = Arc::new(DiskPool::new(d.path().join("pool")));
        assert_eq!(pool.len(16), 0);
        pool.refill(16);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while pool.len(16) < DEPTH {
            assert!(
                std::time::Instant::now() < deadline,
                "the pool did not fill"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        let img = pool.take(16).unwrap();
        assert_eq!(std::fs::metadata(&img).unwrap().len(), 16 << 20);
        // A formatted ext4 image: the superblock magic 0xEF53 at byte 1024 + 56.
        let bytes = std::fs::read(&img).unwrap();
        assert_eq!(&bytes[1024 + 56..1024 + 58], &[0x53, 0xEF]);
        pool.clear();
        assert!(!d.path().join("pool").exists());
        assert_eq!(pool.len(16), 0);
    }
}
