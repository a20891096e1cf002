//! The template cache: content-addressed, with atomic insertion.
//!
//! ```text
//! <cache>/templates/
//!   <name>/<key>/{rootfs/, rootfs.ext4, template.json}   a built template (never modified)
//!   <name>/current -> <key>                               the template `lookup(name)` returns
//!   .base/<recipe-hash>/rootfs/                           mmdebstrap + steps, before the agent
//!   .tmp/                                                 builds in progress (same filesystem)
//!   logs/<name>-<key>.log                                 full build logs
//! ```
//! Everything is built under `.tmp/` and moved into place with `rename(2)`, so a partial build
//! never becomes visible, and `current` is switched by renaming a new symlink over the old one.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::{io_err, Error, Result};

/// A built template, as `template.json` records it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Template {
    pub name: String,
    /// Content hash of recipe + agent binary + builder version.
    pub key: String,
    pub recipe_hash: String,
    /// The base stage (`.base/<hash>`: the unpacked image or the mmdebstrap root with the
    /// recipe's steps) this version was built on, which a rebuild (a new agent, new sizes or
    /// commands) reuses; None in versions built before it was recorded (then `recipe_hash`).
    #[serde(default)]
    pub base_stage: Option<String>,
    pub agent_sha256: String,
    /// Directory holding this template.
    #[serde(skip)]
    pub dir: PathBuf,
    /// Root filesystem directory (read-only; used by the gVisor driver).
    #[serde(skip)]
    pub rootfs: PathBuf,
    /// ext4 image of the same root filesystem (used by the microVM driver).
    #[serde(skip)]
    pub ext4: PathBuf,
    /// Default user for processes (E2B: `user`).
    pub user: String,
    /// Default working directory (E2B: `/home/user`).
    pub workdir: String,
    pub env: BTreeMap<String, String>,
    pub start_cmd: Option<String>,
    /// Exits 0 once the start command is ready (E2B's `readyCmd`).
    #[serde(default)]
    pub ready_cmd: Option<String>,
    /// Memory of the template's sandboxes in MiB (None: the server's default).
    #[serde(default)]
    pub memory_mb: Option<u32>,
    /// Writable disk of the template's sandboxes in MiB (None: the server's default).
    #[serde(default)]
    pub disk_mb: Option<u32>,
    pub built_at_unix: u64,
    /// Bytes used by the root filesystem.
    pub size_bytes: u64,
    pub build_secs: f64,
}

impl Template {
    fn attach(mut self, dir: PathBuf) -> Self {
        self.rootfs = dir.join("rootfs");
        self.ext4 = dir.join("rootfs.ext4");
        self.dir = dir;
        self
    }
}

/// The template cache under one root directory.
#[derive(Debug, Clone)]
pub struct Store {
    root: PathBuf,
}

pub(crate) const META: &str = "template.json";

impl Store {
    /// The store under kiln's cache directory (see `kiln_host::paths`).
    pub fn open_default() -> Result<Store> {
        Store::open(kiln_host::paths::templates_dir())
    }

    /// The store under `root` (created when missing).
    pub fn open(root: impl Into<PathBuf>) -> Result<Store> {
        let root = root.into();
        for d in [root.join(".tmp"), root.join(".base"), root.join("logs")] {
            std::fs::create_dir_all(&d).map_err(io_err(format!(
                "creating template cache dir {}",
                d.display()
            )))?;
        }
        Ok(Store { root })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub(crate) fn tmp_dir(&self) -> PathBuf {
        self.root.join(".tmp")
    }

    pub(crate) fn base_dir(&self, recipe_hash: &str) -> PathBuf {
        self.root.join(".base").join(recipe_hash)
    }

    pub(crate) fn log_path(&self, name: &str, key: &str) -> PathBuf {
        self.root
            .join("logs")
            .join(format!("{name}-{}.log", &key[..key.len().min(16)]))
    }

    pub(crate) fn template_dir(&self, name: &str, key: &str) -> PathBuf {
        self.root.join(name).join(key)
    }

    /// The template built for exactly this name and key, if present.
    pub fn get(&self, name: &str, key: &str) -> Result<Option<Template>> {
        let dir = self.template_dir(name, key);
        if !dir.join(META).is_file() {
            return Ok(None);
        }
        read_meta(&dir).map(Some)
    }

    /// The current template named `name`.
    pub fn lookup(&self, name: &str) -> Result<Template> {
        let link = self.root.join(name).join("current");
        let key = match std::fs::read_link(&link) {
            Ok(k) => k,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(Error::NotBuilt(name.to_string()))
            }
            Err(e) => return Err(io_err(format!("reading {}", link.display()))(e)),
        };
        read_meta(&self.root.join(name).join(key))
    }

    /// The current version of every built template, sorted by name.
    pub fn list(&self) -> Result<Vec<Template>> {
        let mut out = Vec::new();
        let entries = std::fs::read_dir(&self.root)
            .map_err(io_err(format!("listing {}", self.root.display())))?;
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if name.starts_with('.') || name == "logs" || !e.path().is_dir() {
                continue;
            }
            match self.lookup(&name) {
                Ok(t) => out.push(t),
                Err(Error::NotBuilt(_)) => {}
                Err(e) => return Err(e),
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Moves a finished build directory (under `.tmp/`) into place and makes it current.
    /// The rename is atomic: readers see either no template or a complete one.
    pub(crate) fn publish(&self, staged: &Path, meta: &Template) -> Result<Template> {
        let json = serde_json::to_vec_pretty(meta).expect("template metadata serializes");
        std::fs::write(staged.join(META), json)
            .map_err(io_err(format!("writing {}", staged.join(META).display())))?;
        let parent = self.root.join(&meta.name);
        std::fs::create_dir_all(&parent)
            .map_err(io_err(format!("creating {}", parent.display())))?;
        let dest = parent.join(&meta.key);
        if dest.exists() {
            // Same content was built concurrently: keep the existing one.
            remove_tree(staged);
        } else {
            std::fs::rename(staged, &dest).map_err(io_err(format!(
                "moving {} to {}",
                staged.display(),
                dest.display()
            )))?;
        }
        self.set_current(&meta.name, &meta.key)?;
        read_meta(&dest)
    }

    /// Removes old versions: for each name keeps the current one, the `keep` newest others
    /// and every version `in_use` says sandboxes or snapshots stack on; then removes base
    /// stages no kept template uses. Returns the directories removed.
    pub fn gc(&self, keep: usize, in_use: impl Fn(&Path) -> bool) -> Result<Vec<PathBuf>> {
        let mut removed = Vec::new();
        let mut live_bases = std::collections::HashSet::new();
        let names = std::fs::read_dir(&self.root)
            .map_err(io_err(format!("listing {}", self.root.display())))?;
        for n in names.flatten() {
            let name = n.file_name().to_string_lossy().to_string();
            if name.starts_with('.') || name == "logs" || !n.path().is_dir() {
                continue;
            }
            let current = self.lookup(&name).ok().map(|t| t.key);
            let mut versions: Vec<Template> = std::fs::read_dir(n.path())
                .map_err(io_err(format!("listing {}", n.path().display())))?
                .flatten()
                .filter(|e| e.path().join(META).is_file())
                .filter_map(|e| read_meta(&e.path()).ok())
                .collect();
            versions.sort_by_key(|v| std::cmp::Reverse(v.built_at_unix));
            let mut kept_others = 0;
            for v in versions {
                let is_current = current.as_deref() == Some(v.key.as_str());
                let kept = is_current || in_use(&v.dir) || {
                    kept_others += 1;
                    kept_others <= keep
                };
                if kept {
                    live_bases.insert(v.base_stage.clone().unwrap_or(v.recipe_hash.clone()));
                    continue;
                }
                remove_tree(&v.dir);
                removed.push(v.dir);
            }
        }
        let bases = self.root.join(".base");
        for b in std::fs::read_dir(&bases)
            .map_err(io_err(format!("listing {}", bases.display())))?
            .flatten()
        {
            if !live_bases.contains(&b.file_name().to_string_lossy().to_string()) {
                remove_tree(&b.path());
                removed.push(b.path());
            }
        }
        Ok(removed)
    }

    pub(crate) fn set_current(&self, name: &str, key: &str) -> Result<()> {
        let parent = self.root.join(name);
        let tmp = parent.join(format!(".current-{}", std::process::id()));
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(key, &tmp)
            .map_err(io_err(format!("creating {}", tmp.display())))?;
        std::fs::rename(&tmp, parent.join("current"))
            .map_err(io_err(format!("switching {}/current", parent.display())))
    }
}

pub(crate) fn read_meta(dir: &Path) -> Result<Template> {
    let path = dir.join(META);
    let bytes = std::fs::read(&path).map_err(io_err(format!("reading {}", path.display())))?;
    let t: Template = serde_json::from_slice(&bytes).map_err(|e| Error::Io {
        what: format!("parsing {}", path.display()),
        source: std::io::Error::new(std::io::ErrorKind::InvalidData, e),
    })?;
    Ok(t.attach(dir.to_path_buf()))
}

/// Removes a directory tree, ignoring errors (used for leftovers of failed builds).
pub(crate) fn remove_tree(p: &Path) {
    if let Err(e) = std::fs::remove_dir_all(p) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!("could not remove {}: {e}", p.display());
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn meta(name: &str, key: &str) -> Template {
        Template {
            name: name.into(),
            key: key.into(),
            recipe_hash: "r".into(),
            base_stage: None,
            agent_sha256: "a".into(),
            dir: PathBuf::new(),
            rootfs: PathBuf::new(),
            ext4: PathBuf::new(),
            user: "user".into(),
            workdir: "/home/user".into(),
            env: BTreeMap::new(),
            start_cmd: None,
            ready_cmd: None,
            memory_mb: None,
            disk_mb: None,
            built_at_unix: 1,
            size_bytes: 2,
            build_secs: 0.5,
        }
    }

    fn staged(store: &Store, marker: &str) -> PathBuf {
        let d = tempfile::Builder::new()
            .prefix("build-")
            .tempdir_in(store.tmp_dir())
            .unwrap()
            .keep();
        std::fs::create_dir(d.join("rootfs")).unwrap();
        std::fs::write(d.join("rootfs/marker"), marker).unwrap();
        d
    }

    #[test]
    fn lookup_of_unbuilt_template_says_how_to_build() {
        let t = tempfile::tempdir().unwrap();
        let s = Store::open(t.path()).unwrap();
        let e = s.lookup("base").unwrap_err().to_string();
        assert!(e.contains("kiln template build base"), "{e}");
        assert!(s.list().unwrap().is_empty());
    }

    #[test]
    fn publish_is_atomic_and_switches_current() {
        let t = tempfile::tempdir().unwrap();
        let s = Store::open(t.path()).unwrap();
        let a = staged(&s, "one");
        // While staged, the template is invisible.
        assert!(matches!(s.lookup("x"), Err(Error::NotBuilt(_))));
        let got = s.publish(&a, &meta("x", "k1")).unwrap();
        assert!(!a.exists(), "staging dir must be moved, not copied");
        assert_eq!(got.rootfs, t.path().join("x/k1/rootfs"));
        assert_eq!(
            std::fs::read_to_string(got.rootfs.join("marker")).unwrap(),
            "one"
        );
        assert_eq!(s.lookup("x").unwrap().key, "k1");

        let b = staged(&s, "two");
        s.publish(&b, &meta("x", "k2")).unwrap();
        let cur = s.lookup("x").unwrap();
        assert_eq!(cur.key, "k2");
        assert_eq!(
            std::fs::read_to_string(cur.rootfs.join("marker")).unwrap(),
            "two"
        );
        // The older build stays readable for sandboxes still using it.
        assert_eq!(s.get("x", "k1").unwrap().unwrap().key, "k1");
        assert_eq!(s.list().unwrap().len(), 1);
    }

    #[test]
    fn publishing_same_key_twice_keeps_first_and_drops_second() {
        let t = tempfile::tempdir().unwrap();
        let s = Store::open(t.path()).unwrap();
        s.publish(&staged(&s, "first"), &meta("x", "k")).unwrap();
        let second = staged(&s, "second");
        let got = s.publish(&second, &meta("x", "k")).unwrap();
        assert!(!second.exists());
        assert_eq!(
            std::fs::read_to_string(got.rootfs.join("marker")).unwrap(),
            "first"
        );
    }

    #[test]
    fn gc_keeps_current_newest_and_in_use_versions_and_their_bases() {
        let t = tempfile::tempdir().unwrap();
        let s = Store::open(t.path()).unwrap();
        for (i, key) in ["k1", "k2", "k3", "k4"].iter().enumerate() {
            let mut m = meta("x", key);
            m.built_at_unix = i as u64;
            m.recipe_hash = format!("r{i}");
            std::fs::create_dir_all(s.base_dir(&m.recipe_hash).join("rootfs")).unwrap();
            s.publish(&staged(&s, key), &m).unwrap();
        }
        // Make an old one current again: it must survive even though it is old.
        s.set_current("x", "k1").unwrap();
        // k2 is what a paused sandbox stacks on: kept, without counting as one of `keep`.
        let in_use = |d: &Path| d.ends_with("x/k2");
        let removed = s.gc(1, in_use).unwrap();
        assert!(s.get("x", "k1").unwrap().is_some(), "current removed");
        assert!(s.get("x", "k4").unwrap().is_some(), "newest removed");
        assert!(
            s.get("x", "k2").unwrap().is_some(),
            "a version in use removed"
        );
        assert!(s.get("x", "k3").unwrap().is_none());
        for kept in ["r0", "r1", "r3"] {
            assert!(s.base_dir(kept).exists(), "{kept} removed");
        }
        assert!(!s.base_dir("r2").exists());
        assert_eq!(removed.len(), 2, "{removed:?}");
        // Once nothing uses it, it goes.
        assert_eq!(s.gc(1, |_| false).unwrap().len(), 2);
        assert!(s.get("x", "k2").unwrap().is_none());
        assert_eq!(s.lookup("x").unwrap().key, "k1");
        // A version records the stage it was built on when that differs from its recipe's
        // hash (a recipe with sizes or commands): that stage is the one kept.
        let mut m = meta("y", "y1");
        m.recipe_hash = "full-recipe".into();
        m.base_stage = Some("stage-only".into());
        std::fs::create_dir_all(s.base_dir("stage-only").join("rootfs")).unwrap();
        s.publish(&staged(&s, "y1"), &m).unwrap();
        s.gc(0, |_| false).unwrap();
        assert!(
            s.base_dir("stage-only").exists(),
            "the stage a current version uses"
        );
    }

    #[test]
    fn corrupt_metadata_is_a_clear_error() {
        let t = tempfile::tempdir().unwrap();
        let s = Store::open(t.path()).unwrap();
        s.publish(&staged(&s, "m"), &meta("x", "k")).unwrap();
        std::fs::write(t.path().join("x/k").join(META), b"{not json").unwrap();
        let e = s.lookup("x").unwrap_err().to_string();
        assert!(e.contains("parsing") && e.contains("template.json"), "{e}");
    }
}
