//! Snapshots of a running gVisor sandbox, and new sandboxes restored from them.
//!
//! A snapshot lives under `<state>/gvisor/snapshots/<snapshot id>/`, apart from its source
//! (which it outlives): `checkpoint/` (runsc's image of memory and processes) and
//! `snapshot.json` (its layer stack), written last. Its files are a frozen layer,
//! `<state>/gvisor/layers/<snapshot id>/`: at capture the source's writable layer becomes that
//! read-only layer (a rename, no copy) and the source continues on a fresh writable layer
//! stacked on it. Sandboxes restored from the snapshot stack their own fresh writable layer
//! on the same frozen ones, so a child costs the disk it writes, whatever its parent's size.
//!
//! Capture: the agent is detached, the sandbox checkpointed (it stops), its layer frozen and
//! its overlay mounted again on the new stack, and the sandbox restored from that same image
//! under its next container id (see [`super::generation`]), so it keeps running with its
//! processes (its open connections are cut). A fork's parent is restored only after its
//! children answered (see [`crate::driver::Checkpoint::capture_for_fork`]). A capture that
//! ends its source (a template build's last layer) checkpoints nothing: the sandbox is halted
//! and its layer frozen.
//! A frozen layer is removed once no snapshot, mount or paused sandbox uses it.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::mounts::{is_mounted, mount_overlay_stack, unmount};
use super::reap;
use super::{check_id, disk, GvisorDriver, SOCKET_NAME};
use crate::driver::{io_err, DriverError, Result, SandboxSpec, SnapshotRef};

/// Longest a fork's parent waits for its children before it continues anyway.
const HOLD_LIMIT: std::time::Duration = std::time::Duration::from_secs(60);

/// Hard links of the files under `from` at `to` (a copy that costs no disk).
fn link_tree(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir(to)?;
    for e in std::fs::read_dir(from)? {
        let e = e?;
        let dest = to.join(e.file_name());
        if e.file_type()?.is_dir() {
            link_tree(&e.path(), &dest)?;
        } else {
            std::fs::hard_link(e.path(), dest)?;
        }
    }
    Ok(())
}

#[derive(Debug, Serialize, Deserialize)]
pub(super) struct SnapshotMeta {
    /// The layers a sandbox restored from the snapshot stacks on, topmost first.
    pub(super) lowers: Vec<PathBuf>,
}

/// Reads snapshot `snap`'s `snapshot.json` in `sdir` (404 when there is none: the snapshot is
/// not whole on this host).
pub(super) fn read_meta(sdir: &Path, snap: &SnapshotRef) -> Result<SnapshotMeta> {
    let Ok(text) = std::fs::read(sdir.join("snapshot.json")) else {
        return Err(DriverError::NotFound(snap.0.clone()));
    };
    serde_json::from_slice(&text)
        .map_err(|_| DriverError::Other(format!("snapshot {} is unreadable", snap.0)))
}

/// Writes `sdir`'s `snapshot.json` naming `stack` (written last: it makes the snapshot whole).
pub(super) fn write_meta(sdir: &Path, stack: Vec<PathBuf>) -> Result<()> {
    let meta = serde_json::to_vec(&SnapshotMeta { lowers: stack })
        .map_err(|e| DriverError::Other(format!("encoding snapshot.json: {e}")))?;
    std::fs::write(sdir.join("snapshot.json"), meta).map_err(io_err("writing snapshot.json"))
}

/// Bytes used by the files under `path` (allocated blocks, as `du` counts them).
pub fn disk_usage(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return 0;
    };
    let own = meta.blocks() * 512;
    if !meta.is_dir() {
        return own;
    }
    let children = std::fs::read_dir(path)
        .map(|rd| rd.flatten().map(|e| disk_usage(&e.path())).sum())
        .unwrap_or(0);
    own + children
}

impl GvisorDriver {
    pub(crate) fn snapshot_dir(&self, snap: &SnapshotRef) -> Result<PathBuf> {
        check_id(&snap.0)?;
        Ok(self.cfg.dir.join("snapshots").join(&snap.0))
    }

    pub(super) fn layer_dir(&self, snap: &SnapshotRef) -> PathBuf {
        self.cfg.dir.join("layers").join(&snap.0)
    }

    pub(super) async fn take_snapshot(
        &self,
        id: &str,
        snap: &SnapshotRef,
        memory: bool,
        hold: Option<tokio::sync::oneshot::Receiver<()>>,
    ) -> Result<u64> {
        let (sdir, lowers, making) = self.begin_capture(id, snap).await?;
        let image = sdir.join("checkpoint");
        let r = match std::fs::create_dir_all(&image) {
            Ok(()) => {
                self.capture(id, snap, &sdir, &image, lowers, memory, hold)
                    .await
            }
            Err(e) => Err(io_err(format!("creating {}", image.display()))(e)),
        };
        self.end_capture(&sdir, making, r)
    }

    /// A disk snapshot of `id` that ends it: its processes are killed (no checkpoint), its
    /// writable layer becomes the snapshot's layer, and it is left halted, without a disk,
    /// for the stop that follows.
    pub(super) async fn take_snapshot_ending(&self, id: &str, snap: &SnapshotRef) -> Result<u64> {
        let (sdir, lowers, making) = self.begin_capture(id, snap).await?;
        let r = self.end_into(id, snap, &sdir, &lowers).await;
        self.end_capture(&sdir, making, r)
    }

    /// What every capture starts with: the snapshot's directory (new), the source's layer
    /// stack, and holds on every layer of it (see `in_use`).
    async fn begin_capture(
        &self,
        id: &str,
        snap: &SnapshotRef,
    ) -> Result<(PathBuf, Vec<PathBuf>, Vec<super::in_use::MakingGuard>)> {
        check_id(id)?;
        self.settling.settle(id).await;
        let sdir = self.snapshot_dir(snap)?;
        if sdir.exists() {
            return Err(DriverError::Other(format!(
                "snapshot {} already exists",
                snap.0
            )));
        }
        // (No `runsc state`: the manager knows the sandbox runs, and detaching the agent of a
        // sandbox that does not fails anyway.)
        let lowers = self.lower_of(id)?;
        // From its bind mount until snapshot.json names it, the layer is referenced by
        // nothing on disk, nor are the layers below it while the sandbox's overlay is
        // unmounted: a clean-up running beside (a stop's) must not take them.
        let making: Vec<_> = std::iter::once(self.layer_dir(snap))
            .chain(lowers.iter().cloned())
            .map(|l| self.making.hold(l))
            .collect();
        std::fs::create_dir_all(&sdir).map_err(io_err(format!("creating {}", sdir.display())))?;
        std::fs::create_dir_all(self.cfg.dir.join("layers")).map_err(io_err("creating layers"))?;
        Ok((sdir, lowers, making))
    }

    /// Releases a capture's holds; a failed capture leaves no snapshot and no layer behind.
    fn end_capture(
        &self,
        sdir: &Path,
        making: Vec<super::in_use::MakingGuard>,
        r: Result<u64>,
    ) -> Result<u64> {
        drop(making);
        if r.is_err() {
            let _ = std::fs::remove_dir_all(sdir);
            self.gc_layers();
        }
        r
    }

    /// Halts `id` and freezes its writable layer as `snap`'s (see [`Self::take_snapshot_ending`]).
    async fn end_into(
        &self,
        id: &str,
        snap: &SnapshotRef,
        sdir: &Path,
        lowers: &[PathBuf],
    ) -> Result<u64> {
        let t = std::time::Instant::now();
        self.halt(id).await?;
        let t_halt = t.elapsed();
        let stack = self.freeze_layer(id, snap, lowers, false).await?;
        write_meta(sdir, stack)?;
        tracing::debug!(
            sandbox = id,
            "snapshot ending its source: halt {:?}, freeze and record {:?}",
            t_halt,
            t.elapsed() - t_halt
        );
        Ok(disk_usage(sdir) + disk_usage(&self.layer_dir(snap)))
    }

    /// Freezes the stopped sandbox's writable layer as the snapshot's layer; returns the new
    /// stack. With `continues`, its overlay is mounted again on a fresh writable layer above
    /// it (the source goes on); without, the sandbox is left without a disk (it ends).
    async fn freeze_layer(
        &self,
        id: &str,
        snap: &SnapshotRef,
        lowers: &[PathBuf],
        continues: bool,
    ) -> Result<Vec<PathBuf>> {
        let dir = self.sandbox_dir(id);
        let rootfs = dir.join("rootfs");
        let layer = self.layer_dir(snap);
        unmount(&rootfs)?;
        if dir.join(disk::IMAGE).exists() {
            // On its own filesystem: frozen in place; a source that continues goes on on a
            // fresh disk.
            match continues {
                true => disk::freeze(&dir, &layer).await?,
                false => disk::freeze_last(&dir, &layer)?,
            }
        } else {
            let (upper, work) = (dir.join("upper"), dir.join("work"));
            std::fs::rename(&upper, &layer)
                .map_err(io_err(format!("freezing {}", upper.display())))?;
            if continues {
                let _ = std::fs::remove_dir_all(&work);
                for d in [&upper, &work] {
                    std::fs::create_dir_all(d)
                        .map_err(io_err(format!("creating {}", d.display())))?;
                }
            }
        }
        let mut stack = vec![layer];
        stack.extend(lowers.iter().cloned());
        if continues {
            let (upper, work) = disk::layer_dirs(&dir);
            mount_overlay_stack(&stack, &upper, &work, &rootfs)?;
        }
        Ok(stack)
    }

    #[allow(clippy::too_many_arguments)]
    async fn capture(
        &self,
        id: &str,
        snap: &SnapshotRef,
        sdir: &Path,
        image: &Path,
        lowers: Vec<PathBuf>,
        memory: bool,
        hold: Option<tokio::sync::oneshot::Receiver<()>>,
    ) -> Result<u64> {
        let dir = self.sandbox_dir(id);
        let t = std::time::Instant::now();
        let cid = self.cid(id);
        self.detach_agent(id).await?;
        let t_detach = t.elapsed();
        // The fresh disk the source continues on is made while it is checkpointed.
        let (checkpointed, next) = tokio::join!(
            self.runsc.checkpoint(&cid, image, false),
            disk::make_next_image(&dir)
        );
        if let Err(e) = checkpointed {
            disk::drop_next_image(&dir);
            let _ = self.attach_agent(id).await;
            return Err(e);
        }
        if let Err(e) = next {
            tracing::debug!(sandbox = id, error = %e, "making the next disk ahead");
        }
        let t_checkpoint = t.elapsed();
        // The checkpointed sandbox's processes are exiting on their own: killing and reaping
        // them frees its layer. runsc's own delete of the container happens in the background
        // beside the source's restore under its next container id; unless the layer is still
        // busy, then it comes first.
        reap::kill_and_reap(&reap::sandbox_processes(&cid, Some(&dir), &self.runsc.root)).await;
        let mut halted = false;
        let mut frozen = self.freeze_layer(id, snap, &lowers, true).await;
        if frozen.is_err() && is_mounted(&dir.join("rootfs")) {
            self.halt(id).await?;
            halted = true;
            frozen = self.freeze_layer(id, snap, &lowers, true).await;
        }
        let t_freeze = t.elapsed();
        if frozen.is_err() && !is_mounted(&dir.join("rootfs")) {
            // Put the sandbox back on its own layer before continuing it.
            if dir.join(disk::IMAGE).exists() {
                disk::mount(&dir).await?;
            } else {
                let _ = std::fs::rename(self.layer_dir(snap), dir.join("upper"));
            }
            let (upper, work) = disk::layer_dirs(&dir);
            mount_overlay_stack(&lowers, &upper, &work, &dir.join("rootfs"))?;
        }
        // The sandbox continues from the image whatever happened to its layer.
        let _ = std::fs::remove_file(dir.join("run").join(SOCKET_NAME));
        let workaround = self.prepare_restore(id).await?;
        let written = frozen.and_then(|stack| write_meta(sdir, stack));
        if let Err(e) = written {
            if !halted {
                self.halt(id).await?;
            }
            self.continue_from(id, image, workaround).await?;
            return Err(e);
        }
        // The source continues from an image of its own: links to the snapshot's (which
        // may be deleted before the source restored), or the image itself for a
        // filesystem-only snapshot, which keeps none.
        let aside = dir.join("capture");
        let _ = std::fs::remove_dir_all(&aside);
        let own = match memory {
            true => link_tree(image, &aside),
            false => std::fs::rename(image, &aside),
        };
        let source_image = match own {
            Ok(()) => aside.clone(),
            Err(e) if memory => {
                tracing::debug!(sandbox = id, error = %e, "linking a capture's image");
                image.to_path_buf()
            }
            Err(e) => return Err(io_err(format!("moving {} aside", image.display()))(e)),
        };
        let size = disk_usage(sdir) + disk_usage(&self.layer_dir(snap));
        if !halted {
            super::generation::mark_retiring(&dir, &cid)?;
        }
        // The snapshot is complete: the source continues in the background (restores of the
        // snapshot can start meanwhile, and a fork's children restore before it; requests to
        // the source wait for it).
        let (runsc, sid) = (self.runsc.clone(), id.to_string());
        let run_dirs = self.run_dirs.clone();
        let syscalls = self.syscalls.get().cloned();
        self.settling.spawn(id, async move {
            if let Some(hold) = hold {
                let _ = tokio::time::timeout(HOLD_LIMIT, hold).await;
            }
            let t = std::time::Instant::now();
            let retired = async {
                if !halted {
                    if let Err(e) = super::generation::retire(&runsc, &dir, &cid, &[]).await {
                        tracing::warn!(container = cid, error = %e, "deleting a captured container");
                    }
                }
            };
            let continued = async {
                let obs = syscalls.as_ref();
                let img = Some(source_image.as_path());
                super::checkpoint::continue_as_next(&runsc, obs, &dir, &sid, img, workaround)
                    .await?;
                let agent = super::container::AgentSocket::new(&sid, dir.clone(), &run_dirs);
                super::checkpoint::attach_agent_at(&runsc, &agent, &sid).await
            };
            let ((), attached) = tokio::join!(retired, continued);
            let _ = std::fs::remove_dir_all(&aside);
            match attached {
                Ok(()) => tracing::debug!(sandbox = sid, "source restored in {:?}", t.elapsed()),
                Err(e) => {
                    tracing::warn!(sandbox = sid, error = %e, "continuing a snapshot's source")
                }
            }
        });
        tracing::debug!(
            sandbox = id,
            "snapshot: detach {:?}, checkpoint {:?}, reap and freeze {:?}, recorded {:?}",
            t_detach,
            t_checkpoint - t_detach,
            t_freeze - t_checkpoint,
            t.elapsed() - t_freeze
        );
        Ok(size)
    }

    /// Restores sandbox `id` from `image` and attaches its agent (the source of a capture
    /// continuing, in the foreground).
    async fn continue_from(&self, id: &str, image: &Path, workaround: bool) -> Result<()> {
        self.continue_as_next(id, Some(image), workaround).await?;
        self.attach_agent(id).await
    }

    pub(super) async fn restore_snapshot(
        &self,
        snap: &SnapshotRef,
        spec: &SandboxSpec,
    ) -> Result<()> {
        check_id(&spec.id)?;
        let sdir = self.snapshot_dir(snap)?;
        let meta = read_meta(&sdir, snap)?;
        self.prepare_with(spec, Some(&meta.lowers)).await?;
        let dir = self.sandbox_dir(&spec.id);
        let image = sdir.join("checkpoint");
        let restored = async {
            let workaround = self.sysctl_workaround(&spec.id).await;
            // An audited child's trace session (its config written with its layer).
            let pod = super::trace::start(&dir, &spec.id, self.syscalls.get())?;
            if !image.join("checkpoint.img").exists() {
                // A filesystem-only snapshot: boot on its disk.
                return self
                    .runsc
                    .run_detached(
                        &dir.join("bundle"),
                        &spec.id,
                        &dir.join("console.log"),
                        workaround,
                        pod.as_deref(),
                    )
                    .await;
            }
            self.runsc
                .restore_detached(
                    &image,
                    &dir.join("bundle"),
                    &spec.id,
                    &dir.join("console.log"),
                    workaround,
                    pod.as_deref(),
                )
                .await?;
            self.attach_agent(&spec.id).await
        }
        .await;
        if restored.is_err() {
            let _ = crate::driver::Driver::stop(self, &spec.id).await;
        } else {
            super::console::watch(&dir.join("console.log"));
        }
        restored
    }

    /// Removes frozen layers that no snapshot, mounted sandbox or paused sandbox uses.
    pub(super) fn gc_layers(&self) {
        let Ok(rd) = std::fs::read_dir(self.cfg.dir.join("layers")) else {
            return;
        };
        let making = self.making.lock();
        let used = super::in_use::references(&self.cfg.dir);
        for e in rd.flatten() {
            let mut p = e.path();
            if matches!(p.extension().and_then(|x| x.to_str()), Some("img" | "mnt")) {
                // A frozen layer's image goes with its layer.
                p.set_extension("");
            }
            if !super::in_use::is_referenced(&used, &p) && !making.contains_key(&p) {
                if let Err(err) = disk::remove_layer(&p) {
                    tracing::warn!(layer = %p.display(), error = %err, "removing an unused layer");
                }
            }
        }
    }

    pub(super) fn remove_snapshot(&self, snap: &SnapshotRef) -> Result<()> {
        let sdir = self.snapshot_dir(snap)?;
        let r = std::fs::remove_dir_all(&sdir);
        self.gc_layers();
        match r {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Err(DriverError::NotFound(snap.0.clone()))
            }
            Err(e) => Err(DriverError::Io {
                what: format!("removing {}", sdir.display()),
                source: e,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stop's layer clean-up running beside a capture leaves the layer being made alone
    /// (it is referenced by nothing on disk until the capture writes snapshot.json), and
    /// removes it once the capture let go of it without a record.
    #[test]
    fn the_layer_clean_up_skips_a_layer_a_capture_is_making() {
        let state = tempfile::tempdir().unwrap();
        let driver = GvisorDriver::new(crate::GvisorConfig::new(state.path())).unwrap();
        let (making, unused) = (SnapshotRef("s-making".into()), SnapshotRef("s-old".into()));
        for s in [&making, &unused] {
            std::fs::create_dir_all(driver.layer_dir(s).join("home")).unwrap();
        }
        let held = driver.making.hold(driver.layer_dir(&making));
        driver.gc_layers();
        assert!(
            driver.layer_dir(&making).exists(),
            "a layer being made was removed"
        );
        assert!(
            !driver.layer_dir(&unused).exists(),
            "an unused layer was kept"
        );
        drop(held);
        driver.gc_layers();
        assert!(
            !driver.layer_dir(&making).exists(),
            "a released layer was kept"
        );
    }
}
