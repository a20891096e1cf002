//! Paused sandboxes and snapshots moving between the hosts of a cluster: the files that make
//! a paused sandbox (or a snapshot) whole elsewhere (the driver's list), and a paused sandbox
//! (or a snapshot) of another host taken as this host's own once its files are laid out here. Where the files travel (object
//! storage) and who owns the sandbox (the cluster's records) is the cluster's business.

use std::path::PathBuf;

use kiln_driver::PortablePause;

use super::Manager;
use crate::driver::SnapshotRef;
use crate::error::{Error, Result};
use crate::store::{PauseMode, SandboxRecord, SandboxState, SnapshotRecord};

impl Manager {
    /// The files of paused sandbox `id` that another host needs to resume it (flushed; it
    /// stays paused here), its egress policy among them: the driver carries it, or refuses
    /// to move a sandbox whose policy it cannot carry.
    pub async fn portable_pause(&self, id: &str) -> Result<PortablePause> {
        let rec = self.get(id)?;
        if rec.state != SandboxState::Paused {
            return Err(Error::Conflict(format!("sandbox \"{id}\" is not paused")));
        }
        self.check_no_mounts(id).await?;
        Ok(self.driver.portable_pause(id).await?)
    }

    /// Whether this host has template `name` (a paused sandbox of it can be adopted here).
    pub async fn check_template(&self, name: &str) -> Result<()> {
        self.lookup_template(name).await.map(drop)
    }

    /// An empty directory for the files of paused sandbox `id` arriving from another host.
    pub async fn incoming_dir(&self, id: &str) -> Result<PathBuf> {
        if self.registry.get(id).is_some() {
            return Err(Error::Conflict(format!(
                "sandbox \"{id}\" is on this host already"
            )));
        }
        Ok(self.driver.incoming_dir(id).await?)
    }

    /// Takes paused sandbox `rec` of another host as this host's own: its files, laid out in
    /// [`Manager::incoming_dir`], become a paused sandbox of its template here (the network
    /// this host's, under the policy lists that moved with it and the rules and egress proxy
    /// of `network`, in force before it runs), recorded paused, so [`Manager::resume`] runs it.
    pub async fn adopt_paused(
        &self,
        mut rec: SandboxRecord,
        from: &str,
        network: Option<kiln_net::EgressPolicy>,
    ) -> Result<()> {
        let _guard = self.lifecycle_lock.write().await;
        if self.registry.get(&rec.id).is_some() {
            return Err(Error::Conflict(format!(
                "sandbox \"{}\" is on this host already",
                rec.id
            )));
        }
        let tpl = self.lookup_template(&rec.template_id).await?;
        let mut spec = self.spec_for(&rec.id, &tpl);
        spec.cpu_count = rec.cpu_count;
        spec.memory_mb = rec.memory_mb;
        spec.disk_mb = rec.disk_size_mb;
        // Workload identity tokens name the sandbox they are minted for.
        if let Some(t) = network
            .as_ref()
            .and_then(|p| p.transforms.as_ref())
            .and_then(|t| t.tokens.as_ref())
        {
            t.bind(&rec.id);
        }
        spec.network = network;
        self.driver.adopt_paused(&spec).await?;
        let mode = rec.pause_mode.unwrap_or(PauseMode::Full);
        rec.state = SandboxState::Paused;
        rec.pause_mode = Some(mode);
        rec.driver = self.driver.name().to_string();
        let stored = match self.store.get_sandbox(&rec.id).await? {
            // Back on a host it left: its old row takes the pause again.
            Some(_) => self.store.set_paused(&rec.id, mode).await,
            None => self.store.insert_sandbox(&rec).await,
        };
        if let Err(e) = stored {
            let _ = self.driver.stop(&rec.id).await;
            return Err(e.into());
        }
        let id = rec.id.clone();
        self.registry.insert(rec);
        self.event(
            &id,
            "moved",
            format!("paused sandbox taken over from node {from}"),
        )
        .await;
        Ok(())
    }

    /// The files of snapshot `id` that another host with its template needs to start
    /// sandboxes from it (flushed; it stays here).
    pub async fn portable_snapshot(&self, id: &str) -> Result<PortablePause> {
        let Some(snap) = self.store.get_snapshot(id).await? else {
            return Err(Error::NotFound(format!("snapshot {id:?} not found")));
        };
        // A snapshot's sandboxes mount what its source mounted.
        self.check_no_mounts(&snap.sandbox_id).await?;
        Ok(self
            .driver
            .portable_snapshot(&SnapshotRef(id.to_string()))
            .await?)
    }

    /// Refuses to carry sandbox (or snapshot) `id` to another host when it mounts volumes:
    /// their files stay on this one.
    pub async fn check_no_mounts(&self, id: &str) -> Result<()> {
        if self.mounts_of(id).await?.is_empty() {
            Ok(())
        } else {
            Err(Error::Driver(crate::driver::DriverError::NotImplemented(
                "moving a sandbox that mounts volumes (their files stay on their host)",
            )))
        }
    }

    /// An empty directory for the files of snapshot `id` arriving from another host.
    pub async fn incoming_snapshot_dir(&self, id: &str) -> Result<PathBuf> {
        if self.store.get_snapshot(id).await?.is_some() {
            return Err(Error::Conflict(format!(
                "snapshot {id:?} is on this host already"
            )));
        }
        Ok(self
            .driver
            .incoming_snapshot_dir(&SnapshotRef(id.to_string()))
            .await?)
    }

    /// Takes snapshot `rec` of another host as this host's own: its files, laid out in
    /// [`Manager::incoming_snapshot_dir`], stacked on its template here and recorded, so a
    /// create from it runs here.
    pub async fn adopt_snapshot(&self, mut rec: SnapshotRecord) -> Result<()> {
        let tpl = self.lookup_template(&rec.template_id).await?;
        let snap = SnapshotRef(rec.id.clone());
        rec.size_bytes = self.driver.adopt_snapshot(&snap, &tpl.rootfs).await?;
        if let Err(e) = self.store.insert_snapshot(&rec).await {
            let _ = self.driver.delete_snapshot(&snap).await;
            return Err(e.into());
        }
        Ok(())
    }
}
