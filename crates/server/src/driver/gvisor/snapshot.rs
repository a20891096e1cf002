//! Snapshots of a running gVisor sandbox, and new sandboxes restored from them.
//!
//! A snapshot lives under `<state>/gvisor/snapshots/<snapshot id>/`, apart from its source
//! (which it outlives): `checkpoint/` (runsc's image of memory and processes), `upper/` (a copy
//! of the sandbox's writable layer at that instant) and `snapshot.json` (the template rootfs
//! the layer stacks on), written last.
//!
//! Capture: the agent is detached, the sandbox checkpointed (it stops), its layer copied while
//! nothing writes to it, and the sandbox restored from that same image under its own id, so it
//! keeps running with its processes (its open connections are cut). A new sandbox from a
//! snapshot gets a copy of the layer and is restored from the image.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{check_id, GvisorDriver, SOCKET_NAME};
use crate::driver::{io_err, DriverError, Result, SandboxSpec, SnapshotRef};

#[derive(Debug, Serialize, Deserialize)]
struct SnapshotMeta {
    lower: PathBuf,
}

/// Copies the contents of `src` into the existing directory `dst`, keeping owners, modes,
/// xattrs (overlayfs whiteouts and opaque dirs) and hard links.
pub(super) async fn copy_tree(src: &Path, dst: &Path) -> Result<()> {
    let out = tokio::process::Command::new("cp")
        .arg("-a")
        .arg(format!("{}/.", src.display()))
        .arg(dst)
        .output()
        .await
        .map_err(io_err("running cp"))?;
    if !out.status.success() {
        return Err(DriverError::Command {
            command: format!("cp -a {} {}", src.display(), dst.display()),
            output: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(())
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
    fn snapshot_dir(&self, snap: &SnapshotRef) -> Result<PathBuf> {
        check_id(&snap.0)?;
        Ok(self.cfg.dir.join("snapshots").join(&snap.0))
    }

    pub(super) async fn take_snapshot(&self, id: &str, snap: &SnapshotRef) -> Result<u64> {
        check_id(id)?;
        let sdir = self.snapshot_dir(snap)?;
        if sdir.exists() {
            return Err(DriverError::Other(format!(
                "snapshot {} already exists",
                snap.0
            )));
        }
        if self.runsc.status(id).await.as_deref() != Some("running") {
            return Err(DriverError::NotFound(id.to_string()));
        }
        let lower = self.lower_of(id)?;
        let image = sdir.join("checkpoint");
        for d in [&image, &sdir.join("upper")] {
            std::fs::create_dir_all(d).map_err(io_err(format!("creating {}", d.display())))?;
        }
        let r = self.capture(id, &sdir, &image, lower).await;
        if r.is_err() {
            let _ = std::fs::remove_dir_all(&sdir);
        }
        r
    }

    async fn capture(&self, id: &str, sdir: &Path, image: &Path, lower: PathBuf) -> Result<u64> {
        let dir = self.sandbox_dir(id);
        let t = std::time::Instant::now();
        self.detach_agent(id).await?;
        let t_detach = t.elapsed();
        if let Err(e) = self.runsc.checkpoint(id, image, false).await {
            let _ = self.attach_agent(id).await;
            return Err(e);
        }
        let t_checkpoint = t.elapsed();
        self.halt(id).await?;
        let t_halt = t.elapsed();
        let copied = copy_tree(&dir.join("upper"), &sdir.join("upper")).await;
        let t_copy = t.elapsed();
        // The sandbox continues from the image whatever happened to the copy.
        let _ = std::fs::remove_file(dir.join("run").join(SOCKET_NAME));
        self.runsc
            .restore_detached(image, &dir.join("bundle"), id, &dir.join("console.log"))
            .await?;
        self.attach_agent(id).await?;
        tracing::debug!(
            sandbox = id,
            "snapshot: detach {:?}, checkpoint {:?}, halt {:?}, copy {:?}, restore {:?}",
            t_detach,
            t_checkpoint - t_detach,
            t_halt - t_checkpoint,
            t_copy - t_halt,
            t.elapsed() - t_copy
        );
        copied?;
        let meta = serde_json::to_vec(&SnapshotMeta { lower })
            .map_err(|e| DriverError::Other(format!("encoding snapshot.json: {e}")))?;
        std::fs::write(sdir.join("snapshot.json"), meta)
            .map_err(io_err("writing snapshot.json"))?;
        Ok(disk_usage(sdir))
    }

    pub(super) async fn restore_snapshot(
        &self,
        snap: &SnapshotRef,
        spec: &SandboxSpec,
    ) -> Result<()> {
        check_id(&spec.id)?;
        let sdir = self.snapshot_dir(snap)?;
        if !sdir.join("snapshot.json").exists() {
            return Err(DriverError::NotFound(snap.0.clone()));
        }
        self.prepare_with(spec, Some(&sdir.join("upper"))).await?;
        let dir = self.sandbox_dir(&spec.id);
        let restored = async {
            self.runsc
                .restore_detached(
                    &sdir.join("checkpoint"),
                    &dir.join("bundle"),
                    &spec.id,
                    &dir.join("console.log"),
                )
                .await?;
            self.attach_agent(&spec.id).await
        }
        .await;
        if restored.is_err() {
            let _ = crate::driver::Driver::stop(self, &spec.id).await;
        }
        restored
    }

    pub(super) fn remove_snapshot(&self, snap: &SnapshotRef) -> Result<()> {
        let sdir = self.snapshot_dir(snap)?;
        match std::fs::remove_dir_all(&sdir) {
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
