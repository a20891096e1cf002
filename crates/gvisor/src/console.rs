//! The sandbox's console log (runsc's and the agent's stdout/stderr, opened `O_APPEND` by
//! runsc's parent): capped by rotation, so a sandbox that floods its console uses at most
//! about [`CONSOLE_MAX`] (plus what it writes between two checks) of host disk.

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

/// Size at which `console.log` is rotated.
pub const CONSOLE_MAX: u64 = 4 << 20;
/// How much of the rotated log is kept in `console.log.1`.
const KEEP: u64 = 1 << 20;

/// When `log` is larger than [`CONSOLE_MAX`]: its last [`KEEP`] bytes go to `<log>.1`
/// (replacing it) and `log` is truncated in place. The writer's descriptor is `O_APPEND`, so it
/// carries on at the new end.
pub fn rotate_if_large(log: &Path) {
    let Ok(mut f) = std::fs::OpenOptions::new().read(true).write(true).open(log) else {
        return;
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    if len <= CONSOLE_MAX {
        return;
    }
    let mut keep = Vec::with_capacity(KEEP as usize);
    if f.seek(SeekFrom::Start(len - KEEP)).is_ok() {
        let _ = (&mut f).take(KEEP).read_to_end(&mut keep);
    }
    let older = log.with_extension("log.1");
    let tmp = log.with_extension("log.1.tmp");
    let written = std::fs::File::create(&tmp).and_then(|mut o| {
        o.write_all(b"[kiln: console log rotated; older output dropped]\n")?;
        o.write_all(&keep)
    });
    if written.is_ok() {
        let _ = std::fs::rename(&tmp, &older);
    }
    let _ = f.set_len(0);
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
        rotate_if_large(&log);
        assert_eq!(
            std::fs::metadata(&log).unwrap().len(),
            CONSOLE_MAX,
            "not over the cap"
        );
        w.write_all(b"tail-marker\n").unwrap();
        rotate_if_large(&log);
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
}
