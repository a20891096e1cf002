//! The sandbox's console log (runsc's and the agent's stdout/stderr, opened `O_APPEND` by
//! runsc's parent): capped by rotation, so a sandbox that floods its console uses at most
//! about [`CONSOLE_MAX`] plus what it writes in one [`CHECK_EVERY`] of host disk.
//!
//! The driver has a log watched from the moment its runtime starts until it pauses or stops
//! ([`watch`], [`unwatch`]); the watcher's once-a-second tick names each running sandbox's log
//! too ([`rotate_if_large`]: after a server restart, the sandboxes it adopted). A thread of
//! this module waits for the kernel to say a watched log was written (inotify `IN_MODIFY`),
//! then checks that log's size and rotates it; a log nobody writes costs nothing, whatever
//! the number of sandboxes. Once a second it forgets the logs gone with their sandbox.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, WatchDescriptor};

/// Size at which `console.log` is rotated.
pub const CONSOLE_MAX: u64 = 4 << 20;
/// How much of the rotated log is kept in `console.log.1`.
const KEEP: u64 = 1 << 20;
/// How long the thread lets writes gather after a look (the kernel merges a log's repeated
/// events meanwhile): a flood grows a log by what it writes in this, a chatty sandbox costs
/// at most one look per period.
pub const CHECK_EVERY: Duration = Duration::from_millis(5);
/// How often the logs gone with their sandbox are forgotten.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// A watched log: its path, the descriptor the thread keeps open on it (a close after a
/// truncation would make ext4 allocate and flush what the writer added), and how many times
/// its size was looked at.
struct Log {
    path: PathBuf,
    file: File,
    looks: u64,
}

#[derive(Default)]
struct Logs {
    by_path: HashMap<PathBuf, WatchDescriptor>,
    by_wd: HashMap<WatchDescriptor, Log>,
}

impl Log {
    /// Unlinked with its sandbox's directory (this descriptor is what keeps it), or unreadable.
    fn unlinked(&self) -> bool {
        self.file.metadata().map_or(true, |m| m.nlink() == 0)
    }
}

impl Logs {
    fn remove(&mut self, wd: WatchDescriptor) {
        if let Some(l) = self.by_wd.remove(&wd) {
            if self.by_path.get(&l.path) == Some(&wd) {
                self.by_path.remove(&l.path);
            }
        }
    }
}

struct Watcher {
    inotify: Inotify,
    logs: Mutex<Logs>,
}

impl Watcher {
    fn lock(&self) -> MutexGuard<'_, Logs> {
        self.logs.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The watcher and its thread, started on first use (None when the host refuses an inotify
/// instance or a thread: logs then rotate on the once-a-second tick alone).
fn watcher() -> Option<&'static Watcher> {
    static WATCHER: OnceLock<Option<Watcher>> = OnceLock::new();
    WATCHER
        .get_or_init(|| {
            let inotify = match Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC) {
                Ok(i) => i,
                Err(e) => {
                    tracing::warn!(error = %e, "no inotify instance for console logs; they rotate once a second");
                    return None;
                }
            };
            if let Err(e) = std::thread::Builder::new()
                .name("kiln-console".into())
                .spawn(check_loop)
            {
                tracing::warn!(error = %e, "cannot start the console log thread; logs rotate once a second");
                return None;
            }
            Some(Watcher {
                inotify,
                logs: Mutex::default(),
            })
        })
        .as_ref()
}

fn check_loop() {
    // A flooding sandbox keeps the host's CPUs busy; this thread needs little CPU but must
    // get it on time: real-time round-robin at the lowest priority (it sleeps between looks
    // and the kernel's real-time throttling bounds it), else nice -10. Both need root, which
    // `kiln serve` is; without it the thread runs at normal priority.
    // SAFETY: sched_setscheduler(2)/setpriority(2) on the calling thread (0 / its own id) with
    // a valid sched_param.
    unsafe {
        let param = libc::sched_param { sched_priority: 1 };
        if libc::sched_setscheduler(0, libc::SCHED_RR, &param) != 0 {
            libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, -10);
        }
    }
    let Some(w) = watcher() else {
        return;
    };
    let mut swept = Instant::now();
    loop {
        let mut ready = [PollFd::new(w.inotify.as_fd(), PollFlags::POLLIN)];
        let _ = poll(
            &mut ready,
            PollTimeout::from(SWEEP_EVERY.as_millis() as u16),
        );
        // (Nonblocking: nothing to read is an error, and no event.)
        let events = w.inotify.read_events().unwrap_or_default();
        let mut logs = w.lock();
        let mut written = HashSet::new();
        for e in events {
            if e.mask.contains(AddWatchFlags::IN_Q_OVERFLOW) {
                // Events were dropped: any log may have grown.
                written.extend(logs.by_wd.keys().copied());
            } else if e.mask.contains(AddWatchFlags::IN_IGNORED) {
                logs.remove(e.wd);
            } else {
                written.insert(e.wd);
            }
        }
        for wd in written {
            if let Some(l) = logs.by_wd.get_mut(&wd) {
                l.looks += 1;
                if l.file.metadata().is_ok_and(|m| m.len() > CONSOLE_MAX) {
                    rotate_open(&l.path, &l.file);
                }
            }
        }
        if swept.elapsed() >= SWEEP_EVERY {
            swept = Instant::now();
            let gone: Vec<WatchDescriptor> = logs
                .by_wd
                .iter()
                .filter(|(_, l)| l.unlinked())
                .map(|(wd, _)| *wd)
                .collect();
            for wd in gone {
                let _ = w.inotify.rm_watch(wd);
                logs.remove(wd);
            }
        }
        drop(logs);
        std::thread::sleep(CHECK_EVERY);
    }
}

fn open(log: &Path) -> Option<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(log)
        .ok()
}

/// Has `log` checked each time it is written, from now on until [`unwatch`] or until it is
/// gone, and rotates it now when a new watch finds it over the cap (nothing was looked at
/// while it was not watched). True when it is watched after the call; false when it does not
/// exist or the host refuses a watch.
pub(crate) fn watch(log: &Path) -> bool {
    let Some(w) = watcher() else {
        return false;
    };
    let mut logs = w.lock();
    if let Some(wd) = logs.by_path.get(log).copied() {
        let live = logs.by_wd.get(&wd).is_some_and(|l| !l.unlinked());
        if live {
            return true;
        }
        let _ = w.inotify.rm_watch(wd);
        logs.remove(wd);
    }
    let Some(file) = open(log) else {
        return false;
    };
    match w.inotify.add_watch(log, AddWatchFlags::IN_MODIFY) {
        // (The same file under another name keeps its first entry.)
        Ok(wd) if logs.by_wd.contains_key(&wd) => true,
        Ok(wd) => {
            rotate_open(log, &file);
            logs.by_path.insert(log.to_path_buf(), wd);
            let path = log.to_path_buf();
            logs.by_wd.insert(
                wd,
                Log {
                    path,
                    file,
                    looks: 0,
                },
            );
            true
        }
        Err(e) => {
            tracing::warn!(error = %e, log = %log.display(), "watching a console log; it rotates once a second");
            false
        }
    }
}

/// Stops watching `log` (its runtime stopped: nothing writes it).
pub(crate) fn unwatch(log: &Path) {
    let Some(w) = watcher() else {
        return;
    };
    let mut logs = w.lock();
    if let Some(wd) = logs.by_path.get(log).copied() {
        let _ = w.inotify.rm_watch(wd);
        logs.remove(wd);
    }
}

/// Has `log` checked each time it is written from now on ([`watch`], which rotates it when
/// it finds it over [`CONSOLE_MAX`]); one that cannot be watched is rotated now if it is over
/// (the once-a-second tick's fallback).
pub fn rotate_if_large(log: &Path) {
    if !watch(log) {
        rotate(log);
    }
}

/// When `log` is larger than [`CONSOLE_MAX`]: its last [`KEEP`] bytes go to `<log>.1`
/// (replacing it) and `log` is truncated in place. The writer's descriptor is `O_APPEND`, so it
/// carries on at the new end.
fn rotate(log: &Path) {
    if let Some(f) = open(log) {
        rotate_open(log, &f);
    }
}

/// [`rotate`] through an open descriptor `f` of `log`: the truncation comes first, the copy
/// of the kept tail to `<log>.1` after it.
fn rotate_open(log: &Path, mut f: &File) {
    // One rotation at a time (the tick and the thread may meet on a log).
    static ROTATING: Mutex<()> = Mutex::new(());
    let _one = ROTATING.lock().unwrap_or_else(|p| p.into_inner());
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    if len <= CONSOLE_MAX {
        return;
    }
    let mut keep = Vec::with_capacity(KEEP as usize);
    if f.seek(SeekFrom::Start(len - KEEP)).is_ok() {
        let _ = f.take(KEEP).read_to_end(&mut keep);
    }
    let _ = f.set_len(0);
    let older = log.with_extension("log.1");
    let tmp = log.with_extension("log.1.tmp");
    let written = File::create(&tmp).and_then(|mut o| {
        o.write_all(b"[kiln: console log rotated; older output dropped]\n")?;
        o.write_all(&keep)
    });
    if written.is_ok() {
        let _ = std::fs::rename(&tmp, &older);
    }
}

/// Last `max` bytes of a file, lossily decoded (empty when unreadable). Reads only the tail:
/// a console log can be large.
pub fn tail(path: &Path, max: usize) -> String {
    let Ok(mut f) = std::fs::File::open(path) else {
        return String::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let start = len.saturating_sub(max as u64);
    if f.seek(SeekFrom::Start(start)).is_err() {
        return String::new();
    }
    let mut data = Vec::with_capacity(max.min(len as usize));
    let _ = f.take(max as u64).read_to_end(&mut data);
    String::from_utf8_lossy(&data).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotates_large_logs_and_keeps_the_tail() {
        let d = tempfile::tempdir().unwrap();
        let log = d.path().join("console.log");
        let mut w = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap();
        w.write_all(&vec![b'a'; CONSOLE_MAX as usize]).unwrap();
        rotate(&log);
        assert_eq!(
            std::fs::metadata(&log).unwrap().len(),
            CONSOLE_MAX,
            "not over the cap"
        );
        w.write_all(b"tail-marker\n").unwrap();
        rotate(&log);
        assert_eq!(std::fs::metadata(&log).unwrap().len(), 0);
        let older = std::fs::read(d.path().join("console.log.1")).unwrap();
        assert!(older.ends_with(b"tail-marker\n"));
        assert!(older.len() as u64 <= KEEP + 100);
        w.write_all(b"after\n").unwrap();
        assert_eq!(
            std::fs::read(&log).unwrap(),
            b"after\n",
            "the writer goes on at the start"
        );
    }

    /// How many times the thread looked at `log`'s size (None: not watched).
    fn looks(log: &Path) -> Option<u64> {
        let logs = watcher().unwrap().lock();
        let wd = logs.by_path.get(log)?;
        logs.by_wd.get(wd).map(|l| l.looks)
    }

    /// Waits up to `limit` for `done`.
    fn within(limit: Duration, done: impl Fn() -> bool) -> bool {
        let t = Instant::now();
        while t.elapsed() < limit {
            if done() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        done()
    }

    #[test]
    fn a_flood_between_ticks_stays_near_the_cap() {
        // 256 MiB at up to 1 GiB/s (about what a sandbox writes to its console), with one call
        // of the once-a-second tick: the log never holds more than the cap plus what arrives
        // in a few checks.
        let d = tempfile::tempdir().unwrap();
        let log = d.path().join("console.log");
        let mut w = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap();
        rotate_if_large(&log);
        let chunk = vec![b'x'; 1 << 20];
        let mut peak = 0;
        for _ in 0..256 {
            w.write_all(&chunk).unwrap();
            peak = peak.max(std::fs::metadata(&log).unwrap().len());
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(peak < 64 << 20, "the log reached {} MiB", peak >> 20);
        assert!(within(Duration::from_secs(2), || std::fs::metadata(&log)
            .unwrap()
            .len()
            <= CONSOLE_MAX));
        // Gone with its sandbox: no longer watched. (A rotation still under way may add a
        // file while the directory is removed: removed again then.)
        drop(w);
        assert!(within(Duration::from_secs(2), || std::fs::remove_dir_all(
            d.path()
        )
        .is_ok()
            || !d.path().exists()));
        assert!(within(SWEEP_EVERY * 3, || looks(&log).is_none()));
    }

    #[test]
    fn a_log_over_the_cap_when_first_named_is_rotated_at_once() {
        // A sandbox a restarted server adopted: its log grew while nothing watched it.
        let d = tempfile::tempdir().unwrap();
        let log = d.path().join("console.log");
        std::fs::write(&log, vec![b'a'; CONSOLE_MAX as usize + 1]).unwrap();
        rotate_if_large(&log);
        assert_eq!(std::fs::metadata(&log).unwrap().len(), 0);
        assert!(d.path().join("console.log.1").exists());
        // Watched from now on (the rotation's own write may already have been looked at).
        assert!(looks(&log).is_some(), "watched from now on");
    }

    #[test]
    fn logs_nobody_writes_are_not_looked_at() {
        let d = tempfile::tempdir().unwrap();
        let logs: Vec<PathBuf> = (0..20)
            .map(|i| {
                let log = d.path().join(format!("{i}.log"));
                std::fs::write(&log, b"booted\n").unwrap();
                watch(&log);
                log
            })
            .collect();
        std::thread::sleep(CHECK_EVERY * 40);
        for log in &logs {
            assert_eq!(looks(log), Some(0), "{} looked at", log.display());
        }
        // A write is looked at; the others stay unlooked.
        let mut w = std::fs::OpenOptions::new()
            .append(true)
            .open(&logs[3])
            .unwrap();
        w.write_all(b"hello\n").unwrap();
        assert!(within(Duration::from_secs(2), || looks(&logs[3])
            .is_some_and(|n| n > 0)));
        assert_eq!(looks(&logs[4]), Some(0));
        // Unwatched (the runtime paused): forgotten at once, writes unlooked.
        unwatch(&logs[3]);
        assert_eq!(looks(&logs[3]), None);
    }
}
