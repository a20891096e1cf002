//! The sandbox's console log (runsc's and the agent's stdout/stderr, opened `O_APPEND` by
//! runsc's parent): capped by rotation, so a sandbox that floods its console uses at most
//! about [`CONSOLE_MAX`] plus what it writes in one [`CHECK_EVERY`] of host disk.
//!
//! The watcher's once-a-second tick names each running sandbox's log ([`rotate_if_large`]);
//! from then on a thread of this module checks every watched log each [`CHECK_EVERY`], until
//! the log is gone with its sandbox, and finds the logs of sandboxes started beside them. Once a second alone let a flood grow the log by what
//! the sandbox writes in a second (more than a GiB: gVisor writes a console at disk speed).

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

/// Size at which `console.log` is rotated.
pub const CONSOLE_MAX: u64 = 4 << 20;
/// How much of the rotated log is kept in `console.log.1`.
const KEEP: u64 = 1 << 20;
/// How often watched logs are checked.
pub const CHECK_EVERY: Duration = Duration::from_millis(10);

/// The logs the checking thread watches, each with the descriptor it keeps open on it (a
/// close after a truncation would make ext4 allocate and flush what the writer added).
fn watched() -> &'static Mutex<HashMap<PathBuf, Option<File>>> {
    static WATCHED: OnceLock<Mutex<HashMap<PathBuf, Option<File>>>> = OnceLock::new();
    WATCHED.get_or_init(|| {
        if let Err(e) = std::thread::Builder::new()
            .name("kiln-console".into())
            .spawn(check_loop)
        {
            tracing::warn!(error = %e, "cannot start the console log thread; logs rotate once a second");
        }
        Mutex::new(HashMap::new())
    })
}

fn check_loop() {
    // A flooding sandbox keeps the host's CPUs busy; this thread needs little CPU but must
    // get it on time: real-time round-robin at the lowest priority (it sleeps between checks
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
    for round in 0u64.. {
        std::thread::sleep(CHECK_EVERY);
        let mut logs = watched().lock().unwrap_or_else(|p| p.into_inner());
        if round % 10 == 0 {
            discover(&mut logs);
        }
        logs.retain(|log, f| {
            // Gone with its sandbox: forget it (and close it).
            if std::fs::symlink_metadata(log).is_err() {
                return false;
            }
            if f.is_none() {
                *f = open(log);
            }
            if let Some(f) = f {
                if f.metadata().is_ok_and(|m| m.len() > CONSOLE_MAX) {
                    rotate_open(log, f);
                }
            }
            true
        });
    }
}

/// Adds the logs of sandboxes started since the last look: every `<id>/console.log` beside
/// the sandbox directories already watched (a flood from a sandbox's first second would
/// otherwise wait for the tick to name its log).
fn discover(logs: &mut HashMap<PathBuf, Option<File>>) {
    let dirs: HashSet<PathBuf> = logs
        .keys()
        .filter_map(|l| l.parent()?.parent().map(Path::to_path_buf))
        .collect();
    for dir in dirs {
        let Ok(rd) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in rd.flatten() {
            let log = e.path().join("console.log");
            if !logs.contains_key(&log) && log.exists() {
                logs.insert(log, None);
            }
        }
    }
}

fn open(log: &Path) -> Option<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(log)
        .ok()
}

/// Rotates `log` now when it is larger than [`CONSOLE_MAX`], and has it checked every
/// [`CHECK_EVERY`] from now on while it exists.
pub fn rotate_if_large(log: &Path) {
    rotate(log);
    if log.exists() {
        watched()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(log.to_path_buf())
            .or_insert(None);
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
        std::thread::sleep(CHECK_EVERY * 20);
        assert!(std::fs::metadata(&log).unwrap().len() <= CONSOLE_MAX);
        // Gone with its sandbox: no longer watched.
        drop(w);
        std::fs::remove_dir_all(d.path()).unwrap();
        std::thread::sleep(CHECK_EVERY * 20);
        assert!(!watched().lock().unwrap().contains_key(&log));
    }
}
