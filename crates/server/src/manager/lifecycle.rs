//! Pause, resume, snapshot and fork: the driver does the work; the manager checks the sandbox
//! and records what happened. Drivers that cannot do them answer "not implemented" (501).

use super::Manager;
use crate::driver::SnapshotRef;
use crate::error::Result;

impl Manager {
    /// `POST /sandboxes/{id}/pause`.
    pub async fn pause(&self, id: &str) -> Result<()> {
        self.get(id)?;
        self.driver.pause(id).await?;
        self.event(id, "paused", "paused by request").await;
        Ok(())
    }

    /// `POST /sandboxes/{id}/resume` (the deprecated route; `connect` is the current one).
    pub async fn resume(&self, id: &str) -> Result<()> {
        self.get(id)?;
        self.driver.resume(id).await?;
        self.event(id, "resumed", "resumed by request").await;
        Ok(())
    }

    /// `POST /sandboxes/{id}/snapshots`.
    pub async fn snapshot(&self, id: &str) -> Result<SnapshotRef> {
        self.get(id)?;
        let snap = self.driver.snapshot(id).await?;
        self.event(id, "snapshot", format!("snapshot {}", snap.0))
            .await;
        Ok(snap)
    }

    /// `POST /sandboxes/{id}/fork`.
    pub async fn fork(&self, id: &str, count: u32) -> Result<()> {
        self.get(id)?;
        if !(1..=20).contains(&count) {
            return Err(crate::error::Error::bad_request(format!(
                "count must be 1-20, got {count}"
            )));
        }
        self.driver.fork(id, &[]).await?;
        Ok(())
    }
}
