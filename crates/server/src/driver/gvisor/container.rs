//! The host side of a sandbox's container: ending it (processes killed and reaped, then
//! `runsc delete`), and connecting to its agent's socket in the directory the sandbox shares
//! with the host without following anything planted there.

use std::path::Path;

use super::reap::{self, reap_adopted_zombies};
use super::runsc::Runsc;
use crate::driver::Result;

/// Ends container `id` of sandbox directory `dir` and its processes (see
/// [`GvisorDriver::halt`]).
pub(super) async fn halt_container(runsc: &Runsc, id: &str, dir: &Path) -> Result<()> {
    // Kill the sandbox's processes and reap them ourselves: runsc delete then finds them
    // gone instead of polling for seconds until the host's init reaps the zombies.
    reap::kill_and_reap(&reap::sandbox_processes(id, Some(dir))).await;
    delete(runsc, id).await
}

/// `runsc delete --force` of container `id`, reaping its processes as they exit; done when
/// the container is gone (deleted now or before). runsc takes a unique prefix of an id: a
/// container that is already gone is not asked for again.
pub(super) async fn delete(runsc: &Runsc, id: &str) -> Result<()> {
    if !runsc.exists(id).await {
        reap_adopted_zombies();
        return Ok(());
    }
    // delete --force kills what is left, removes the cgroups and runsc's state. It fails for
    // an unknown container (never created, or a concurrent stop won): only fail if the
    // container is still there. Processes that exit meanwhile (a checkpointed sandbox's do
    // on their own) are reaped as they go, or runsc waits seconds for them.
    let reaping = async {
        loop {
            reap_adopted_zombies();
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
    };
    let args = ["delete", "--force", id];
    let deleted = tokio::select! {
        r = runsc.output(&args) => r,
        never = reaping => never,
    };
    if let Err(e) = deleted {
        if runsc.exists(id).await {
            return Err(e);
        }
    }
    reap_adopted_zombies();
    Ok(())
}

/// Connects to the agent's socket at `path` in the directory shared with the sandbox, where
/// root in the sandbox can plant anything: the final component must be a socket itself (never
/// a symlink), and the connection goes through the descriptor opened with `O_NOFOLLOW`, so the
/// name cannot be swapped between the check and the connect.
pub(super) async fn connect_no_follow(path: &Path) -> std::io::Result<tokio::net::UnixStream> {
    use std::os::unix::fs::FileTypeExt;
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                "the agent socket was replaced by a link",
            ),
            _ => e,
        })?;
    if !f.metadata()?.file_type().is_socket() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            "the agent socket was replaced by something else",
        ));
    }
    use std::os::fd::AsRawFd;
    let via_fd = format!("/proc/self/fd/{}", f.as_raw_fd());
    let s = tokio::net::UnixStream::connect(via_fd).await;
    drop(f);
    s
}
