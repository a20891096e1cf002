//! File metadata (`files.write(..., metadata=…)`) for files whose filesystem has no user
//! xattrs: under gVisor the sandbox's root filesystem and disk (files served by the gofer)
//! answer `EOPNOTSUPP` to `setxattr("user.*")` (see docs/file-metadata.md). The agent then
//! keeps the metadata itself, keyed by the file's path and bound to its inode, in one small
//! JSON file on the sandbox's own disk (so it survives pause/resume, snapshots and forks):
//! set on write, replaced on overwrite, moved with a rename, dropped with a removal through
//! the API. A file replaced behind the agent's back (another inode at the path) has none.
//!
//! The store is loaded at start as root; reads (inside a user's filesystem identity) touch
//! only memory, and every change is saved by the caller's thread outside that identity.

use std::collections::BTreeMap;
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use serde::{Deserialize, Serialize};

/// Where the sandbox's agent keeps the store (root-only directory).
pub const DEFAULT_PATH: &str = "/var/lib/kiln-agent/file-metadata.json";

/// One file's metadata and the inode it belongs to (in the boot it was last seen in: inode
/// numbers of gofer files are only stable within one boot of the sandbox).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct Entry {
    ino: u64,
    boot: String,
    meta: BTreeMap<String, String>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct Files {
    files: BTreeMap<String, Entry>,
}

/// The store; see the module docs.
pub struct MetaStore {
    path: PathBuf,
    boot: String,
    files: Mutex<Option<Files>>,
}

/// The agent's store ([`DEFAULT_PATH`], or `KILN_AGENT_METADATA_DB`).
pub fn store() -> &'static MetaStore {
    static STORE: OnceLock<MetaStore> = OnceLock::new();
    STORE.get_or_init(|| {
        let path = std::env::var_os("KILN_AGENT_METADATA_DB")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(DEFAULT_PATH));
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map(|s| s.trim().to_string())
            .unwrap_or_default();
        MetaStore::new(path, boot)
    })
}

fn ino_of(path: &Path) -> Option<u64> {
    std::fs::symlink_metadata(path).ok().map(|m| m.ino())
}

fn key(path: &Path) -> String {
    path.to_string_lossy().into_owned()
}

/// Whether `k` is `root` or below it.
fn under(k: &str, root: &str) -> bool {
    k == root
        || (k.starts_with(root)
            && (root.ends_with('/') || k.as_bytes().get(root.len()) == Some(&b'/')))
}

impl MetaStore {
    pub fn new(path: PathBuf, boot: String) -> MetaStore {
        MetaStore {
            path,
            boot,
            files: Mutex::new(None),
        }
    }

    /// Loads the saved store (call as root, before serving). A missing file is an empty store.
    pub fn load(&self) {
        let mut g = self.files.lock().unwrap_or_else(|p| p.into_inner());
        if g.is_none() {
            *g = Some(self.read().unwrap_or_default());
        }
    }

    fn read(&self) -> Option<Files> {
        let data = std::fs::read(&self.path).ok()?;
        match serde_json::from_slice(&data) {
            Ok(f) => Some(f),
            Err(e) => {
                tracing::warn!(
                    "file metadata store {} unreadable: {e}",
                    self.path.display()
                );
                None
            }
        }
    }

    /// Runs `f` on the loaded files; saves them when `f` says it changed them.
    fn with<T>(&self, f: impl FnOnce(&mut Files) -> (T, bool)) -> T {
        let mut g = self.files.lock().unwrap_or_else(|p| p.into_inner());
        let files = g.get_or_insert_with(|| self.read().unwrap_or_default());
        let (out, changed) = f(files);
        if changed {
            if let Err(e) = self.save(files) {
                tracing::warn!("saving file metadata to {}: {e}", self.path.display());
            }
        }
        out
    }

    fn save(&self, files: &Files) -> io::Result<()> {
        if let Some(dir) = self.path.parent() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)?;
        }
        let tmp = self.path.with_extension("json.tmp");
        {
            use std::io::Write;
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&tmp)?;
            f.write_all(&serde_json::to_vec(files).map_err(io::Error::other)?)?;
        }
        std::fs::rename(&tmp, &self.path)
    }

    /// The metadata kept for `path` (empty when none, or when the file at `path` is not the
    /// one it was set on). Memory only: safe inside a user's filesystem identity.
    pub fn get(&self, path: &Path) -> BTreeMap<String, String> {
        let mut g = self.files.lock().unwrap_or_else(|p| p.into_inner());
        let Some(files) = g.as_mut() else {
            return BTreeMap::new();
        };
        let Some(e) = files.files.get_mut(&key(path)) else {
            return BTreeMap::new();
        };
        match ino_of(path) {
            Some(ino) if ino == e.ino => e.meta.clone(),
            // A new boot numbers inodes anew: the path is what is known; bind to this inode
            // (saved with the next change).
            Some(ino) if e.boot != self.boot => {
                e.ino = ino;
                e.boot = self.boot.clone();
                e.meta.clone()
            }
            _ => BTreeMap::new(),
        }
    }

    /// Replaces the metadata of `path` with `meta` (none: clears it).
    pub fn set(&self, path: &Path, meta: BTreeMap<String, String>) {
        let k = key(path);
        let ino = ino_of(path);
        self.with(|files| {
            let had = files.files.remove(&k);
            match ino {
                Some(ino) if !meta.is_empty() => {
                    let e = Entry {
                        ino,
                        boot: self.boot.clone(),
                        meta,
                    };
                    let changed = had.as_ref() != Some(&e);
                    files.files.insert(k, e);
                    ((), changed)
                }
                _ => ((), had.is_some()),
            }
        })
    }

    /// A rename of `src` to `dst` (a file or a whole directory tree): metadata moves along,
    /// and whatever `dst` replaced loses its own.
    pub fn rename(&self, src: &Path, dst: &Path) {
        let (s, d) = (key(src), key(dst));
        if s == d {
            return;
        }
        self.with(|files| {
            let before = files.files.len();
            files.files.retain(|k, _| !under(k, &d));
            let moved: Vec<String> = files
                .files
                .keys()
                .filter(|k| under(k, &s))
                .cloned()
                .collect();
            let changed = !moved.is_empty() || files.files.len() != before;
            for k in moved {
                if let Some(e) = files.files.remove(&k) {
                    files.files.insert(format!("{d}{}", &k[s.len()..]), e);
                }
            }
            ((), changed)
        })
    }

    /// A removal of `path` (a file or a whole directory tree).
    pub fn remove(&self, path: &Path) {
        let k = key(path);
        self.with(|files| {
            let before = files.files.len();
            files.files.retain(|f, _| !under(f, &k));
            ((), files.files.len() != before)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn set_get_rename_remove_and_replace() {
        let d = tempfile::tempdir().unwrap();
        let db = d.path().join("state/meta.json");
        let s = MetaStore::new(db.clone(), "boot-1".into());
        let a = d.path().join("a.txt");
        std::fs::write(&a, "a").unwrap();
        s.set(&a, meta(&[("team", "kiln")]));
        assert_eq!(s.get(&a), meta(&[("team", "kiln")]));

        // Survives a rename (with its directory too), and a reload.
        let sub = d.path().join("sub");
        std::fs::create_dir(&sub).unwrap();
        let b = sub.join("b.txt");
        std::fs::rename(&a, &b).unwrap();
        s.rename(&a, &b);
        assert!(s.get(&a).is_empty());
        let sub2 = d.path().join("sub2");
        std::fs::rename(&sub, &sub2).unwrap();
        s.rename(&sub, &sub2);
        let b2 = sub2.join("b.txt");
        let again = MetaStore::new(db.clone(), "boot-1".into());
        again.load();
        assert_eq!(again.get(&b2), meta(&[("team", "kiln")]));

        // A different file at the same path (replaced behind the agent's back) has none.
        std::fs::rename(&b2, d.path().join("old")).unwrap();
        std::fs::write(&b2, "new").unwrap();
        assert!(again.get(&b2).is_empty());
        // Set anew, then cleared by an overwrite without metadata.
        again.set(&b2, meta(&[("k", "v")]));
        again.set(&b2, BTreeMap::new());
        assert!(again.get(&b2).is_empty());
        again.set(&b2, meta(&[("k", "v")]));
        again.remove(&sub2);
        assert!(again.get(&b2).is_empty());
        assert!(!under("/a/bc", "/a/b") && under("/a/b/c", "/a/b") && under("/x", "/"));
    }

    #[test]
    fn a_new_boot_rebinds_by_path() {
        let d = tempfile::tempdir().unwrap();
        let db = d.path().join("meta.json");
        let f = d.path().join("f");
        std::fs::write(&f, "f").unwrap();
        let s = MetaStore::new(db.clone(), "boot-1".into());
        s.set(&f, meta(&[("k", "v")]));
        // Pretend the inode was numbered differently in the previous boot.
        s.with(|files| {
            files.files.get_mut(&key(&f)).unwrap().ino ^= 1;
            ((), true)
        });
        let same_boot = MetaStore::new(db.clone(), "boot-1".into());
        same_boot.load();
        assert!(same_boot.get(&f).is_empty());
        let next_boot = MetaStore::new(db, "boot-2".into());
        next_boot.load();
        assert_eq!(next_boot.get(&f), meta(&[("k", "v")]));
    }
}
