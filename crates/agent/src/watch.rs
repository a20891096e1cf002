//! inotify-based directory watching (recursive optional), reporting envd event types.

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};

use kiln_proto::filesystem::{EventType, FilesystemEvent};
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, WatchDescriptor};
use tokio::io::unix::AsyncFd;
use tokio::sync::mpsc;

use crate::rpc::RpcError;

/// Events kept for a watcher nobody drains (older ones are dropped).
pub const MAX_BUFFERED: usize = 100_000;

struct Fd(Inotify);
impl AsRawFd for Fd {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

fn mask() -> AddWatchFlags {
    AddWatchFlags::IN_CREATE
        | AddWatchFlags::IN_MODIFY
        | AddWatchFlags::IN_DELETE
        | AddWatchFlags::IN_MOVED_FROM
        | AddWatchFlags::IN_MOVED_TO
        | AddWatchFlags::IN_ATTRIB
        | AddWatchFlags::IN_DELETE_SELF
        | AddWatchFlags::IN_MOVE_SELF
        | AddWatchFlags::IN_DONT_FOLLOW
}

/// A started watch; events arrive on the receiver until it is dropped.
pub struct Watch {
    pub events: mpsc::Receiver<FilesystemEvent>,
}

/// Start watching `root` (must be a directory). `include_entry` attaches EntryInfo to events.
pub fn start(root: PathBuf, recursive: bool, include_entry: bool) -> Result<Watch, RpcError> {
    let m = std::fs::metadata(&root)
        .map_err(|e| RpcError::io(&format!("watch {}", root.display()), &e))?;
    if !m.is_dir() {
        return Err(RpcError::invalid(format!(
            "path {} is not a directory",
            root.display()
        )));
    }
    let ino = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)
        .map_err(|e| RpcError::internal(format!("inotify_init: {e}")))?;
    let mut wds: HashMap<WatchDescriptor, PathBuf> = HashMap::new();
    add_tree(&ino, &root, Path::new(""), recursive, &mut wds)
        .map_err(|e| RpcError::internal(format!("watch {}: {e}", root.display())))?;
    // SAFETY: the inotify fd is owned by the wrapper moved into the AsyncFd and stays open and
    // unchanged until the AsyncFd is dropped.
    let afd = unsafe { AsyncFd::register(Fd(ino)) }
        .map_err(|e| RpcError::internal(format!("register inotify fd: {e}")))?;
    let (tx, rx) = mpsc::channel(4096);
    tokio::spawn(async move {
        loop {
            let batch = tokio::select! {
                _ = tx.closed() => return,
                g = afd.readable() => {
                    let Ok(mut g) = g else { return };
                    match g.try_io(|f| f.get_ref().0.read_events().map_err(std::io::Error::from)) {
                        Ok(Ok(evs)) => evs,
                        Ok(Err(e)) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                        Ok(Err(e)) => {
                            tracing::debug!("inotify read failed: {e}");
                            return;
                        }
                        Err(_) => continue,
                    }
                }
            };
            for ev in batch {
                let Some(dir) = wds.get(&ev.wd).cloned() else {
                    continue;
                };
                let rel = match &ev.name {
                    Some(n) => dir.join(n),
                    None => dir.clone(),
                };
                let m = ev.mask;
                if m.contains(AddWatchFlags::IN_IGNORED) {
                    wds.remove(&ev.wd);
                    continue;
                }
                let is_dir = m.contains(AddWatchFlags::IN_ISDIR);
                if recursive
                    && is_dir
                    && (m.contains(AddWatchFlags::IN_CREATE)
                        || m.contains(AddWatchFlags::IN_MOVED_TO))
                {
                    let _ = add_tree(&afd.get_ref().0, &root.join(&rel), &rel, true, &mut wds);
                }
                // Self events of subdirectories are reported by their parent already.
                if ev.name.is_none() && !rel.as_os_str().is_empty() {
                    continue;
                }
                let ty = if m.contains(AddWatchFlags::IN_CREATE)
                    || m.contains(AddWatchFlags::IN_MOVED_TO)
                {
                    EventType::Create
                } else if m.contains(AddWatchFlags::IN_DELETE)
                    || m.contains(AddWatchFlags::IN_DELETE_SELF)
                {
                    EventType::Remove
                } else if m.contains(AddWatchFlags::IN_MOVED_FROM)
                    || m.contains(AddWatchFlags::IN_MOVE_SELF)
                {
                    EventType::Rename
                } else if m.contains(AddWatchFlags::IN_MODIFY) {
                    EventType::Write
                } else if m.contains(AddWatchFlags::IN_ATTRIB) {
                    EventType::Chmod
                } else {
                    continue;
                };
                let entry = if include_entry
                    && matches!(ty, EventType::Create | EventType::Write | EventType::Chmod)
                {
                    crate::fs::entry_info(&root.join(&rel)).ok()
                } else {
                    None
                };
                let fe = FilesystemEvent {
                    name: rel.to_string_lossy().into_owned(),
                    r#type: ty as i32,
                    entry,
                };
                if tx.send(fe).await.is_err() {
                    return;
                }
            }
        }
    });
    Ok(Watch { events: rx })
}

fn add_tree(
    ino: &Inotify,
    abs: &Path,
    rel: &Path,
    recursive: bool,
    wds: &mut HashMap<WatchDescriptor, PathBuf>,
) -> nix::Result<()> {
    let wd = ino.add_watch(abs, mask())?;
    wds.insert(wd, rel.to_path_buf());
    if recursive {
        if let Ok(rd) = std::fs::read_dir(abs) {
            for e in rd.flatten() {
                if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                    let _ = add_tree(ino, &e.path(), &rel.join(e.file_name()), true, wds);
                }
            }
        }
    }
    Ok(())
}
