//! Pause and resume of a gVisor sandbox: `runsc checkpoint` into the sandbox's directory, then
//! `runsc restore` from it.
//!
//! gVisor cannot checkpoint a sandbox that holds sockets backed by the host, and the agent's
//! socket (`--host-uds=create`) is one. So the agent is detached first (`SIGUSR1`: it closes
//! its listeners and connections, then writes `run/agent.sock.detached`), and attached again
//! after a restore (`SIGUSR2`).
//!
//! Per sandbox, next to the layer and bundle (see the module docs of [`super`]):
//! - `checkpoint/`: runsc's image of memory and processes (full pauses only);
//! - `halting`: present until the paused sandbox's container is deleted (in the background,
//!   after the pause returned);
//! - `paused.json`: written last, atomically, once the pause is complete; it says whether the
//!   memory was kept and which template rootfs the layer stacks on (to mount it again after a
//!   host reboot). A sandbox without it is not paused, whatever else is on disk.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::mounts::{is_mounted, mount_overlay_stack};
use super::{check_id, GvisorDriver, SOCKET_NAME};
use crate::driver::{io_err, DriverError, Result};

/// Present while the container of a paused sandbox is still being deleted.
const HALTING: &str = "halting";

/// How long the agent may take to let go of its sockets.
const DETACH_TIMEOUT: Duration = Duration::from_secs(5);

/// How long the agent gets to act on a detach or attach request before it is signalled.
const REQUEST_GRACE: Duration = Duration::from_millis(500);

/// Sends `POST /kiln/detach` to the agent listening on `socket`: true when it was delivered
/// to an agent that knows the request (a 202, or the connection closing as the agent
/// detaches before its answer went out), false for an agent that does not (404) or when
/// the socket cannot be reached.
async fn request_detach(socket: &Path) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut s) = super::connect_no_follow(socket).await else {
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

/// Has the agent of sandbox `id` (directory `dir`) listen on its sockets again: removing its
/// `.detached` marker is the request (a detached agent watches it). An agent that does not
/// attach within [`REQUEST_GRACE`] (built before this) gets `SIGUSR2` through `runsc kill`.
pub(super) async fn attach_agent_at(
    runsc: &super::runsc::Runsc,
    dir: &Path,
    id: &str,
) -> Result<()> {
    let _ = std::fs::remove_file(detached_marker_in(dir));
    let socket = dir.join("run").join(SOCKET_NAME);
    let start = tokio::time::Instant::now();
    while start.elapsed() < REQUEST_GRACE {
        // Connectable, not merely present: a socket file left from before the pause accepts
        // nothing.
        if super::connect_no_follow(&socket).await.is_ok() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    runsc.output(&["kill", id, "USR2"]).await.map(drop)
}

/// The record of a completed pause.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Paused {
    /// Whether `checkpoint/` holds the sandbox's memory.
    memory: bool,
    /// The layers under the sandbox's writable layer, topmost first (frozen layers of
    /// snapshots, then the template rootfs).
    lower: Vec<PathBuf>,
}

impl GvisorDriver {
    fn image_dir(&self, id: &str) -> PathBuf {
        self.sandbox_dir(id).join("checkpoint")
    }

    fn paused_file(&self, id: &str) -> PathBuf {
        self.sandbox_dir(id).join("paused.json")
    }

    fn detached_marker(&self, id: &str) -> PathBuf {
        detached_marker_in(&self.sandbox_dir(id))
    }

    fn read_paused(&self, id: &str) -> Option<Paused> {
        let text = std::fs::read(self.paused_file(id)).ok()?;
        serde_json::from_slice(&text).ok()
    }

    /// Asks the agent to let go of its sockets and waits until it has. The request goes over
    /// the agent's own socket (`/kiln/detach`, no runsc process); an agent that does not know
    /// it (built before) or does not act on it gets `SIGUSR1` through `runsc kill`.
    pub(super) async fn detach_agent(&self, id: &str) -> Result<()> {
        let marker = self.detached_marker(id);
        let _ = std::fs::remove_file(&marker);
        let asked = request_detach(&self.socket_path(id)).await;
        let start = tokio::time::Instant::now();
        let deadline = start + DETACH_TIMEOUT;
        let mut signalled = !asked;
        if signalled {
            self.runsc.output(&["kill", id, "USR1"]).await?;
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
                self.runsc.output(&["kill", id, "USR1"]).await?;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        Ok(())
    }

    /// Has the agent listen on its sockets again (see [`attach_agent_at`]).
    pub(super) async fn attach_agent(&self, id: &str) -> Result<()> {
        attach_agent_at(&self.runsc, &self.sandbox_dir(id), id).await
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
        self.detach_agent(id).await?;
        let t_detach = t.elapsed();
        // A checkpoint also makes gVisor write back what it caches of the sandbox's files, so
        // a filesystem-only pause takes one too and then drops the memory image.
        if let Err(e) = self.runsc.checkpoint(id, &image, false).await {
            if memory {
                // Newer runsc leaves the sandbox running after a failed checkpoint.
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
        // after the checkpoint); `halting` says so until it is done, so that a resume after a
        // server crash in between deletes it first.
        let halting = self.halting_marker(id);
        std::fs::write(&halting, b"").map_err(io_err(format!("writing {}", halting.display())))?;
        let record = serde_json::to_vec(&Paused { memory, lower })
            .map_err(|e| DriverError::Other(format!("encoding paused.json: {e}")))?;
        let tmp = self.sandbox_dir(id).join("paused.json.tmp");
        std::fs::write(&tmp, record).map_err(io_err(format!("writing {}", tmp.display())))?;
        std::fs::rename(&tmp, self.paused_file(id))
            .map_err(io_err(format!("renaming {}", tmp.display())))?;
        let (runsc, dir, sid) = (self.runsc.clone(), self.sandbox_dir(id), id.to_string());
        self.settling.spawn(id, async move {
            match super::halt_container(&runsc, &sid, &dir).await {
                Ok(()) => {
                    let _ = std::fs::remove_file(dir.join(HALTING));
                }
                Err(e) => tracing::warn!(sandbox = sid, error = %e, "deleting a paused container"),
            }
        });
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

    pub(super) async fn resume_sandbox(&self, id: &str, memory: bool) -> Result<bool> {
        check_id(id)?;
        let Some(paused) = self.read_paused(id) else {
            return Err(DriverError::NotFound(id.to_string()));
        };
        let dir = self.sandbox_dir(id);
        let t = std::time::Instant::now();
        // The pause's container must be gone before one with the same id starts.
        self.settling.settle(id).await;
        let t_settle = t.elapsed();
        if self.halting_marker(id).exists() {
            self.halt(id).await?;
            let _ = std::fs::remove_file(self.halting_marker(id));
        }
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
        // inside the sandbox does not remove the host's).
        let _ = std::fs::remove_file(dir.join("run").join(SOCKET_NAME));
        let workaround = self.prepare_restore(id).await?;
        // An audited sandbox's trace session starts again with it (it is not in the image).
        let pod = super::trace::start(&dir, id, self.syscalls.get())?;
        let t_prepare = t.elapsed();
        if restore {
            self.runsc
                .restore_detached(
                    &image,
                    &dir.join("bundle"),
                    id,
                    &dir.join("console.log"),
                    workaround,
                    pod.as_deref(),
                )
                .await?;
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
            self.runsc
                .run_detached(
                    &dir.join("bundle"),
                    id,
                    &dir.join("console.log"),
                    workaround,
                    pod.as_deref(),
                )
                .await?;
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
