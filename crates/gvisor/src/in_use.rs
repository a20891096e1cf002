//! What the sandboxes and snapshots of a gVisor state dir stack on, so that nothing removes a
//! layer under them: the frozen layers' clean-up ([`super::GvisorDriver::gc_layers`]) and
//! `kiln template gc`, which keeps the template versions named here.
//!
//! The references are the overlay mounts of the host (running sandboxes, of any state dir:
//! their mount options name their lower layers) and the layer lists the state dir's paused
//! sandboxes (`sandboxes/*/paused.json`) and snapshots (`snapshots/*/snapshot.json`) keep.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// Layers a capture needs while nothing on disk names them: the frozen layer it is making
/// (referenced once it is mounted and the snapshot's record is written) and the layers its
/// sandbox stacks on (unmounted while its layer freezes). The clean-up leaves them alone;
/// each is counted, as two captures may hold one layer at once.
#[derive(Default, Clone)]
pub struct Making(Arc<Mutex<HashMap<PathBuf, usize>>>);

/// Holds one layer in [`Making`] until dropped.
pub struct MakingGuard {
    set: Making,
    layer: PathBuf,
}

impl Making {
    /// Marks `layer` as being made until the guard is dropped.
    pub fn hold(&self, layer: PathBuf) -> MakingGuard {
        *self.lock().entry(layer.clone()).or_insert(0) += 1;
        MakingGuard {
            set: self.clone(),
            layer,
        }
    }

    /// The layers being made, locked: a clean-up holds this while it reads the references
    /// and removes layers, so that no capture finishes (or starts) in between.
    pub fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<PathBuf, usize>> {
        // A panic while holding this lock leaves a plain set behind: still usable.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for MakingGuard {
    fn drop(&mut self) {
        let mut held = self.set.lock();
        if let Some(n) = held.get_mut(&self.layer) {
            *n -= 1;
            if *n == 0 {
                held.remove(&self.layer);
            }
        }
    }
}

/// Every reference as one text: a layer (or template) directory is in use when this text
/// contains its path. A frozen layer with a disk of its own is a mount itself, which does not
/// count as a reference (it is not an overlay).
pub fn references(gvisor_dir: &Path) -> String {
    let mut used: String = std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter(|l| {
            l.split(" - ")
                .nth(1)
                .is_some_and(|t| t.starts_with("overlay "))
        })
        .map(|l| format!("{l}\n"))
        .collect();
    for sub in ["snapshots", "sandboxes"] {
        for e in std::fs::read_dir(gvisor_dir.join(sub))
            .into_iter()
            .flatten()
            .flatten()
        {
            for f in ["snapshot.json", "paused.json"] {
                used.push_str(&std::fs::read_to_string(e.path().join(f)).unwrap_or_default());
            }
        }
    }
    used
}

/// Whether `dir` is named in [`references`]' text.
pub fn is_referenced(references: &str, dir: &Path) -> bool {
    references.contains(dir.to_string_lossy().as_ref())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paused_sandboxes_and_snapshots_reference_their_layers() {
        let state = tempfile::tempdir().unwrap();
        let g = state.path();
        for (sub, id, file, body) in [
            (
                "sandboxes",
                "s1",
                "paused.json",
                r#"{"memory":true,"lower":["/tpl/base/k1"]}"#,
            ),
            (
                "snapshots",
                "p1",
                "snapshot.json",
                r#"{"lowers":["/st/layers/p1","/tpl/py/k2"]}"#,
            ),
            // A running sandbox's directory has no record: its mount is the reference.
            (
                "sandboxes",
                "s2",
                "config.json",
                r#"{"lower":["/tpl/x/k9"]}"#,
            ),
        ] {
            std::fs::create_dir_all(g.join(sub).join(id)).unwrap();
            std::fs::write(g.join(sub).join(id).join(file), body).unwrap();
        }
        let refs = references(g);
        for used in ["/tpl/base/k1", "/tpl/py/k2", "/st/layers/p1"] {
            assert!(is_referenced(&refs, Path::new(used)), "{used}: {refs}");
        }
        assert!(!is_referenced(&refs, Path::new("/tpl/x/k9")), "{refs}");
        assert!(!is_referenced(&refs, Path::new("/tpl/base/k0")), "{refs}");
    }

    #[test]
    fn a_layer_is_being_made_while_its_guard_lives() {
        let making = Making::default();
        let layer = PathBuf::from("/st/layers/p1");
        let guard = making.hold(layer.clone());
        let other = making.hold(PathBuf::from("/st/layers/p2"));
        // Two captures holding one layer: it stays held until both let go.
        let again = making.hold(layer.clone());
        assert!(making.lock().contains_key(&layer));
        drop(guard);
        assert!(making.lock().contains_key(&layer));
        drop(again);
        assert!(!making.lock().contains_key(&layer));
        assert!(making.lock().contains_key(Path::new("/st/layers/p2")));
        drop(other);
        assert!(!making.lock().contains_key(Path::new("/st/layers/p2")));
    }
}
