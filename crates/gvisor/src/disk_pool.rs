//! Ready-made disks: formatting a sandbox's ext4 image (`mkfs.ext4`, 10–55 ms measured on the
//! 2-core test host) and loop-mounting it (4–77 ms) are taken off the create path by keeping
//! [`DEPTH`] formatted, mounted images of each disk size in use, made in the background like
//! warm sandboxes. A create takes one: it renames the image into the sandbox directory and moves
//! its mount (`MS_MOVE`, with empty `upper/` and `work/` already on it) to the sandbox's
//! `disk/`; the pool refills behind it. A size seen for the first time, or a pool drained by a
//! burst of creates, is formatted and mounted on the spot as before.
//!
//! The pool lives in `<state>/gvisor/disk-pool/`: `<mb>-<n>.img` (a few hundred KiB of host
//! disk each: sparse, inode tables initialised lazily) mounted at `mnt/<mb>-<n>/`. `mnt/` is a
//! private bind mount of itself, since a mount cannot be moved off a shared parent (the root
//! of systemd hosts is shared); the images stay outside it, as a rename cannot cross a mount. Everything mounted there is unmounted and the
//! directory emptied at start (what a crashed server left) and on shutdown. Where the private
//! mount cannot be made, the pool keeps unmounted images and a create mounts its own.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::disk;
use super::mounts::{make_private_mount, mounts_under, move_mount, unmount};
use crate::driver::{io_err, Result};

/// Images kept ready per disk size.
pub const DEPTH: usize = 2;
/// The pool's private mount, where its disks are mounted (in its directory).
const MOUNTS: &str = "mnt";
/// Most distinct sizes pooled at once (templates may each have their own).
const MAX_SIZES: usize = 4;

/// A disk in the pool: its image, and where it is mounted (None: not mounted).
struct Ready {
    image: PathBuf,
    mount: Option<PathBuf>,
}

/// The pool of formatted images.
pub struct DiskPool {
    dir: PathBuf,
    ready: Mutex<HashMap<u32, Vec<Ready>>>,
    filling: Mutex<HashSet<u32>>,
    seq: AtomicU64,
    /// Whether pooled images are kept mounted (the private pool mount could be made); set
    /// with the first disk made.
    premount: std::sync::OnceLock<bool>,
    closed: AtomicBool,
}

/// Unmounts everything mounted at or under `dir` and removes it.
fn tear_down(dir: &Path) {
    for m in mounts_under(dir) {
        if let Err(e) = unmount(&m) {
            tracing::warn!("cleaning up the disk pool: {e}");
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

impl DiskPool {
    /// A pool in `dir`, emptied of what an earlier server left (mounts included). The
    /// directory and its mount are made with the first disk (a server without disk quotas
    /// mounts nothing there).
    pub fn new(dir: PathBuf) -> Self {
        tear_down(&dir);
        Self {
            dir,
            ready: Default::default(),
            filling: Default::default(),
            seq: AtomicU64::new(0),
            premount: Default::default(),
            closed: AtomicBool::new(false),
        }
    }

    /// Makes the pool directory's private mount (once); whether pooled disks can be kept
    /// mounted.
    fn premount(&self) -> bool {
        *self.premount.get_or_init(|| {
            let mnt = self.dir.join(MOUNTS);
            let made = std::fs::create_dir_all(&mnt)
                .map_err(io_err(format!("creating {}", mnt.display())))
                .and_then(|()| make_private_mount(&mnt));
            match made {
                Ok(()) => true,
                Err(e) => {
                    tracing::warn!("disk pool: images will be mounted at create: {e}");
                    false
                }
            }
        })
    }

    fn ready(&self) -> std::sync::MutexGuard<'_, HashMap<u32, Vec<Ready>>> {
        self.ready.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A ready disk of `mb` MiB, if the pool has one.
    fn take(&self, mb: u32) -> Option<Ready> {
        self.ready().get_mut(&mb)?.pop()
    }

    /// Creates the disk of `mb` MiB of the sandbox in `dir` and mounts it with empty `upper`
    /// and `work` (as [`disk::create`]), from a ready disk when there is one; refills the pool
    /// behind it.
    pub async fn create(self: &Arc<Self>, dir: &Path, mb: u32) -> Result<()> {
        let taken = self.take(mb);
        self.refill(mb);
        let Some(r) = taken else {
            return disk::create(dir, mb).await;
        };
        if let Err(e) = std::fs::rename(&r.image, dir.join(disk::IMAGE)) {
            tracing::warn!("taking a disk from the pool: {e}");
            discard(&r);
            return disk::create(dir, mb).await;
        }
        let Some(m) = &r.mount else {
            return disk::mount(dir).await;
        };
        let target = dir.join(disk::MOUNT);
        let moved = std::fs::create_dir_all(&target)
            .map_err(io_err(format!("creating {}", target.display())))
            .and_then(|()| move_mount(m, &target));
        if let Err(e) = moved {
            tracing::warn!("moving a pooled disk into place: {e}");
            let _ = unmount(m);
        }
        let _ = std::fs::remove_dir(m);
        // Mounts the image itself if the move failed; makes sure of `upper` and `work`.
        disk::mount(dir).await
    }

    /// Tops the pool of `mb` MiB images up to [`DEPTH`] in the background (once at a time).
    pub fn refill(self: &Arc<Self>, mb: u32) {
        {
            let ready = self.ready();
            if !ready.contains_key(&mb) && ready.len() >= MAX_SIZES {
                return;
            }
        }
        if self.closed.load(Ordering::SeqCst)
            || !self
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
                let r = match me.make(mb).await {
                    Ok(r) => r,
                    Err(e) => {
                        tracing::warn!("preparing a disk for the pool: {e}");
                        break;
                    }
                };
                let mut ready = me.ready();
                if me.closed.load(Ordering::SeqCst) {
                    drop(ready);
                    discard(&r);
                    break;
                }
                ready.entry(mb).or_default().push(r);
            }
            me.filling
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&mb);
        });
    }

    /// Formats (and, when pooled disks are kept mounted, mounts) one disk of `mb` MiB. On an
    /// error nothing is left.
    async fn make(&self, mb: u32) -> Result<Ready> {
        let n = self.seq.fetch_add(1, Ordering::Relaxed);
        std::fs::create_dir_all(&self.dir)
            .map_err(io_err(format!("creating {}", self.dir.display())))?;
        let image = self.dir.join(format!("{mb}-{n}.img"));
        let mut r = Ready { image, mount: None };
        if let Err(e) = disk::make_image(&r.image, mb).await {
            discard(&r);
            return Err(e);
        }
        if !self.premount() {
            return Ok(r);
        }
        let m = self.dir.join(MOUNTS).join(format!("{mb}-{n}"));
        r.mount = Some(m.clone());
        let mounted = async {
            disk::mount_image(&r.image, &m).await?;
            for sub in ["upper", "work"] {
                std::fs::create_dir(m.join(sub))
                    .map_err(io_err(format!("creating {}", m.join(sub).display())))?;
            }
            Ok(())
        }
        .await;
        match mounted {
            Ok(()) => Ok(r),
            Err(e) => {
                discard(&r);
                Err(e)
            }
        }
    }

    /// Removes every ready disk, unmounting it (on shutdown); later refills make nothing.
    pub fn clear(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.ready().clear();
        tear_down(&self.dir);
    }

    /// Ready images of `mb` MiB.
    #[cfg(test)]
    pub fn len(&self, mb: u32) -> usize {
        self.ready().get(&mb).map_or(0, Vec::len)
    }
}

/// A pool dropped without [`DiskPool::clear`] (a driver going away without a shutdown, as in
/// tests and benches) takes its disks down too. One that never made a disk leaves the
/// directory alone (another driver on the same state may be using it).
impl Drop for DiskPool {
    fn drop(&mut self) {
        if self.seq.load(Ordering::SeqCst) > 0 && !self.closed.load(Ordering::SeqCst) {
            tear_down(&self.dir);
        }
    }
}

/// Unmounts and removes a pooled disk.
fn discard(r: &Ready) {
    if let Some(m) = &r.mount {
        let _ = unmount(m);
        let _ = std::fs::remove_dir(m);
    }
    let _ = std::fs::remove_file(&r.image);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// True when the test cannot run here: `mkfs.ext4` missing (kiln-testkit's skip policy).
    fn skip_without_mkfs() -> bool {
        !kiln_testkit::needs().tool("mkfs.ext4").ok()
    }

    /// The mount ids of the mounts at or under `dir`.
    fn mount_ids(dir: &Path) -> Vec<u64> {
        let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        info.lines()
            .map(|l| l.split(' ').collect::<Vec<_>>())
            .filter(|f| Path::new(f[4]).starts_with(dir))
            .map(|f| f[0].parse().unwrap())
            .collect()
    }

    async fn filled(pool: &Arc<DiskPool>, mb: u32) {
        pool.refill(mb);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while pool.len(mb) < DEPTH {
            assert!(
                std::time::Instant::now() < deadline,
                "the pool did not fill"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }

    #[tokio::test]
    async fn hands_out_mounted_disks_by_moving_their_mounts() {
        if skip_without_mkfs() {
            return;
        }
        let d = tempfile::tempdir().unwrap();
        let pool = Arc::new(DiskPool::new(d.path().join("pool")));
        assert_eq!(pool.len(16), 0);
        assert!(!d.path().join("pool").exists(), "nothing before a disk");
        filled(&pool, 16).await;
        assert!(pool.premount(), "kiln runs as root");
        let ready = mount_ids(&d.path().join("pool/mnt/"));
        let sandbox = d.path().join("sb");
        std::fs::create_dir(&sandbox).unwrap();
        pool.create(&sandbox, 16).await.unwrap();
        let disk = sandbox.join(disk::MOUNT);
        assert_eq!(
            mounts_under(&sandbox),
            vec![disk.clone()],
            "the disk is mounted in the sandbox"
        );
        // Moved: one of the pool's mounts, not a new one.
        let id = mount_ids(&disk)[0];
        assert!(ready.contains(&id), "mount {id} is not one of {ready:?}");
        let img = sandbox.join(disk::IMAGE);
        assert_eq!(std::fs::metadata(&img).unwrap().len(), 16 << 20);
        // A formatted ext4 image: the superblock magic 0xEF53 at byte 1024 + 56.
        let bytes = std::fs::read(&img).unwrap();
        assert_eq!(&bytes[1024 + 56..1024 + 58], &[0x53, 0xEF]);
        let (upper, work) = disk::layer_dirs(&sandbox);
        assert!(upper.starts_with(&disk) && upper.is_dir() && work.is_dir());
        assert_eq!(std::fs::read_dir(&upper).unwrap().count(), 0);
        // The pool's own mount lost that disk: only the refilled ones and the pool itself.
        let pooled = mounts_under(&d.path().join("pool"));
        assert!(pooled.iter().all(|m| !m.starts_with(&sandbox)));
        // What the sandbox writes lands on its disk, bounded by its size.
        std::fs::write(upper.join("f"), vec![1u8; 4 << 20]).unwrap();
        let big = std::fs::write(upper.join("g"), vec![1u8; 16 << 20]);
        assert!(big.is_err(), "the 16 MiB disk took 20 MiB");
        disk::unmount_disk(&sandbox).unwrap();
        pool.clear();
        assert!(!d.path().join("pool").exists());
        // Dropping a pool takes its disks down as clear() does.
        let other = Arc::new(DiskPool::new(d.path().join("other")));
        filled(&other, 16).await;
        drop(other);
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        assert!(mounts_under(&d.path().join("other")).is_empty());
        assert_eq!(pool.len(16), 0);
        assert!(mounts_under(d.path()).is_empty());
        // A closed pool makes nothing more.
        pool.refill(16);
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        assert!(mounts_under(d.path()).is_empty());
    }

    #[tokio::test]
    async fn a_restart_unmounts_what_a_crashed_pool_left() {
        if skip_without_mkfs() {
            return;
        }
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("pool");
        let before = mounts_under(d.path());
        assert!(before.is_empty());
        {
            let crashed = Arc::new(DiskPool::new(dir.clone()));
            filled(&crashed, 16).await;
            filled(&crashed, 32).await;
            // Gone without clear() or drop, as a killed server leaves it.
            std::mem::forget(crashed);
        }
        assert_eq!(
            mounts_under(&dir).len(),
            2 * DEPTH + 1,
            "four pooled disks and the pool's own mount"
        );
        let again = Arc::new(DiskPool::new(dir.clone()));
        assert!(mounts_under(&dir).is_empty(), "{:?}", mounts_under(&dir));
        assert!(!dir.exists());
        filled(&again, 16).await;
        again.clear();
        assert_eq!(mounts_under(d.path()), before, "nothing left mounted");
        // Nor any loop device still backed by the pool's images.
        let loops = std::fs::read_dir("/sys/block").unwrap().flatten();
        for l in loops {
            let backing = std::fs::read_to_string(l.path().join("loop/backing_file"));
            if let Ok(b) = backing {
                assert!(!b.trim().starts_with(dir.to_str().unwrap()), "{b}");
            }
        }
    }
}
