//! Hot reload: a rules file checked for changes (modification time and size); a changed file
//! that loads replaces the set, one that does not is reported and the working set stays.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use crate::ruleset::{LoadErrors, RuleSet};

/// What a check found.
#[derive(Debug)]
pub enum Reload {
    Unchanged,
    /// The file changed and loads: the new set.
    Loaded(Arc<RuleSet>),
    /// The file changed and does not load; the current set stays.
    Refused(LoadErrors),
}

/// A rules file and the set last loaded from it.
#[derive(Debug)]
pub struct Watched {
    path: PathBuf,
    stamp: Option<(SystemTime, u64)>,
    current: Arc<RuleSet>,
}

fn stamp(path: &Path) -> Option<(SystemTime, u64)> {
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, m.len()))
}

impl Watched {
    /// Loads `path` (an error when it does not load: a server must not start on a bad file).
    pub fn open(path: &Path) -> Result<Watched, LoadErrors> {
        let st = stamp(path);
        let set = RuleSet::load_file(path)?;
        Ok(Watched {
            path: path.to_path_buf(),
            stamp: st,
            current: Arc::new(set),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn current(&self) -> &Arc<RuleSet> {
        &self.current
    }

    /// Looks at the file again (`force`: even if it seems unchanged, e.g. on SIGHUP).
    pub fn check(&mut self, force: bool) -> Reload {
        let st = stamp(&self.path);
        if !force && st == self.stamp {
            return Reload::Unchanged;
        }
        self.stamp = st;
        match RuleSet::load_file(&self.path) {
            Ok(set) => {
                self.current = Arc::new(set);
                Reload::Loaded(self.current.clone())
            }
            Err(e) => Reload::Refused(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str =
        "- rule: r\n  desc: d\n  condition: kind = file\n  output: o\n  priority: notice\n";

    #[test]
    fn a_bad_file_never_replaces_a_good_set() {
        let dir = std::env::temp_dir().join(format!("kiln-rules-reload-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("r.yaml");
        std::fs::write(&f, GOOD).unwrap();
        let mut w = Watched::open(&f).unwrap();
        assert!(matches!(w.check(false), Reload::Unchanged));
        std::fs::write(&f, "- rule: r\n  condition: kind = = file\n").unwrap();
        match w.check(true) {
            Reload::Refused(e) => assert_eq!(e.0[0].line, 2, "{e}"),
            other => panic!("{other:?}"),
        }
        assert_eq!(w.current().rules.len(), 1);
        assert_eq!(w.current().rules[0].name, "r");
        std::fs::write(&f, GOOD.replace("rule: r", "rule: r2")).unwrap();
        match w.check(true) {
            Reload::Loaded(s) => assert_eq!(s.rules[0].name, "r2"),
            other => panic!("{other:?}"),
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
