//! `filesystem.Filesystem` operations (except watching) and path resolution.

use std::collections::{BTreeMap, HashMap};
use std::fs::Metadata;
use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use kiln_proto::filesystem::{EntryInfo, FileType};

use crate::rpc::RpcError;
use crate::users::{self, User};

/// Prefix of the xattrs that hold user metadata set via `X-Metadata-*`.
pub const XATTR_PREFIX: &str = "user.e2b.";

/// Resolve `path` for `user`: `~` and relative paths are taken from the user's home. The path is
/// normalised lexically (`.`/`..`); symlinks are left to the kernel so the user's permissions
/// decide what is reachable.
pub fn resolve(path: &str, user: &User) -> Result<PathBuf, RpcError> {
    if path.contains('\0') {
        return Err(RpcError::invalid("path contains a NUL byte"));
    }
    let p = if path.is_empty() || path == "~" {
        user.home.clone()
    } else if let Some(rest) = path.strip_prefix("~/") {
        user.home.join(rest)
    } else if path.starts_with('/') {
        PathBuf::from(path)
    } else {
        user.home.join(path)
    };
    Ok(normalize(&p))
}

/// Lexical normalisation of an absolute path.
pub fn normalize(p: &Path) -> PathBuf {
    let mut out = PathBuf::from("/");
    for c in p.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::Normal(n) => out.push(n),
            _ => {}
        }
    }
    out
}

fn permissions_string(mode: u32, ft: FileType) -> String {
    let mut s = String::with_capacity(10);
    s.push(match ft {
        FileType::Directory => 'd',
        FileType::Symlink => 'L',
        _ => '-',
    });
    for shift in [6u32, 3, 0] {
        let bits = (mode >> shift) & 7;
        s.push(if bits & 4 != 0 { 'r' } else { '-' });
        s.push(if bits & 2 != 0 { 'w' } else { '-' });
        s.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    s
}

fn file_type(m: &Metadata) -> FileType {
    if m.is_dir() {
        FileType::Directory
    } else if m.file_type().is_symlink() {
        FileType::Symlink
    } else {
        FileType::File
    }
}

/// The metadata of `path`: its `user.e2b.*` xattrs (without following a final symlink) and
/// what the agent keeps for it where the filesystem has no user xattrs ([`crate::metastore`]).
pub fn read_metadata(path: &Path) -> HashMap<String, String> {
    let mut out: HashMap<String, String> =
        crate::metastore::store().get(path).into_iter().collect();
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else {
        return out;
    };
    for name in xattr_names(&c, false) {
        let Some(key) = name.strip_prefix(XATTR_PREFIX) else {
            continue;
        };
        let Ok(cname) = std::ffi::CString::new(name.as_str()) else {
            continue;
        };
        let mut val = vec![0u8; 4096];
        // SAFETY: lgetxattr into a buffer of the given size.
        let vn = unsafe {
            libc::lgetxattr(
                c.as_ptr(),
                cname.as_ptr(),
                val.as_mut_ptr().cast(),
                val.len(),
            )
        };
        if vn >= 0 {
            out.insert(
                key.to_string(),
                String::from_utf8_lossy(&val[..vn as usize]).into_owned(),
            );
        }
    }
    out
}

/// Names of the xattrs of `c` (empty when it has none or the filesystem has no xattrs);
/// `follow`: of a final symlink's target.
fn xattr_names(c: &std::ffi::CStr, follow: bool) -> Vec<String> {
    let mut buf = vec![0u8; 4096];
    // SAFETY: (l)listxattr into a buffer of the given size.
    let n = unsafe {
        if follow {
            libc::listxattr(c.as_ptr(), buf.as_mut_ptr().cast(), buf.len())
        } else {
            libc::llistxattr(c.as_ptr(), buf.as_mut_ptr().cast(), buf.len())
        }
    };
    if n <= 0 {
        return Vec::new();
    }
    buf[..n as usize]
        .split(|b| *b == 0)
        .filter_map(|n| std::str::from_utf8(n).ok())
        .filter(|n| !n.is_empty())
        .map(str::to_string)
        .collect()
}

/// Replaces the `user.e2b.*` xattrs of `path` (a final symlink followed, as the write did)
/// with `meta` (keys lowercased; none: removes
/// them all, as an overwrite does). `Ok(false)`: the filesystem has no user xattrs
/// (`EOPNOTSUPP`), nothing was stored and the caller keeps `meta` in [`crate::metastore`].
pub fn replace_xattrs(path: &Path, meta: &BTreeMap<String, String>) -> io::Result<bool> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())?;
    for name in xattr_names(&c, true) {
        if name.starts_with(XATTR_PREFIX) {
            if let Ok(cname) = std::ffi::CString::new(name) {
                // SAFETY: removexattr with valid C strings.
                unsafe { libc::removexattr(c.as_ptr(), cname.as_ptr()) };
            }
        }
    }
    for (key, value) in meta {
        let name = std::ffi::CString::new(format!("{XATTR_PREFIX}{}", key.to_ascii_lowercase()))?;
        // SAFETY: setxattr with valid C strings and a value slice.
        let r = unsafe {
            libc::setxattr(
                c.as_ptr(),
                name.as_ptr(),
                value.as_ptr().cast(),
                value.len(),
                0,
            )
        };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EOPNOTSUPP) {
                return Ok(false);
            }
            return Err(e);
        }
    }
    Ok(true)
}

/// EntryInfo of `path`. A symlink reports its target's information (type, size, mode,
/// permissions, owner, group, modification time) with `symlink_target` set to the resolved
/// target and `is_symlink`; a dangling link reports the link itself as a file.
pub fn entry_info(path: &Path) -> io::Result<EntryInfo> {
    let lm = std::fs::symlink_metadata(path)?;
    let is_symlink = lm.file_type().is_symlink();
    let (m, ft, symlink_target) = if is_symlink {
        let target = std::fs::canonicalize(path)
            .ok()
            .or_else(|| std::fs::read_link(path).ok())
            .map(|t| t.to_string_lossy().into_owned());
        match std::fs::metadata(path) {
            Ok(tm) => {
                let ft = file_type(&tm);
                (tm, ft, target)
            }
            Err(_) => (lm, FileType::File, target),
        }
    } else {
        let ft = file_type(&lm);
        (lm, ft, None)
    };
    let mtime = pbjson_types::Timestamp {
        seconds: m.mtime(),
        nanos: m.mtime_nsec() as i32,
    };
    Ok(EntryInfo {
        name: path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "/".into()),
        r#type: ft as i32,
        path: path.to_string_lossy().into_owned(),
        size: m.len() as i64,
        mode: m.permissions().mode() & 0o7777,
        permissions: permissions_string(m.permissions().mode(), ft),
        owner: users::user_name(m.uid()),
        group: users::group_name(m.gid()),
        modified_time: Some(mtime),
        symlink_target,
        metadata: read_metadata(path),
        is_symlink,
    })
}

pub fn stat(path: &Path) -> Result<EntryInfo, RpcError> {
    entry_info(path).map_err(|e| RpcError::io(&format!("stat {}", path.display()), &e))
}

pub fn make_dir(path: &Path, user: &User) -> Result<EntryInfo, RpcError> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => {
            return Err(RpcError::new(
                kiln_proto::connect::Code::AlreadyExists,
                format!("directory {} already exists", path.display()),
            ))
        }
        Ok(_) => {
            return Err(RpcError::invalid(format!(
                "{} exists and is not a directory",
                path.display()
            )))
        }
        Err(_) => {}
    }
    create_dirs(path, user)
        .map_err(|e| RpcError::io(&format!("create directory {}", path.display()), &e))?;
    stat(path)
}

/// `mkdir -p` where new directories belong to `user` (they do already when the filesystem
/// identity is switched; the explicit chown covers kernels/sandboxes where setfsuid is not
/// honoured, as envd does).
pub fn create_dirs(path: &Path, user: &User) -> io::Result<()> {
    let mut missing = Vec::new();
    let mut cur = Some(path);
    while let Some(p) = cur {
        if std::fs::symlink_metadata(p).is_ok() {
            break;
        }
        missing.push(p.to_path_buf());
        cur = p.parent();
    }
    std::fs::create_dir_all(path)?;
    for p in missing.iter().rev() {
        chown_new(p, user);
    }
    Ok(())
}

/// Give a just-created entry to `user` when the agent runs as root (no-op otherwise).
pub fn chown_new(path: &Path, user: &User) {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 || user.uid == 0 {
        return;
    }
    if let Ok(m) = std::fs::symlink_metadata(path) {
        if m.uid() != user.uid {
            let _ = std::os::unix::fs::lchown(path, Some(user.uid), Some(user.gid));
        }
    }
}

pub fn move_entry(src: &Path, dst: &Path, user: &User) -> Result<EntryInfo, RpcError> {
    std::fs::symlink_metadata(src)
        .map_err(|e| RpcError::io(&format!("move source {}", src.display()), &e))?;
    if let Some(parent) = dst.parent() {
        create_dirs(parent, user)
            .map_err(|e| RpcError::io(&format!("create parent of {}", dst.display()), &e))?;
    }
    std::fs::rename(src, dst)
        .map_err(|e| RpcError::io(&format!("move {} to {}", src.display(), dst.display()), &e))?;
    stat(dst)
}

/// Removes a file, link or directory tree. A path that does not exist is already removed: that
/// succeeds, as in E2B.
pub fn remove(path: &Path) -> Result<(), RpcError> {
    let r = match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
        Err(e) => Err(e),
    };
    match r {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        r => r.map_err(|e| RpcError::io(&format!("remove {}", path.display()), &e)),
    }
}

/// Entries below `path` down to `depth` levels (1 = direct children). Symlinked directories are
/// listed but not descended into.
pub fn list_dir(path: &Path, depth: u32) -> Result<Vec<EntryInfo>, RpcError> {
    let depth = depth.max(1);
    let m = std::fs::metadata(path)
        .map_err(|e| RpcError::io(&format!("list {}", path.display()), &e))?;
    if !m.is_dir() {
        return Err(RpcError::invalid(format!(
            "path {} is not a directory",
            path.display()
        )));
    }
    let mut out = Vec::new();
    walk(path, depth, &mut out)
        .map_err(|e| RpcError::io(&format!("list {}", path.display()), &e))?;
    Ok(out)
}

fn walk(dir: &Path, depth: u32, out: &mut Vec<EntryInfo>) -> io::Result<()> {
    let mut entries: Vec<_> = std::fs::read_dir(dir)?.filter_map(Result::ok).collect();
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let p = e.path();
        let Ok(info) = entry_info(&p) else { continue };
        let descend = depth > 1 && !info.is_symlink && info.r#type == FileType::Directory as i32;
        out.push(info);
        if descend {
            // Unreadable subdirectories are listed but not entered.
            let _ = walk(&p, depth - 1, out);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolves_relative_and_dotdot() {
        let u = User {
            name: "u".into(),
            uid: 1,
            gid: 1,
            home: "/home/u".into(),
            shell: String::new(),
            groups: vec![],
        };
        assert_eq!(resolve("a/b", &u).unwrap(), PathBuf::from("/home/u/a/b"));
        assert_eq!(resolve("~/x", &u).unwrap(), PathBuf::from("/home/u/x"));
        assert_eq!(
            resolve("../../etc/passwd", &u).unwrap(),
            PathBuf::from("/etc/passwd")
        );
        assert_eq!(resolve("/a/./b/../c", &u).unwrap(), PathBuf::from("/a/c"));
        assert!(resolve("a\0b", &u).is_err());
    }

    #[test]
    fn permission_strings() {
        assert_eq!(permissions_string(0o755, FileType::Directory), "drwxr-xr-x");
        assert_eq!(permissions_string(0o640, FileType::File), "-rw-r-----");
    }
}
