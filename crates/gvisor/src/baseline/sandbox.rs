//! The runsc commands alone on a sandbox of this driver: `runsc checkpoint` of its current
//! container, then `runsc restore` of it under the same container id.
//!
//! The agent lets go of its host socket first, as for a pause, through the driver's own
//! detach: that opens the sealed `run/` directory, where the agent writes its `.detached`
//! marker (a bare `runsc kill … USR1` into a sealed directory never gets the marker written).
//! After the restore the driver's attach has the agent listen again and seals the directory.
//!
//! A snapshot's own checkpoint is restored the same way into a sandbox created from it, on
//! that sandbox's bundle (the snapshot's layers under a writable layer), as the driver's
//! restore does minus its preparation.

use std::path::Path;
use std::time::{Duration, Instant};

use kiln_driver::baseline::SandboxBaseline;
use kiln_driver::{io_err, DriverError, Result, SnapshotRef};

use crate::{check_id, GvisorDriver, SOCKET_NAME};

#[async_trait::async_trait]
impl SandboxBaseline for GvisorDriver {
    async fn checkpoint_restore(&self, id: &str, image: &Path) -> Result<(Duration, Duration)> {
        check_id(id)?;
        self.settling.settle(id).await;
        // The sandbox's current container (a resume made a new one); it is restored under the
        // same id after its delete.
        let cid = self.cid(id);
        self.detach_agent(id).await?;
        let _ = std::fs::remove_dir_all(image);
        std::fs::create_dir_all(image).map_err(io_err(format!("creating {}", image.display())))?;
        let t = Instant::now();
        if let Err(e) = self.runsc.checkpoint(&cid, image, false).await {
            let _ = self.attach_agent(id).await;
            return Err(e);
        }
        let checkpoint = t.elapsed();
        // The checkpointed sandbox's processes exit; the container is deleted while they are
        // reaped (this process adopted them), as a pause does (not timed).
        let restore = self.halt_and_restore(id, &cid, image).await?;
        Ok((checkpoint, restore))
    }

    async fn restore_snapshot(&self, id: &str, snapshot: &str) -> Result<Duration> {
        check_id(id)?;
        self.settling.settle(id).await;
        let image = self
            .snapshot_dir(&SnapshotRef(snapshot.to_string()))?
            .join("checkpoint");
        if !image.join("checkpoint.img").exists() {
            return Err(DriverError::NotFound(format!(
                "snapshot {snapshot} has no memory checkpoint"
            )));
        }
        let cid = self.cid(id);
        // Held as a pause's cleanup is: the server's watcher waits before it judges the
        // sandbox, whose runtime is gone for the moment.
        let _held = self.settling.hold(id);
        self.halt_and_restore(id, &cid, &image).await
    }
}

impl GvisorDriver {
    /// Deletes container `cid` of sandbox `id` and times `runsc restore` of `image` under the
    /// same id on its bundle (the delete is not timed); the agent listens again afterwards.
    async fn halt_and_restore(&self, id: &str, cid: &str, image: &Path) -> Result<Duration> {
        let dir = self.sandbox_dir(id);
        crate::halt_container(&self.runsc, cid, &dir).await?;
        // The agent binds its socket again: the old socket file must be gone.
        let _ = std::fs::remove_file(dir.join("run").join(SOCKET_NAME));
        let workaround = self.sysctl_workaround(id).await;
        let t = Instant::now();
        self.runsc
            .restore_detached(
                image,
                &dir.join("bundle"),
                cid,
                &dir.join("console.log"),
                workaround,
                None,
            )
            .await?;
        let restore = t.elapsed();
        self.attach_agent(id).await?;
        Ok(restore)
    }
}
