//! What interrupted benches left under the bench work root (`<state>/bench` by default): a
//! bench killed mid-run leaves its sandboxes' runtime processes, overlay and disk mounts and
//! files. Before a bench starts, and only when no other `kiln bench` runs, they go.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// The argument vectors of the host's other processes, with their pids.
fn other_processes() -> Vec<(i32, Vec<String>)> {
    let me = std::process::id() as i32;
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| *pid != me)
        .filter_map(|pid| {
            let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let args = raw
                .split(|b| *b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            Some((pid, args))
        })
        .collect()
}

/// Whether `args` is a `kiln bench …` process.
fn is_bench(args: &[String]) -> bool {
    args.first().is_some_and(|a0| a0.ends_with("kiln")) && args.iter().any(|a| a == "bench")
}

/// Mount points at or under `root`, deepest first.
fn mounts_under(root: &Path) -> Vec<PathBuf> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut v: Vec<PathBuf> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|m| PathBuf::from(m.replace("\\040", " ")))
        .filter(|m| m.starts_with(root))
        .collect();
    v.sort_by_key(|m| std::cmp::Reverse(m.components().count()));
    v
}

fn unmount_lazily(target: &Path) {
    let Ok(c) = CString::new(target.as_os_str().as_bytes()) else {
        return;
    };
    // SAFETY: c is a valid NUL-terminated path that outlives the call.
    unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
}

/// Removes the leftovers of interrupted benches under `work_root`: kills the processes that
/// name a path under it (orphaned sandbox processes of the runtime), unmounts what is mounted under
/// it and removes its entries. Does nothing while another `kiln bench` runs. Returns how many
/// entries it removed.
pub fn sweep(work_root: &Path) -> usize {
    let procs = other_processes();
    if procs.iter().any(|(_, args)| is_bench(args)) {
        return 0;
    }
    remove_leftovers(work_root, &procs)
}

/// Removes what a bench left under its own work directory `dir` (its processes, mounts and
/// files), whether or not other benches run.
pub fn clear(dir: &Path) -> usize {
    remove_leftovers(dir, &other_processes())
}

/// [`sweep`] once no other bench runs, given the host's other processes.
fn remove_leftovers(work_root: &Path, procs: &[(i32, Vec<String>)]) -> usize {
    let Ok(rd) = std::fs::read_dir(work_root) else {
        return 0;
    };
    let entries: Vec<PathBuf> = rd.flatten().map(|e| e.path()).collect();
    if entries.is_empty() {
        return 0;
    }
    let prefix = format!("{}/", work_root.display());
    for (pid, args) in procs {
        if args.iter().any(|a| a.contains(&prefix)) {
            // SAFETY: kill takes no pointers; a pid that is gone by now is an ESRCH.
            unsafe { libc::kill(*pid, libc::SIGKILL) };
        }
    }
    for m in mounts_under(work_root) {
        unmount_lazily(&m);
    }
    let mut removed = 0;
    for e in entries {
        let gone = if e.is_dir() {
            std::fs::remove_dir_all(&e)
        } else {
            std::fs::remove_file(&e)
        };
        match gone {
            Ok(()) => removed += 1,
            Err(err) => eprintln!("could not remove {}: {err}", e.display()),
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bench_process_is_recognised_by_its_arguments() {
        let a = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(is_bench(&a(&["/usr/bin/kiln", "bench", "audit"])));
        assert!(is_bench(&a(&["target/release/kiln", "bench", "lifecycle"])));
        assert!(!is_bench(&a(&["/usr/bin/kiln", "serve"])));
        assert!(!is_bench(&a(&["cargo", "bench"])));
    }

    #[test]
    fn leftover_files_and_mounts_go() {
        let root = tempfile::tempdir().unwrap();
        let left = root.path().join("lifeAbCd/driver/sandboxes/x/rootfs");
        std::fs::create_dir_all(&left).unwrap();
        std::fs::write(root.path().join("lifeAbCd/kiln.db"), b"x").unwrap();
        let (src, dst) = (
            CString::new("tmpfs").unwrap(),
            CString::new(left.as_os_str().as_bytes()).unwrap(),
        );
        // SAFETY: valid NUL-terminated strings that outlive the call.
        let rc = unsafe {
            libc::mount(
                src.as_ptr(),
                dst.as_ptr(),
                src.as_ptr(),
                0,
                std::ptr::null(),
            )
        };
        assert_eq!(
            rc,
            0,
            "mounting a tmpfs (the tests run as root): {}",
            std::io::Error::last_os_error()
        );
        assert_eq!(mounts_under(root.path()), vec![left.clone()]);
        assert_eq!(remove_leftovers(root.path(), &[]), 1);
        assert!(mounts_under(root.path()).is_empty());
        assert_eq!(std::fs::read_dir(root.path()).unwrap().count(), 0);
    }
}
