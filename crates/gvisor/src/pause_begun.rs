//! A pause the server's end cut short. A pause writes `pausing.json` (the same record as
//! `paused.json`) before it detaches the agent and asks for the checkpoint, and removes it once
//! `paused.json` is written. A server killed in between leaves a sandbox that is neither
//! running as the server left it (its agent detached) nor recorded as paused, although the
//! sentry finishes a checkpoint it was asked for whoever asked. The next server settles such
//! a sandbox before it judges it ([`GvisorDriver::settle_begun_pause`], from
//! [`crate::driver::Checkpoint::is_paused`]):
//! - its container still runs and no `checkpoint.img` was begun: the checkpoint never
//!   happened, so the agent is asked to listen again and the sandbox is running;
//! - otherwise the checkpoint was asked for: once the sentry has finished it and exited, the
//!   pause is completed as the pause would have (the container marked retiring, `paused.json`
//!   written), with its memory when `checkpoint.img` is there.

use super::checkpoint::{write_record, Paused};
use super::{check_id, GvisorDriver};
use crate::driver::{io_err, DriverError, Result};

/// The record of a pause begun and not yet complete.
const PAUSING: &str = "pausing.json";

/// How long a sandbox found writing the checkpoint of a pause cut short may take to finish.
const CHECKPOINT_END: std::time::Duration = std::time::Duration::from_secs(30);

impl GvisorDriver {
    /// Records that a pause of `id` begins (see the module docs).
    pub(super) fn begin_pause(&self, id: &str, record: &Paused) -> Result<()> {
        write_record(&self.sandbox_dir(id), PAUSING, record)
    }

    /// The pause of `id` is over (complete, or failed with the sandbox running on).
    pub(super) fn end_pause(&self, id: &str) {
        let _ = std::fs::remove_file(self.sandbox_dir(id).join(PAUSING));
    }

    /// Settles a pause of `id` a server's end cut short (see the module docs); nothing to do
    /// when none was begun.
    pub(super) async fn settle_begun_pause(&self, id: &str) -> Result<()> {
        check_id(id)?;
        let dir = self.sandbox_dir(id);
        let Ok(text) = std::fs::read(dir.join(PAUSING)) else {
            return Ok(());
        };
        let begun: Option<Paused> = serde_json::from_slice(&text).ok();
        let Some(begun) = begun.filter(|_| self.read_paused(id).is_none()) else {
            // Complete already (the server ended before removing the record), or unreadable.
            self.end_pause(id);
            return Ok(());
        };
        let cid = self.cid(id);
        let image = self.image_dir(id);
        let taken = || image.join("checkpoint.img").exists();
        if self.container_runs(&cid).await && !taken() {
            match self.attach_agent(id).await {
                Ok(()) => {
                    tracing::warn!(
                        sandbox = id,
                        "a pause cut short before its checkpoint: running on"
                    );
                    self.end_pause(id);
                    return Ok(());
                }
                // Still running and not answering: left as it is for the next look.
                Err(e) if self.container_runs(&cid).await => return Err(e),
                // It stopped meanwhile: the checkpoint went ahead.
                Err(_) => {}
            }
        }
        // The checkpoint was asked for: the sentry finishes it and exits.
        let deadline = std::time::Instant::now() + CHECKPOINT_END;
        while self.container_runs(&cid).await {
            if std::time::Instant::now() >= deadline {
                return Err(DriverError::Other(format!(
                    "sandbox {id} is still writing the checkpoint of a pause cut short after {}s",
                    CHECKPOINT_END.as_secs()
                )));
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        let memory = begun.memory && taken();
        if !memory {
            let _ = std::fs::remove_dir_all(&image);
        }
        super::generation::mark_retiring(&dir, &cid)?;
        let paused = Paused {
            memory,
            lower: begun.lower,
        };
        write_record(&dir, "paused.json", &paused)?;
        self.end_pause(id);
        tracing::warn!(
            sandbox = id,
            memory,
            "a pause cut short after its checkpoint: completed"
        );
        Ok(())
    }

    /// A pause of `id` stopped where a server killed during it stops it: begun, the agent
    /// detached, and (with `checkpoint`) the checkpoint taken, but `paused.json` not written
    /// and the container not deleted. For tests of [`Self::settle_begun_pause`].
    #[doc(hidden)]
    pub async fn pause_cut_short(&self, id: &str, checkpoint: bool) -> Result<()> {
        check_id(id)?;
        let record = Paused {
            memory: true,
            lower: self.lower_of(id)?,
        };
        self.begin_pause(id, &record)?;
        self.detach_agent(id).await?;
        if checkpoint {
            let image = self.image_dir(id);
            std::fs::create_dir_all(&image)
                .map_err(io_err(format!("creating {}", image.display())))?;
            self.runsc.checkpoint(&self.cid(id), &image, false).await?;
        }
        Ok(())
    }
}
