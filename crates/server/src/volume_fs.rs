//! File operations inside one volume's directory for the volume-content API, never leaving
//! it: every path is resolved with `openat2(RESOLVE_IN_ROOT | RESOLVE_NO_XDEV)` from the
//! volume's root, and the last component is always acted on relative to its parent's fd
//! without following a symlink — so a symlink a sandbox wrote (`ln -s / escape`) can neither
//! be read through nor written through, however it races the request.
//!
//! Every call is blocking (run it on a blocking thread). Errors name the volume path only,
//! never a host path.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;

use nix::errno::Errno;
use nix::fcntl::{openat, openat2, AtFlags, OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::{fstat, fstatat, mkdirat, FileStat, Mode, SFlag};
use nix::unistd::{fchown, fchownat, unlinkat, Gid, Uid, UnlinkatFlags};
use serde::Serialize;

/// What went wrong, by the status it answers.
#[derive(Debug, thiserror::Error)]
pub enum FsError {
    /// 400.
    #[error("{0}")]
    BadPath(String),
    /// 404.
    #[error("{0}")]
    NotFound(String),
    /// 409.
    #[error("{0}")]
    Conflict(String),
    /// 507.
    #[error("the volume is full: {0}")]
    NoSpace(String),
    /// 500.
    #[error("{0}")]
    Io(String),
}

type Result<T> = std::result::Result<T, FsError>;

/// A path inside a volume, as components (no `.`, `..` or empty ones).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolPath(Vec<String>);

impl VolPath {
    /// Parses a client's path (`/a/b`, `a/b`; `/` or empty: the root); `..` is refused.
    pub fn parse(p: &str) -> Result<Self> {
        if p.contains('\0') || p.len() > 4096 {
            return Err(FsError::BadPath(format!("path {p:?} is not valid")));
        }
        let mut out = Vec::new();
        for c in p.split('/').filter(|c| !c.is_empty() && *c != ".") {
            if c == ".." {
                return Err(FsError::BadPath(format!(
                    "path {p:?} must not contain '..'"
                )));
            }
            if c.len() > 255 {
                return Err(FsError::BadPath(format!("a name in {p:?} is too long")));
            }
            out.push(c.to_string());
        }
        Ok(Self(out))
    }

    /// `/a/b` (`/` for the root).
    pub fn display(&self) -> String {
        format!("/{}", self.0.join("/"))
    }

    fn child(&self, name: &str) -> Self {
        let mut v = self.0.clone();
        v.push(name.to_string());
        Self(v)
    }

    fn split_last(&self) -> Option<(Self, &str)> {
        let (last, rest) = self.0.split_last()?;
        Some((Self(rest.to_vec()), last))
    }
}

/// One entry as the content API answers it.
#[derive(Debug, Clone, Serialize)]
pub struct Stat {
    pub name: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub path: String,
    pub size: i64,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub atime: String,
    pub mtime: String,
    pub ctime: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
}

/// Owner and mode to give what a call makes or changes.
#[derive(Debug, Clone, Copy, Default)]
pub struct Attrs {
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub mode: Option<u32>,
}

fn errno(e: Errno, p: &VolPath) -> FsError {
    let p = p.display();
    match e {
        Errno::ENOENT => FsError::NotFound(format!("{p} does not exist")),
        Errno::EEXIST => FsError::Conflict(format!("{p} exists already")),
        Errno::ENOTEMPTY => FsError::Conflict(format!("{p} is not empty")),
        Errno::EISDIR => FsError::Conflict(format!("{p} is a directory")),
        Errno::ENOTDIR => FsError::BadPath(format!("a parent of {p} is not a directory")),
        Errno::ELOOP => FsError::BadPath(format!("{p} is (or goes through) a symbolic link")),
        Errno::EXDEV => FsError::BadPath(format!("{p} leaves the volume")),
        Errno::ENOSPC | Errno::EDQUOT => FsError::NoSpace(format!("writing {p}")),
        Errno::ENAMETOOLONG => FsError::BadPath(format!("{p} is too long")),
        e => FsError::Io(format!("{p}: {}", e.desc())),
    }
}

fn io(e: std::io::Error, p: &VolPath) -> FsError {
    match e.raw_os_error() {
        Some(n) => errno(Errno::from_raw(n), p),
        None => FsError::Io(format!("{}: {e}", p.display())),
    }
}

fn owned(fd: RawFd) -> OwnedFd {
    // SAFETY: `fd` was just returned by a successful open call and nothing else owns it.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

fn rfc3339(secs: i64, nsecs: i64) -> String {
    chrono::DateTime::from_timestamp(secs, nsecs.clamp(0, 999_999_999) as u32)
        .unwrap_or_default()
        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

/// One volume's files.
pub struct Volume {
    root: OwnedFd,
}

impl Volume {
    /// Opens the volume whose files are in host directory `dir`.
    pub fn open(dir: &Path) -> Result<Self> {
        let fd = nix::fcntl::open(
            dir,
            OFlag::O_DIRECTORY | OFlag::O_RDONLY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| FsError::Io(format!("opening the volume: {}", e.desc())))?;
        Ok(Self { root: owned(fd) })
    }

    /// The directory `p`, resolved inside the volume.
    fn dir(&self, p: &VolPath) -> Result<OwnedFd> {
        let rel = if p.0.is_empty() {
            ".".to_string()
        } else {
            p.0.join("/")
        };
        let how = OpenHow::new()
            .flags(OFlag::O_DIRECTORY | OFlag::O_RDONLY | OFlag::O_CLOEXEC)
            .resolve(
                ResolveFlag::RESOLVE_IN_ROOT
                    | ResolveFlag::RESOLVE_NO_MAGICLINKS
                    | ResolveFlag::RESOLVE_NO_XDEV,
            );
        openat2(self.root.as_raw_fd(), rel.as_str(), how)
            .map(owned)
            .map_err(|e| errno(e, p))
    }

    fn stat_of(st: &FileStat, p: &VolPath, target: Option<String>) -> Stat {
        let kind = match SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits()) {
            SFlag::S_IFREG => "file",
            SFlag::S_IFDIR => "directory",
            SFlag::S_IFLNK => "symlink",
            _ => "unknown",
        };
        Stat {
            name: p.0.last().cloned().unwrap_or_default(),
            kind,
            path: p.display(),
            size: st.st_size,
            mode: st.st_mode & 0o7777,
            uid: st.st_uid,
            gid: st.st_gid,
            atime: rfc3339(st.st_atime, st.st_atime_nsec),
            mtime: rfc3339(st.st_mtime, st.st_mtime_nsec),
            ctime: rfc3339(st.st_ctime, st.st_ctime_nsec),
            target,
        }
    }

    /// Stat of `name` in directory `dir` (not following a symlink).
    fn stat_at(dir: RawFd, name: &str, p: &VolPath) -> Result<Stat> {
        let st = fstatat(Some(dir), name, AtFlags::AT_SYMLINK_NOFOLLOW).map_err(|e| errno(e, p))?;
        let target = (st.st_mode & SFlag::S_IFMT.bits() == SFlag::S_IFLNK.bits())
            .then(|| nix::fcntl::readlinkat(Some(dir), name).ok())
            .flatten()
            .map(|t| t.to_string_lossy().into_owned());
        Ok(Self::stat_of(&st, p, target))
    }

    /// Stat of `p`.
    pub fn stat(&self, p: &VolPath) -> Result<Stat> {
        match p.split_last() {
            None => {
                let st = fstat(self.root.as_raw_fd()).map_err(|e| errno(e, p))?;
                Ok(Self::stat_of(&st, p, None))
            }
            Some((parent, name)) => Self::stat_at(self.dir(&parent)?.as_raw_fd(), name, p),
        }
    }

    /// The entries of directory `p`, and of its subdirectories down to `depth` levels.
    pub fn list(&self, p: &VolPath, depth: u32) -> Result<Vec<Stat>> {
        let dir = self.dir(p)?;
        let mut out = Vec::new();
        Self::list_into(dir, p, depth.max(1), &mut out)?;
        Ok(out)
    }

    fn names(dir: &OwnedFd, p: &VolPath) -> Result<Vec<String>> {
        let dup = nix::unistd::dup(dir.as_raw_fd()).map_err(|e| errno(e, p))?;
        let mut d = nix::dir::Dir::from_fd(dup).map_err(|e| errno(e, p))?;
        let mut names: Vec<String> = d
            .iter()
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n != "." && n != "..")
            .collect();
        names.sort();
        Ok(names)
    }

    fn list_into(dir: OwnedFd, p: &VolPath, depth: u32, out: &mut Vec<Stat>) -> Result<()> {
        for name in Self::names(&dir, p)? {
            let cp = p.child(&name);
            let s = match Self::stat_at(dir.as_raw_fd(), &name, &cp) {
                Ok(s) => s,
                Err(FsError::NotFound(_)) => continue, // removed meanwhile
                Err(e) => return Err(e),
            };
            let is_dir = s.kind == "directory";
            out.push(s);
            if is_dir && depth > 1 {
                let sub = openat(
                    Some(dir.as_raw_fd()),
                    name.as_str(),
                    OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_RDONLY | OFlag::O_CLOEXEC,
                    Mode::empty(),
                );
                if let Ok(fd) = sub {
                    Self::list_into(owned(fd), &cp, depth - 1, out)?;
                }
            }
        }
        Ok(())
    }

    /// Sets owner and mode of the open `fd`.
    fn apply(fd: RawFd, a: Attrs, p: &VolPath) -> Result<()> {
        if a.uid.is_some() || a.gid.is_some() {
            fchown(fd, a.uid.map(Uid::from_raw), a.gid.map(Gid::from_raw))
                .map_err(|e| errno(e, p))?;
        }
        if let Some(m) = a.mode {
            nix::sys::stat::fchmod(fd, Mode::from_bits_truncate(m & 0o7777))
                .map_err(|e| errno(e, p))?;
        }
        Ok(())
    }

    /// Makes directory `p` (with `parents`, its missing parents too; an existing directory
    /// is then fine). Returns its stat.
    pub fn make_dir(&self, p: &VolPath, parents: bool, a: Attrs) -> Result<Stat> {
        let Some((parent, name)) = p.split_last() else {
            return Err(FsError::Conflict("the volume's root exists already".into()));
        };
        let dirfd = if parents {
            self.make_parents(&parent, a)?
        } else {
            self.dir(&parent)?
        };
        let mode = Mode::from_bits_truncate(a.mode.unwrap_or(0o755) & 0o7777);
        match mkdirat(Some(dirfd.as_raw_fd()), name, mode) {
            Ok(()) => {}
            Err(Errno::EEXIST) if parents => {}
            Err(e) => return Err(errno(e, p)),
        }
        let fd = openat(
            Some(dirfd.as_raw_fd()),
            name,
            OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_RDONLY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| errno(e, p))?;
        let fd = owned(fd);
        Self::apply(
            fd.as_raw_fd(),
            Attrs {
                mode: Some(mode.bits()),
                ..a
            },
            p,
        )?;
        Self::stat_at(dirfd.as_raw_fd(), name, p)
    }

    /// Makes directory `p` and its missing parents; returns it open.
    fn make_parents(&self, p: &VolPath, a: Attrs) -> Result<OwnedFd> {
        let mut cur = self.dir(&VolPath(Vec::new()))?;
        let mut at = VolPath(Vec::new());
        for c in &p.0 {
            at = at.child(c);
            match mkdirat(
                Some(cur.as_raw_fd()),
                c.as_str(),
                Mode::from_bits_truncate(0o755),
            ) {
                Ok(()) => {
                    let fd = openat(
                        Some(cur.as_raw_fd()),
                        c.as_str(),
                        OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_RDONLY,
                        Mode::empty(),
                    )
                    .map_err(|e| errno(e, &at))?;
                    let fd = owned(fd);
                    Self::apply(fd.as_raw_fd(), Attrs { mode: None, ..a }, &at)?;
                    cur = fd;
                    continue;
                }
                Err(Errno::EEXIST) => {}
                Err(e) => return Err(errno(e, &at)),
            }
            let fd = openat(
                Some(cur.as_raw_fd()),
                c.as_str(),
                OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_RDONLY | OFlag::O_CLOEXEC,
                Mode::empty(),
            )
            .map_err(|e| errno(e, &at))?;
            cur = owned(fd);
        }
        Ok(cur)
    }

    /// Opens file `p` for writing (created, or truncated when it exists); with `parents`, its
    /// missing parent directories are made first. Returns the file and its parent.
    pub fn create_file(
        &self,
        p: &VolPath,
        parents: bool,
        a: Attrs,
    ) -> Result<(std::fs::File, OwnedFd)> {
        let Some((parent, name)) = p.split_last() else {
            return Err(FsError::Conflict("the volume's root is a directory".into()));
        };
        let dirfd = if parents {
            self.make_parents(&parent, Attrs::default())?
        } else {
            self.dir(&parent)?
        };
        let mode = Mode::from_bits_truncate(a.mode.unwrap_or(0o644) & 0o7777);
        let fd = openat(
            Some(dirfd.as_raw_fd()),
            name,
            OFlag::O_WRONLY
                | OFlag::O_CREAT
                | OFlag::O_TRUNC
                | OFlag::O_NOFOLLOW
                | OFlag::O_NONBLOCK
                | OFlag::O_CLOEXEC,
            mode,
        )
        .map_err(|e| errno(e, p))?;
        let fd = owned(fd);
        let st = fstat(fd.as_raw_fd()).map_err(|e| errno(e, p))?;
        if st.st_mode & SFlag::S_IFMT.bits() != SFlag::S_IFREG.bits() {
            return Err(FsError::Conflict(format!(
                "{} is not a regular file",
                p.display()
            )));
        }
        Self::apply(
            fd.as_raw_fd(),
            Attrs {
                mode: a.mode.map(|_| mode.bits()),
                ..a
            },
            p,
        )?;
        Ok((std::fs::File::from(fd), dirfd))
    }

    /// Stat of `name` in `dir` (after a write through [`Self::create_file`]).
    pub fn stat_in(dir: &OwnedFd, p: &VolPath) -> Result<Stat> {
        let name = p.0.last().map(String::as_str).unwrap_or(".");
        Self::stat_at(dir.as_raw_fd(), name, p)
    }

    /// Opens regular file `p` for reading.
    pub fn open_file(&self, p: &VolPath) -> Result<std::fs::File> {
        let Some((parent, name)) = p.split_last() else {
            return Err(FsError::Conflict("the volume's root is a directory".into()));
        };
        let dirfd = self.dir(&parent)?;
        let fd = openat(
            Some(dirfd.as_raw_fd()),
            name,
            OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| errno(e, p))?;
        let fd = owned(fd);
        let st = fstat(fd.as_raw_fd()).map_err(|e| errno(e, p))?;
        if st.st_mode & SFlag::S_IFMT.bits() != SFlag::S_IFREG.bits() {
            return Err(FsError::BadPath(format!("{} is not a file", p.display())));
        }
        Ok(std::fs::File::from(fd))
    }

    /// Changes owner and mode of `p` (a symlink's owner only).
    pub fn update(&self, p: &VolPath, a: Attrs) -> Result<Stat> {
        let Some((parent, name)) = p.split_last() else {
            Self::apply(self.root.as_raw_fd(), a, p)?;
            return self.stat(p);
        };
        let dirfd = self.dir(&parent)?;
        match openat(
            Some(dirfd.as_raw_fd()),
            name,
            OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC,
            Mode::empty(),
        ) {
            Ok(fd) => Self::apply(owned(fd).as_raw_fd(), a, p)?,
            Err(Errno::ELOOP) => {
                if a.mode.is_some() {
                    return Err(FsError::BadPath(format!(
                        "{} is a symbolic link: its mode cannot change",
                        p.display()
                    )));
                }
                fchownat(
                    Some(dirfd.as_raw_fd()),
                    name,
                    a.uid.map(Uid::from_raw),
                    a.gid.map(Gid::from_raw),
                    AtFlags::AT_SYMLINK_NOFOLLOW,
                )
                .map_err(|e| errno(e, p))?;
            }
            Err(e) => return Err(errno(e, p)),
        }
        Self::stat_at(dirfd.as_raw_fd(), name, p)
    }

    /// Removes `p` (a directory with everything in it).
    pub fn remove(&self, p: &VolPath) -> Result<()> {
        let Some((parent, name)) = p.split_last() else {
            return Err(FsError::BadPath(
                "the volume's root cannot be removed".into(),
            ));
        };
        let dirfd = self.dir(&parent)?;
        Self::remove_at(&dirfd, name, p)
    }

    fn remove_at(dir: &OwnedFd, name: &str, p: &VolPath) -> Result<()> {
        let st = fstatat(Some(dir.as_raw_fd()), name, AtFlags::AT_SYMLINK_NOFOLLOW)
            .map_err(|e| errno(e, p))?;
        if st.st_mode & SFlag::S_IFMT.bits() == SFlag::S_IFDIR.bits() {
            let sub = openat(
                Some(dir.as_raw_fd()),
                name,
                OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_RDONLY | OFlag::O_CLOEXEC,
                Mode::empty(),
            )
            .map_err(|e| errno(e, p))?;
            let sub = owned(sub);
            for n in Self::names(&sub, p)? {
                match Self::remove_at(&sub, &n, &p.child(&n)) {
                    Ok(()) | Err(FsError::NotFound(_)) => {}
                    Err(e) => return Err(e),
                }
            }
            unlinkat(Some(dir.as_raw_fd()), name, UnlinkatFlags::RemoveDir).map_err(|e| errno(e, p))
        } else {
            unlinkat(Some(dir.as_raw_fd()), name, UnlinkatFlags::NoRemoveDir)
                .map_err(|e| errno(e, p))
        }
    }
}

/// Maps an I/O error of a write to the volume-path error it means (ENOSPC: the volume is full).
pub fn write_error(e: std::io::Error, p: &VolPath) -> FsError {
    io(e, p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_parse_and_dotdot_is_refused() {
        assert_eq!(VolPath::parse("/a//b/./c").unwrap().display(), "/a/b/c");
        assert_eq!(VolPath::parse("").unwrap().display(), "/");
        assert!(matches!(
            VolPath::parse("/a/../b"),
            Err(FsError::BadPath(_))
        ));
        assert!(matches!(VolPath::parse(".."), Err(FsError::BadPath(_))));
    }

    #[test]
    fn operations_stay_inside_and_do_not_follow_symlinks() {
        let tmp = tempfile::tempdir().unwrap();
        let outside = tmp.path().join("outside");
        std::fs::write(&outside, "secret").unwrap();
        let root = tmp.path().join("vol");
        std::fs::create_dir(&root).unwrap();
        std::os::unix::fs::symlink("/", root.join("escape")).unwrap();
        std::os::unix::fs::symlink(&outside, root.join("link")).unwrap();
        let v = Volume::open(&root).unwrap();
        let p = |s| VolPath::parse(s).unwrap();
        // Through an absolute symlink: resolved inside the volume (where there is nothing).
        assert!(matches!(
            v.stat(&p("/escape/etc/passwd")),
            Err(FsError::NotFound(_))
        ));
        assert!(v.open_file(&p("/link")).is_err());
        assert!(v.create_file(&p("/link"), false, Attrs::default()).is_err());
        assert_eq!(std::fs::read_to_string(&outside).unwrap(), "secret");
        let s = v.stat(&p("/link")).unwrap();
        assert_eq!((s.kind, s.target.as_deref()), ("symlink", outside.to_str()));
        // Directories, files, listing, removal.
        assert!(matches!(
            v.make_dir(&p("/a/b"), false, Attrs::default()),
            Err(FsError::NotFound(_))
        ));
        let d = v.make_dir(
            &p("/a/b"),
            true,
            Attrs {
                mode: Some(0o700),
                ..Default::default()
            },
        );
        assert_eq!(d.unwrap().mode, 0o700);
        let (mut f, dir) = v
            .create_file(&p("/a/b/f.txt"), false, Attrs::default())
            .unwrap();
        std::io::Write::write_all(&mut f, b"hello").unwrap();
        let s = Volume::stat_in(&dir, &p("/a/b/f.txt")).unwrap();
        assert_eq!(
            (s.kind, s.size, s.mode, s.name.as_str()),
            ("file", 5, 0o644, "f.txt")
        );
        let all = v.list(&p("/"), 3).unwrap();
        let paths: Vec<&str> = all.iter().map(|s| s.path.as_str()).collect();
        assert_eq!(paths, ["/a", "/a/b", "/a/b/f.txt", "/escape", "/link"]);
        assert_eq!(v.list(&p("/"), 1).unwrap().len(), 3);
        let u = v.update(
            &p("/a/b/f.txt"),
            Attrs {
                uid: Some(1000),
                gid: Some(1000),
                mode: Some(0o600),
            },
        );
        let u = u.unwrap();
        assert_eq!((u.uid, u.gid, u.mode), (1000, 1000, 0o600));
        v.remove(&p("/a")).unwrap();
        v.remove(&p("/escape")).unwrap();
        assert!(std::path::Path::new("/etc/passwd").exists());
        assert!(matches!(v.stat(&p("/a")), Err(FsError::NotFound(_))));
        assert!(matches!(v.remove(&p("/")), Err(FsError::BadPath(_))));
    }
}
