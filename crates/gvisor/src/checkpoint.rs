//! Pause and resume of a gVisor sandbox: `runsc checkpoint` into the sandbox's directory, then
//! `runsc restore` from it.
//!
//! gVisor cannot checkpoint a sandbox that holds sockets backed by the host, and the agent's
//! socket (`--host-uds=create`) is one. So the agent is detached first (`SIGUSR1`: it closes
//! its listeners and connections, then writes `run/agent.sock.detached`), and attached again
//! after a restore (`SIGUSR2`). The directory shared at `/run/kiln` is open for both (the
//! agent writes its marker, runsc's gofer makes the socket again) and sealed once the agent
//! listens again (see [`super::seal`]).
//!
//! Per sandbox, next to the layer and bundle (see the module docs of [`super`]):
//! - `checkpoint/`: runsc's image of memory and processes (full pauses only);
//! - `retiring/<container id>`: present until the paused sandbox's container is deleted (in
//!   the background, after the pause returned; see [`super::generation`]). A resume does not
//!   wait for it: the sandbox continues under its next container id;
//! - `paused.json`: written last, atomically, once the pause is complete; it says whether the
//!   memory was kept and which template rootfs the layer stacks on (to mount it again after a
//!   host reboot). A sandbox without it is not paused, whatever else is on disk;
//! - `pausing.json`: the same record, from the pause's start until `paused.json` is written,
//!   so that a pause the server's end cut short is settled by the next server (see
//!   [`super::pause_begun`]).
//!
//! The driver's [`Checkpoint`] side is here too, each call handed to the module that does it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::container::AgentSocket;
use super::mounts::{is_mounted, mount_overlay_stack, mount_run_dir};
use super::{check_id, GvisorDriver, SOCKET_NAME};
use crate::driver::{
    io_err, Checkpoint, DriverError, PortablePause, Result, SandboxSpec, SnapshotRef,
};

/// Present while the container of a sandbox paused by an earlier kiln (before container
/// generations) is still being deleted.
const HALTING: &str = "halting";

/// How long the agent may take to let go of its sockets.
const DETACH_TIMEOUT: Duration = Duration::from_secs(5);

/// How long the agent gets to act on a detach or attach request before it is signalled.
const REQUEST_GRACE: Duration = Duration::from_millis(500);

/// Sends `POST /kiln/detach` to the agent at `agent`: true when it was delivered
/// to an agent that knows the request (a 202, or the connection closing as the agent
/// detaches before its answer went out), false for an agent that does not (404) or when
/// the socket cannot be reached.
async fn request_detach(agent: &AgentSocket<'_>) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut s) = agent.connect().await else {
        return false;
    };
    let req = b"POST /kiln/detach HTTP/1.1\r\nHost: agent\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
    if s.write_all(req).await.is_err() {
        return false;
    }
    let mut head = [0u8; 12];
    let read = tokio::time::timeout(Duration::from_secs(2), s.read(&mut head)).await;
    match read {
        Ok(Ok(n)) if n >= 12 => &head[9..12] == b"202",
        // Closed before the answer: the agent detached as asked.
        Ok(Ok(_)) | Ok(Err(_)) => true,
        Err(_) => false,
    }
}

/// The agent's acknowledgement of a detach, in sandbox directory `dir`.
fn detached_marker_in(dir: &Path) -> PathBuf {
    dir.join("run").join(format!("{SOCKET_NAME}.detached"))
}

/// Has the agent of sandbox `id` (at `agent`) listen on its sockets again: removing its
/// `.detached` marker is the request (a detached agent watches it). An agent that does not
/// attach within [`REQUEST_GRACE`] (built before this) gets `SIGUSR2` through `runsc kill`;
/// either way it has until [`DETACH_TIMEOUT`] (a restore on a busy host may still be settling
/// when the grace ends, and then refuses the signal). Once it listens, the shared directory
/// is sealed again.
pub(super) async fn attach_agent_at(
    runsc: &super::runsc::Runsc,
    agent: &AgentSocket<'_>,
    id: &str,
) -> Result<()> {
    let dir = agent.dir();
    // (Open already since the detach; again in case a server restarted in between.)
    agent.open();
    let _ = std::fs::remove_file(detached_marker_in(dir));
    let start = tokio::time::Instant::now();
    let mut signalled = None;
    loop {
        // Connectable, not merely present: a socket file left from before the pause accepts
        // nothing.
        if agent.connect().await.is_ok() {
            agent.close();
            return Ok(());
        }
        let waited = start.elapsed();
        if waited >= DETACH_TIMEOUT {
            return Err(signalled.unwrap_or_else(|| {
                DriverError::Other(format!(
                    "the agent of sandbox {id} did not listen again within {}s",
                    DETACH_TIMEOUT.as_secs()
                ))
            }));
        }
        if signalled.is_none() && waited >= REQUEST_GRACE {
            let cid = super::generation::container_id(id, super::generation::current(dir));
            signalled = Some(match runsc.output(&["kill", &cid, "USR2"]).await {
                Ok(_) => DriverError::Other(format!(
                    "the agent of sandbox {id} did not listen again within {}s",
                    DETACH_TIMEOUT.as_secs()
                )),
                Err(e) => e,
            });
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Restores (or, without `image`, boots) sandbox `id` (directory `dir`) under its next
/// container id, while its previous container may still be retiring.
pub(super) async fn continue_as_next(
    runsc: &super::runsc::Runsc,
    syscalls: Option<&crate::driver::SyscallObserver>,
    dir: &Path,
    id: &str,
    image: Option<&Path>,
    workaround: bool,
) -> Result<()> {
    let cid = super::generation::advance(dir, id)?;
    // An audited sandbox's trace session starts again with it (it is not in the image).
    let pod = super::trace::start(dir, id, syscalls)?;
    let (bundle, log) = (dir.join("bundle"), dir.join("console.log"));
    let started = match image {
        Some(image) => {
            runsc
                .restore_detached(image, &bundle, &cid, &log, workaround, pod.as_deref())
                .await
        }
        None => {
            runsc
                .run_detached(&bundle, &cid, &log, workaround, pod.as_deref())
                .await
        }
    };
    if started.is_err() {
        // What the failed start left behind (the sandbox stays as it was).
        let _ = super::generation::retire(runsc, dir, &cid, &[]).await;
    } else {
        super::console::watch(&log);
    }
    started
}

/// The record of a completed pause.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct Paused {
    /// Whether `checkpoint/` holds the sandbox's memory.
    pub(super) memory: bool,
    /// The layers under the sandbox's writable layer, topmost first (frozen layers of
    /// snapshots, then the template rootfs).
    pub(super) lower: Vec<PathBuf>,
}

/// Writes `record` as `name` in `dir`, atomically (a temporary file, then a rename).
pub(super) fn write_record(dir: &Path, name: &str, record: &Paused) -> Result<()> {
    let bytes = serde_json::to_vec(record)
        .map_err(|e| DriverError::Other(format!("encoding {name}: {e}")))?;
    let tmp = dir.join(format!("{name}.tmp"));
    std::fs::write(&tmp, bytes).map_err(io_err(format!("writing {}", tmp.display())))?;
    std::fs::rename(&tmp, dir.join(name)).map_err(io_err(format!("renaming {}", tmp.display())))
}

impl GvisorDriver {
    pub(super) fn image_dir(&self, id: &str) -> PathBuf {
        self.sandbox_dir(id).join("checkpoint")
    }

    pub(super) fn paused_file(&self, id: &str) -> PathBuf {
        self.sandbox_dir(id).join("paused.json")
    }

    fn detached_marker(&self, id: &str) -> PathBuf {
        detached_marker_in(&self.sandbox_dir(id))
    }

    pub(super) fn read_paused(&self, id: &str) -> Option<Paused> {
        let text = std::fs::read(self.paused_file(id)).ok()?;
        serde_json::from_slice(&text).ok()
    }

    /// Asks the agent to let go of its sockets and waits until it has. The request goes over
    /// the agent's own socket (`/kiln/detach`, no runsc process); an agent that does not know
    /// it (built before) or does not act on it gets `SIGUSR1` through `runsc kill`.
    pub(super) async fn detach_agent(&self, id: &str) -> Result<()> {
        let marker = self.detached_marker(id);
        // The agent writes its marker and removes its socket, runsc makes the socket again
        // after the restore: open until the attach.
        let agent = self.agent(id);
        agent.open();
        let _ = std::fs::remove_file(&marker);
        let asked = request_detach(&agent).await;
        let start = tokio::time::Instant::now();
        let deadline = start + DETACH_TIMEOUT;
        let mut signalled = !asked;
        if signalled {
            self.runsc.output(&["kill", &self.cid(id), "USR1"]).await?;
        }
        while !marker.exists() {
            let now = tokio::time::Instant::now();
            if now >= deadline {
                let _ = self.attach_agent(id).await;
                return Err(DriverError::Other(format!(
                    "the agent of sandbox {id} did not release its sockets within {}s; \
                     templates built before pause support must be rebuilt",
                    DETACH_TIMEOUT.as_secs()
                )));
            }
            if !signalled && now - start >= REQUEST_GRACE {
                signalled = true;
                self.runsc.output(&["kill", &self.cid(id), "USR1"]).await?;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        Ok(())
    }

    /// Has the agent listen on its sockets again (see [`attach_agent_at`]).
    pub(super) async fn attach_agent(&self, id: &str) -> Result<()> {
        attach_agent_at(&self.runsc, &self.agent(id), id).await
    }

    /// The layers the sandbox's writable layer stacks on (the lower dirs of its mount, topmost
    /// first).
    pub(super) fn lower_of(&self, id: &str) -> Result<Vec<PathBuf>> {
        let rootfs = self.sandbox_dir(id).join("rootfs");
        let info = std::fs::read_to_string("/proc/self/mountinfo")
            .map_err(io_err("reading /proc/self/mountinfo"))?;
        let want = rootfs.to_string_lossy();
        info.lines()
            .filter(|l| l.split(' ').nth(4) == Some(want.as_ref()))
            .find_map(|l| {
                l.split(' ')
                    .skip_while(|f| *f != "-")
                    .nth(3)?
                    .split(',')
                    .find_map(|o| o.strip_prefix("lowerdir="))
                    .map(|l| l.split(':').map(PathBuf::from).collect())
            })
            .ok_or_else(|| DriverError::Other(format!("the layer of sandbox {id} is not mounted")))
    }

    pub(super) async fn pause_sandbox(&self, id: &str, memory: bool) -> Result<()> {
        check_id(id)?;
        self.settling.settle(id).await;
        if self.read_paused(id).is_some() {
            return Err(DriverError::Other(format!(
                "sandbox {id} is already paused"
            )));
        }
        // (No `runsc state` here: the manager knows the sandbox runs, and detaching the agent
        // of a sandbox that does not fails anyway.)
        let lower = self.lower_of(id)?;
        let image = self.image_dir(id);
        let _ = std::fs::remove_dir_all(&image);
        std::fs::create_dir_all(&image).map_err(io_err(format!("creating {}", image.display())))?;
        let t = std::time::Instant::now();
        let cid = self.cid(id);
        // A server that ends from here on leaves this record for the next one.
        let begun = Paused { memory, lower };
        self.begin_pause(id, &begun)?;
        if let Err(e) = self.detach_agent(id).await {
            self.end_pause(id);
            return Err(e);
        }
        let t_detach = t.elapsed();
        // A checkpoint also makes gVisor write back what it caches of the sandbox's files, so
        // a filesystem-only pause takes one too and then drops the memory image.
        if let Err(e) = self.runsc.checkpoint(&cid, &image, false).await {
            if memory {
                // Newer runsc leaves the sandbox running after a failed checkpoint.
                self.end_pause(id);
                let _ = self.attach_agent(id).await;
                let _ = std::fs::remove_dir_all(&image);
                return Err(e);
            }
            tracing::warn!(sandbox = id, error = %e, "checkpoint before a filesystem pause");
        }
        let t_checkpoint = t.elapsed();
        if !memory {
            let _ = std::fs::remove_dir_all(&image);
        }
        // The container is deleted in the background (its processes are exiting on their own
        // after the checkpoint); its marker says so until it is done, so that a server that
        // died in between deletes it later.
        let dir = self.sandbox_dir(id);
        let pids = super::reap::identify(&super::reap::sandbox_processes(
            &cid,
            Some(&dir),
            &self.runsc.root,
        ));
        super::generation::mark_retiring(&dir, &cid)?;
        write_record(&dir, "paused.json", &begun)?;
        self.end_pause(id);
        self.retire_later(id, &cid, pids);
        // Nothing writes the console until a resume starts the runtime again.
        super::console::unwatch(&dir.join("console.log"));
        tracing::debug!(
            sandbox = id,
            "pause: detach {:?}, checkpoint {:?}, recorded {:?}",
            t_detach,
            t_checkpoint - t_detach,
            t.elapsed() - t_checkpoint
        );
        Ok(())
    }

    fn halting_marker(&self, id: &str) -> PathBuf {
        self.sandbox_dir(id).join(HALTING)
    }

    /// Restores (or, without `image`, boots) sandbox `id` under its next container id (see
    /// [`continue_as_next`]).
    pub(super) async fn continue_as_next(
        &self,
        id: &str,
        image: Option<&Path>,
        workaround: bool,
    ) -> Result<()> {
        let dir = self.sandbox_dir(id);
        let obs = self.syscalls.get();
        continue_as_next(&self.runsc, obs, &dir, id, image, workaround).await
    }

    pub(super) async fn resume_sandbox(&self, id: &str, memory: bool) -> Result<bool> {
        check_id(id)?;
        let Some(paused) = self.read_paused(id) else {
            return Err(DriverError::NotFound(id.to_string()));
        };
        let dir = self.sandbox_dir(id);
        let t = std::time::Instant::now();
        // (The pause's container retires in the background: the sandbox continues under its
        // next container id meanwhile.)
        self.settling.settle(id).await;
        self.retire_leftovers(id);
        let t_settle = t.elapsed();
        if self.halting_marker(id).exists() {
            // Paused by a kiln before container generations.
            self.halt(id).await?;
            let _ = std::fs::remove_file(self.halting_marker(id));
        }
        mount_run_dir(&dir.join("run"))?;
        let rootfs = dir.join("rootfs");
        if !is_mounted(&rootfs) {
            // The host rebooted while the sandbox was paused.
            if dir.join(super::disk::IMAGE).exists() {
                super::disk::mount(&dir).await?;
            }
            for l in &paused.lower {
                super::disk::ensure_layer(l).await?;
            }
            let (upper, work) = super::disk::layer_dirs(&dir);
            mount_overlay_stack(&paused.lower, &upper, &work, &rootfs)?;
        }
        // (The pause deleted the container before writing paused.json.)
        let image = self.image_dir(id);
        let restore = memory && paused.memory && image.join("checkpoint.img").exists();
        // The agent binds its socket again: the old socket file must be gone (removing it from
        // inside the sandbox does not remove the host's). (Open since the pause; again in case
        // a server restarted in between.)
        self.agent(id).open();
        let _ = std::fs::remove_file(dir.join("run").join(SOCKET_NAME));
        let workaround = self.prepare_restore(id).await?;
        let t_prepare = t.elapsed();
        if restore {
            self.continue_as_next(id, Some(&image), workaround).await?;
            let t_restore = t.elapsed();
            if let Err(e) = self.attach_agent(id).await {
                let _ = self.halt(id).await;
                return Err(e);
            }
            tracing::debug!(
                sandbox = id,
                "resume: settle {:?}, prepare {:?}, restore {:?}, attach {:?}",
                t_settle,
                t_prepare - t_settle,
                t_restore - t_prepare,
                t.elapsed() - t_restore
            );
        } else {
            // A fresh boot: its first connection seals the directory.
            self.agent(id).forget();
            self.continue_as_next(id, None, workaround).await?;
        }
        // Running again: the saved memory no longer matches the disk.
        let _ = std::fs::remove_file(self.paused_file(id));
        let _ = std::fs::remove_dir_all(&image);
        Ok(restore)
    }

    pub(super) fn paused_on_host(&self, id: &str) -> bool {
        check_id(id).is_ok() && self.read_paused(id).is_some()
    }
}

#[async_trait::async_trait]
impl Checkpoint for GvisorDriver {
    async fn pause(&self, id: &str, memory: bool) -> Result<()> {
        self.pause_sandbox(id, memory).await
    }

    async fn resume(&self, id: &str, memory: bool) -> Result<bool> {
        self.resume_sandbox(id, memory).await
    }

    async fn is_paused(&self, id: &str) -> Result<bool> {
        // A pause a server's end cut short is settled first.
        self.settle_begun_pause(id).await?;
        Ok(self.paused_on_host(id))
    }

    async fn snapshot(&self, id: &str, snapshot: &SnapshotRef, memory: bool) -> Result<u64> {
        self.take_snapshot(id, snapshot, memory, None).await
    }

    async fn snapshot_ending(&self, id: &str, snapshot: &SnapshotRef) -> Result<u64> {
        self.take_snapshot_ending(id, snapshot).await
    }

    async fn capture_for_fork(&self, id: &str, snapshot: &SnapshotRef) -> Result<u64> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.holds_map().insert(id.to_string(), tx);
        let r = self.take_snapshot(id, snapshot, true, Some(rx)).await;
        if r.is_err() {
            self.holds_map().remove(id);
        }
        r
    }

    fn release_source(&self, id: &str) {
        self.holds_map().remove(id);
    }

    async fn restore(&self, snapshot: &SnapshotRef, spec: &SandboxSpec) -> Result<()> {
        self.restore_snapshot(snapshot, spec).await
    }

    async fn delete_snapshot(&self, snapshot: &SnapshotRef) -> Result<()> {
        self.remove_snapshot(snapshot)
    }

    async fn portable_pause(&self, id: &str) -> Result<PortablePause> {
        self.export_paused(id).await
    }

    async fn incoming_dir(&self, id: &str) -> Result<PathBuf> {
        self.fresh_incoming(id).await
    }

    async fn adopt_paused(&self, spec: &SandboxSpec) -> Result<()> {
        self.adopt_incoming(spec).await
    }

    async fn portable_snapshot(&self, snapshot: &SnapshotRef) -> Result<PortablePause> {
        self.export_snapshot(snapshot).await
    }

    async fn incoming_snapshot_dir(&self, snapshot: &SnapshotRef) -> Result<PathBuf> {
        self.fresh_incoming_snapshot(snapshot).await
    }

    async fn adopt_snapshot(&self, snapshot: &SnapshotRef, rootfs: &Path) -> Result<u64> {
        self.adopt_incoming_snapshot(snapshot, rootfs).await
    }
}
