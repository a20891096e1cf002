//! Paths inside an unpacked root filesystem, resolved as if the root were `/`: a symlink met on
//! the way (`/lib -> usr/lib`, `/etc/x -> /opt/y`) is followed *inside* the root, `..` never
//! climbs above it, so nothing the image contains can make kiln touch a host path.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::path::{Component, Path, PathBuf};

use super::OciError;

/// Most symlinks followed for one path (Linux's limit).
const MAX_HOPS: usize = 40;

/// How [`resolve`] treats the path's last component and missing directories.
#[derive(Debug, Clone, Copy)]
pub struct Resolve {
    /// Follow a symlink in the last component (else the link itself is the answer).
    pub follow_last: bool,
    /// Create missing directories on the way (every component but the last; mode 0755, owned
    /// by root).
    pub create_parents: bool,
}

/// Host path of `path` (absolute or relative, read as relative to `root`) inside `root`.
pub fn resolve(root: &Path, path: &Path, how: Resolve) -> Result<PathBuf, OciError> {
    let mut queue: VecDeque<OsString> = VecDeque::new();
    push_components(&mut queue, path, false);
    let mut real: Vec<OsString> = Vec::new();
    let mut hops = 0;
    while let Some(c) = queue.pop_front() {
        if c == ".." {
            real.pop();
            continue;
        }
        let is_last = queue.is_empty();
        let here = join(root, &real).join(&c);
        match here.symlink_metadata() {
            Ok(md) if md.file_type().is_symlink() && (!is_last || how.follow_last) => {
                hops += 1;
                if hops > MAX_HOPS {
                    return Err(OciError::Invalid(format!(
                        "too many symbolic links resolving /{} in the image",
                        path.display()
                    )));
                }
                let target = std::fs::read_link(&here)
                    .map_err(|e| OciError::io(format!("reading link {}", here.display()), e))?;
                if target.is_absolute() {
                    real.clear();
                }
                let mut rest = VecDeque::new();
                push_components(&mut rest, &target, true);
                rest.extend(queue.drain(..));
                queue = rest;
            }
            Ok(md) => {
                if !is_last && !md.is_dir() {
                    return Err(OciError::Invalid(format!(
                        "/{} in the image: a parent is not a directory",
                        path.display()
                    )));
                }
                real.push(c);
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if !is_last {
                    if !how.create_parents {
                        return Err(OciError::io(format!("/{} in the image", path.display()), e));
                    }
                    std::fs::create_dir(&here)
                        .map_err(|e| OciError::io(format!("creating {}", here.display()), e))?;
                }
                real.push(c);
            }
            Err(e) => return Err(OciError::io(format!("looking at {}", here.display()), e)),
        }
    }
    Ok(join(root, &real))
}

fn push_components(queue: &mut VecDeque<OsString>, p: &Path, keep_dotdot: bool) {
    for c in p.components() {
        match c {
            Component::Normal(s) => queue.push_back(s.to_os_string()),
            Component::ParentDir if keep_dotdot => queue.push_back("..".into()),
            Component::ParentDir => {
                queue.pop_back();
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
}

fn join(root: &Path, parts: &[OsString]) -> PathBuf {
    let mut p = root.to_path_buf();
    for c in parts {
        p.push(c);
    }
    p
}

/// True when the relative path has no `..` and is not absolute (what a tar entry name must be
/// after its leading `/` and `./` are dropped).
pub fn is_clean_relative(p: &Path) -> bool {
    p.components()
        .all(|c| matches!(c, Component::Normal(_) | Component::CurDir))
}

/// True when the symlink target, read from the directory `dir` (relative to the root), stays
/// inside the root lexically (absolute targets always do: they are resolved against the root).
pub fn link_stays_inside(dir: &Path, target: &Path) -> bool {
    if target.is_absolute() {
        return true;
    }
    let mut depth: i64 = dir
        .components()
        .filter(|c| matches!(c, Component::Normal(_)))
        .count() as i64;
    for c in target.components() {
        match c {
            Component::ParentDir => {
                depth -= 1;
                if depth < 0 {
                    return false;
                }
            }
            Component::Normal(_) => depth += 1,
            _ => {}
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    const FOLLOW: Resolve = Resolve {
        follow_last: true,
        create_parents: false,
    };

    #[test]
    fn symlinks_resolve_inside_the_root() {
        let t = tempfile::tempdir().unwrap();
        let r = t.path();
        std::fs::create_dir_all(r.join("usr/lib")).unwrap();
        std::fs::create_dir(r.join("etc")).unwrap();
        symlink("usr/lib", r.join("lib")).unwrap();
        symlink("/etc", r.join("usr/lib/abs")).unwrap(); // absolute: the root's /etc
        symlink("../../../../../../etc", r.join("usr/lib/up")).unwrap();
        assert_eq!(
            resolve(r, Path::new("/lib/x.so"), FOLLOW).unwrap(),
            r.join("usr/lib/x.so")
        );
        assert_eq!(
            resolve(r, Path::new("lib/abs/passwd"), FOLLOW).unwrap(),
            r.join("etc/passwd")
        );
        assert_eq!(
            resolve(r, Path::new("lib/up/passwd"), FOLLOW).unwrap(),
            r.join("etc/passwd")
        );
        // The last component is not followed unless asked.
        let nofollow = Resolve {
            follow_last: false,
            create_parents: false,
        };
        assert_eq!(
            resolve(r, Path::new("lib"), nofollow).unwrap(),
            r.join("lib")
        );
        // Loops end with an error.
        symlink("loop2", r.join("loop1")).unwrap();
        symlink("loop1", r.join("loop2")).unwrap();
        assert!(resolve(r, Path::new("loop1/x"), FOLLOW).is_err());
        // Missing parents are created on request, inside the root.
        let mk = Resolve {
            follow_last: false,
            create_parents: true,
        };
        assert_eq!(
            resolve(r, Path::new("lib/abs/new/f"), mk).unwrap(),
            r.join("etc/new/f")
        );
        assert!(r.join("etc/new").is_dir());
    }

    #[test]
    fn lexical_checks() {
        assert!(is_clean_relative(Path::new("a/b/./c")));
        assert!(!is_clean_relative(Path::new("a/../b")));
        assert!(!is_clean_relative(Path::new("/etc")));
        assert!(link_stays_inside(
            Path::new("usr/bin"),
            Path::new("../lib/x")
        ));
        assert!(link_stays_inside(
            Path::new("usr/bin"),
            Path::new("/anything/../..")
        ));
        assert!(!link_stays_inside(
            Path::new("usr/bin"),
            Path::new("../../../etc")
        ));
        assert!(!link_stays_inside(Path::new(""), Path::new("..")));
    }
}
