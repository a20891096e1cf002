//! Host memory pressure as it happens, not at the watcher's next tick: the kernel wakes the
//! server when a sandbox's host cgroup crosses a memory threshold, and the server runs the
//! same check as the tick (`pressure.rs`) at once.
//!
//! Why: a fork loop whose processes hold memory grows the host side by ≈170 MiB/s (measured,
//! docs/hardening.md), so a 1 s tick can see it up to ≈170 MiB late, and `runsc kill` plus a
//! CPU-starved agent add seconds more. Being woken costs nothing while nothing happens.
//!
//! - **cgroup v1:** `cgroup.event_control` registrations of one eventfd on
//!   `memory.usage_in_bytes` at every [`STEP_PCT`] % of the limit from [`FIRST_PCT`] % on (the
//!   kernel signals each crossing, up or down; the check keeps only new highs), and on
//!   `memory.oom_control` (the cgroup reached its limit and reclaim failed). The kernel also
//!   signals every registered eventfd when the cgroup is removed, which ends the watch.
//! - **cgroup v2** (also at `/sys/fs/cgroup/unified` on hybrid hosts): v2 has no usage
//!   thresholds; `memory.events` changes (a file-modified event, taken with inotify) whenever
//!   its `high`, `max` or `oom` counters move. The server sets `memory.high` to [`V2_HIGH_PCT`] %
//!   of `memory.max` when it is unset, so the kernel throttles the sentry there (a reserve in
//!   time, not an OOM kill) and tells the server through `high`.
//!
//! A sandbox whose cgroup cannot be watched (no memory controller, cgroups ignored) is simply
//! left to the tick.

use std::collections::HashMap;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use tokio::io::unix::AsyncFd;

/// First registered threshold (percent of the host limit): the tick's start (`MEMORY_HIGH`).
pub const FIRST_PCT: u64 = 50;
/// Thresholds every this many percent above it (the tick's step).
pub const STEP_PCT: u64 = 5;
/// `memory.high` set on cgroup v2, percent of `memory.max`.
pub const V2_HIGH_PCT: u64 = 90;

/// Usage thresholds (bytes) for a host limit of `limit` bytes.
pub fn thresholds(limit: u64) -> Vec<u64> {
    (FIRST_PCT..100)
        .step_by(STEP_PCT as usize)
        .map(|pct| (u128::from(limit) * u128::from(pct) / 100) as u64)
        .collect()
}

/// The `memory.high` to set on cgroup v2 for a `memory.max` text, if it is a number and
/// `memory.high` (`high`) is still `max`.
pub fn v2_high(max: &str, high: &str) -> Option<u64> {
    let max: u64 = max.trim().parse().ok()?;
    (high.trim() == "max").then(|| (u128::from(max) * u128::from(V2_HIGH_PCT) / 100) as u64)
}

/// One sandbox's source of memory events.
struct Source {
    fd: AsyncFd<OwnedFd>,
    /// The cgroup directory (the watch ends when it is gone).
    dir: PathBuf,
}

fn last_os() -> std::io::Error {
    std::io::Error::last_os_error()
}

/// Registers v1 thresholds and the OOM notification of the memory cgroup `dir` on a new
/// eventfd.
fn register_v1(dir: &Path) -> std::io::Result<OwnedFd> {
    let limit: u64 = std::fs::read_to_string(dir.join("memory.limit_in_bytes"))?
        .trim()
        .parse()
        .map_err(|_| std::io::Error::other("unreadable memory.limit_in_bytes"))?;
    // SAFETY: eventfd takes plain integers; a non-negative result is a new descriptor we own.
    let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if raw < 0 {
        return Err(last_os());
    }
    // SAFETY: `raw` is a fresh descriptor owned by nobody else.
    let efd = unsafe { OwnedFd::from_raw_fd(raw) };
    let usage = std::fs::File::open(dir.join("memory.usage_in_bytes"))?;
    let oom = std::fs::File::open(dir.join("memory.oom_control"))?;
    let mut control = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.join("cgroup.event_control"))?;
    // One write per registration: the kernel parses each write as one event.
    for t in thresholds(limit) {
        control.write_all(format!("{} {} {t}", efd.as_raw_fd(), usage.as_raw_fd()).as_bytes())?;
    }
    control.write_all(format!("{} {}", efd.as_raw_fd(), oom.as_raw_fd()).as_bytes())?;
    // The kernel holds its own references: the files may close.
    Ok(efd)
}

/// Watches `memory.events` of the v2 cgroup `dir` with inotify, setting `memory.high` first.
fn register_v2(dir: &Path) -> std::io::Result<OwnedFd> {
    let max = std::fs::read_to_string(dir.join("memory.max"))?;
    let high = std::fs::read_to_string(dir.join("memory.high"))?;
    if let Some(h) = v2_high(&max, &high) {
        std::fs::write(dir.join("memory.high"), h.to_string())?;
    }
    // SAFETY: inotify_init1 takes flags; a non-negative result is a new descriptor we own.
    let raw = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
    if raw < 0 {
        return Err(last_os());
    }
    // SAFETY: `raw` is a fresh descriptor owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let path = std::ffi::CString::new(
        dir.join("memory.events")
            .into_os_string()
            .into_encoded_bytes(),
    )
    .map_err(|_| std::io::Error::other("NUL in a cgroup path"))?;
    // SAFETY: a valid descriptor and a NUL-terminated path that outlives the call.
    if unsafe { libc::inotify_add_watch(fd.as_raw_fd(), path.as_ptr(), libc::IN_MODIFY) } < 0 {
        return Err(last_os());
    }
    Ok(fd)
}

/// The event source of container `cid`'s memory cgroup: v1, v2, or v2 on a hybrid host.
fn open(cid: &str) -> Option<Source> {
    let v1 = PathBuf::from(format!("/sys/fs/cgroup/memory/kiln/{cid}"));
    let v2 = [
        PathBuf::from(format!("/sys/fs/cgroup/kiln/{cid}")),
        PathBuf::from(format!("/sys/fs/cgroup/unified/kiln/{cid}")),
    ];
    let (fd, dir) = if v1.join("cgroup.event_control").exists() {
        (register_v1(&v1), v1)
    } else {
        let dir = v2.into_iter().find(|d| d.join("memory.events").exists())?;
        (register_v2(&dir), dir)
    };
    // SAFETY: the OwnedFd moves into the AsyncFd, so it stays open and the same for the
    // AsyncFd's whole life.
    let fd = fd.and_then(|fd| unsafe { AsyncFd::register(fd) }.map_err(std::io::Error::from));
    match fd {
        Ok(fd) => Some(Source { fd, dir }),
        Err(e) => {
            tracing::warn!(container = cid, error = %e, "cannot watch host memory events");
            None
        }
    }
}

/// Drains whatever the descriptor has (an eventfd counter or inotify records).
fn drain(fd: &OwnedFd) {
    let mut buf = [0u8; 4096];
    loop {
        // SAFETY: reading into a stack buffer of the given length.
        let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n <= 0 {
            return;
        }
    }
}

/// Calls `on_event` on every event of `src`, until its cgroup is gone.
async fn watch(src: Source, on_event: impl Fn()) {
    loop {
        let Ok(mut guard) = src.fd.readable().await else {
            return;
        };
        drain(src.fd.get_ref());
        guard.clear_ready();
        if !src.dir.exists() {
            return;
        }
        on_event();
    }
}

/// The memory-event watches of running sandboxes, by container id.
#[derive(Default)]
pub struct MemoryEvents {
    watches: Mutex<HashMap<String, tokio::task::JoinHandle<()>>>,
}

impl MemoryEvents {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, tokio::task::JoinHandle<()>>> {
        self.watches.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Ends the watches of containers not in `running`.
    pub fn retain(&self, running: &[String]) {
        self.lock().retain(|cid, task| {
            let keep = running.contains(cid);
            if !keep {
                task.abort();
            }
            keep
        });
    }

    /// Watches container `cid` (once; again after a watch ended), calling `on_event` on every
    /// event; true when it was not watched before. Needs a tokio runtime.
    pub fn ensure<F>(&self, cid: &str, on_event: F) -> bool
    where
        F: Fn() + Send + Sync + 'static,
    {
        let mut watches = self.lock();
        if watches.contains_key(cid) {
            return false;
        }
        // Not watchable: a finished task is remembered, so the tick does not retry every second.
        let task = match open(cid) {
            Some(src) => tokio::spawn(watch(src, on_event)),
            None => tokio::spawn(async {}),
        };
        watches.insert(cid.to_string(), task);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thresholds_from_half_every_five_percent() {
        let t = thresholds(1000);
        assert_eq!(t, vec![500, 550, 600, 650, 700, 750, 800, 850, 900, 950]);
        // A 1,216 MiB host limit (a 320 MiB sandbox): from 608 MiB.
        assert_eq!(thresholds(1216 << 20)[0], 608 << 20);
    }

    #[test]
    fn v2_high_only_when_unset() {
        assert_eq!(v2_high("1000\n", "max\n"), Some(900));
        assert_eq!(v2_high("1000\n", "800\n"), None);
        assert_eq!(v2_high("max\n", "max\n"), None);
    }

    #[tokio::test]
    async fn an_eventfd_wakes_the_watch_and_a_missing_cgroup_ends_it() {
        // The watch loop on a plain eventfd: one write, one call.
        // SAFETY: eventfd takes plain integers.
        let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        assert!(raw >= 0);
        // SAFETY: a fresh descriptor.
        let efd = unsafe { OwnedFd::from_raw_fd(raw) };
        let writer = efd.try_clone().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let src = Source {
            // SAFETY: as in `open`.
            fd: unsafe { AsyncFd::register(efd) }.unwrap(),
            dir: dir.path().to_path_buf(),
        };
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let w = MemoryEvents::default();
        let task = tokio::spawn(watch(src, move || tx.send(()).unwrap()));
        w.lock().insert("c".into(), task);
        let one = 1u64.to_ne_bytes();
        // SAFETY: writing 8 bytes to an eventfd.
        unsafe { libc::write(writer.as_raw_fd(), one.as_ptr().cast(), 8) };
        tokio::time::timeout(std::time::Duration::from_secs(5), rx.recv())
            .await
            .unwrap();
        drop(dir);
        // SAFETY: as above.
        unsafe { libc::write(writer.as_raw_fd(), one.as_ptr().cast(), 8) };
        for _ in 0..100 {
            if w.lock()["c"].is_finished() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        assert!(w.lock()["c"].is_finished());
        w.retain(&[]);
        assert!(w.lock().is_empty());
    }
}
