//! A container's host cgroups (`kiln/<container id>` in every hierarchy) removed once the
//! container is gone. `runsc delete` removes them with the container's state; a container
//! whose `runsc run` was cut short after it made its cgroups but before runsc recorded its
//! state (a warm pool's boot when the server stops) leaves them behind with nobody to delete
//! them, so every delete also removes what is left. Only empty cgroups go (`rmdir` of a
//! cgroup that still has processes fails), and only this container's.

use std::path::{Path, PathBuf};

const ROOT: &str = "/sys/fs/cgroup";

/// The directories container `cid`'s cgroups would have under `root` (each v1 hierarchy's
/// `kiln/<cid>`, and v2's).
fn dirs(root: &Path, cid: &str) -> Vec<PathBuf> {
    let mut out = vec![root.join("kiln").join(cid)];
    if let Ok(entries) = std::fs::read_dir(root) {
        for e in entries.flatten() {
            let d = e.path().join("kiln").join(cid);
            if !out.contains(&d) {
                out.push(d);
            }
        }
    }
    out
}

/// Removes container `cid`'s empty cgroups under `root`; how many went.
fn remove_under(root: &Path, cid: &str) -> usize {
    if cid.is_empty() || cid.contains('/') || cid.starts_with('.') {
        return 0;
    }
    let mut removed = 0;
    for d in dirs(root, cid) {
        match std::fs::remove_dir(&d) {
            Ok(()) => removed += 1,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::debug!(dir = %d.display(), error = %e, "a container's cgroup is left")
            }
        }
    }
    removed
}

/// Removes what is left of container `cid`'s host cgroups (its container is gone).
pub fn remove(cid: &str) {
    let n = remove_under(Path::new(ROOT), cid);
    if n > 0 {
        tracing::debug!(container = %cid, cgroups = n, "removed a container's leftover cgroups");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_containers_own_directories_go() {
        let root = tempfile::tempdir().unwrap();
        for h in ["cpu", "memory", "pids"] {
            std::fs::create_dir_all(root.path().join(h).join("kiln").join("c1")).unwrap();
            std::fs::create_dir_all(root.path().join(h).join("kiln").join("c2")).unwrap();
        }
        std::fs::create_dir_all(root.path().join("kiln").join("c1")).unwrap();
        // A cgroup that is not empty stays (here: a child directory; a cgroup's: processes).
        std::fs::create_dir_all(root.path().join("pids/kiln/c1/child")).unwrap();
        assert_eq!(remove_under(root.path(), "c1"), 3);
        for h in ["cpu", "memory"] {
            assert!(!root.path().join(h).join("kiln/c1").exists());
            assert!(
                root.path().join(h).join("kiln/c2").exists(),
                "another container's"
            );
        }
        assert!(root.path().join("pids/kiln/c1").exists());
        assert!(root.path().join("cpu/kiln").exists(), "the parent stays");
        for bad in ["", "../cpu", ".."] {
            assert_eq!(remove_under(root.path(), bad), 0);
        }
        assert!(root.path().join("cpu/kiln/c2").exists());
    }

    #[test]
    fn a_real_empty_cgroup_is_removed() {
        let v1 = Path::new(ROOT).join("pids");
        let base = if v1.is_dir() { v1 } else { PathBuf::from(ROOT) };
        let cid = format!("kiln-test-{}", std::process::id());
        let dir = base.join("kiln").join(&cid);
        if std::fs::create_dir_all(&dir).is_err() {
            // Not root, or no writable cgroup file system: the directory test above stands.
            kiln_testkit::needs()
                .that(false, "a writable cgroup file system (root)")
                .ok_as("a_real_empty_cgroup_is_removed");
            return;
        }
        remove(&cid);
        assert!(!dir.exists(), "{} is left", dir.display());
    }
}
