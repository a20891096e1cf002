//! A template version built elsewhere (another host's copy: its `template.json` and its
//! `rootfs/`) taken into the store: unpacked into a staging directory of the store's own, then
//! published as a local build is, atomically.

use std::path::{Path, PathBuf};

use crate::store::{read_meta, remove_tree, Store, Template};
use crate::{Error, Result};

impl Store {
    /// A new, empty directory in the store's scratch space to unpack a copy of template
    /// `name` into before [`Store::adopt`]; on the store's file system, so adopting it is a
    /// rename.
    pub fn staging_dir(&self, name: &str) -> Result<PathBuf> {
        let dir = tempfile::Builder::new()
            .prefix(&format!("adopt-{name}-"))
            .tempdir_in(self.tmp_dir())
            .map_err(|e| Error::Io {
                what: format!("making a staging directory for template {name:?}"),
                source: e,
            })?;
        Ok(dir.keep())
    }

    /// Publishes the copy in `staged` (from [`Store::staging_dir`]) as version `key` of
    /// template `name`, current from now on. The copy must say it is that version and hold
    /// its root filesystem; otherwise it is removed and nothing changes.
    pub fn adopt(&self, staged: &Path, name: &str, key: &str) -> Result<Template> {
        let checked = read_meta(staged).and_then(|meta| {
            let bad = |what: String| Error::Io {
                what: format!("adopting a copy of template {name:?}"),
                source: std::io::Error::new(std::io::ErrorKind::InvalidData, what),
            };
            if meta.name != name || meta.key != key {
                return Err(bad(format!(
                    "the copy is {:?} version {}, not version {key}",
                    meta.name, meta.key
                )));
            }
            if !staged.join("rootfs").is_dir() {
                return Err(bad("the copy has no root filesystem".into()));
            }
            Ok(meta)
        });
        match checked {
            Ok(meta) => self.publish(staged, &meta),
            Err(e) => {
                remove_tree(staged);
                Err(e)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::store::tests::meta;
    use crate::store::Store;

    fn copy_of(s: &Store, name: &str, key: &str, marker: &str) -> std::path::PathBuf {
        let d = s.staging_dir(name).unwrap();
        std::fs::create_dir(d.join("rootfs")).unwrap();
        std::fs::write(d.join("rootfs/marker"), marker).unwrap();
        let json = serde_json::to_vec(&meta(name, key)).unwrap();
        std::fs::write(d.join("template.json"), json).unwrap();
        d
    }

    #[test]
    fn a_copy_becomes_the_current_version() {
        let t = tempfile::tempdir().unwrap();
        let s = Store::open(t.path()).unwrap();
        let d = copy_of(&s, "x", "k1", "from elsewhere");
        let got = s.adopt(&d, "x", "k1").unwrap();
        assert!(!d.exists(), "the staged copy is moved into place");
        assert_eq!(s.lookup("x").unwrap().key, "k1");
        assert_eq!(
            std::fs::read_to_string(got.rootfs.join("marker")).unwrap(),
            "from elsewhere"
        );
    }

    #[test]
    fn a_copy_of_another_version_or_without_rootfs_is_refused_and_removed() {
        let t = tempfile::tempdir().unwrap();
        let s = Store::open(t.path()).unwrap();
        let d = copy_of(&s, "x", "k1", "m");
        let e = s.adopt(&d, "x", "k2").unwrap_err().to_string();
        assert!(e.contains("not version k2"), "{e}");
        assert!(!d.exists());
        let d = copy_of(&s, "x", "k1", "m");
        let e = s.adopt(&d, "y", "k1").unwrap_err().to_string();
        assert!(e.contains("\"x\" version k1"), "{e}");
        let d = copy_of(&s, "x", "k1", "m");
        std::fs::remove_dir_all(d.join("rootfs")).unwrap();
        let e = s.adopt(&d, "x", "k1").unwrap_err().to_string();
        assert!(e.contains("no root filesystem"), "{e}");
        assert!(s.list().unwrap().is_empty(), "nothing was published");
    }
}
