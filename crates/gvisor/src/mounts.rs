//! Host mounts of a gVisor sandbox: the overlayfs writable layer over the template rootfs, and
//! the bounded tmpfs of its `run/` directory.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use crate::driver::{DriverError, Result};

fn cstr(p: &Path) -> Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| DriverError::Other(format!("path {} contains a NUL byte", p.display())))
}

/// Whether `path` is a mount point. Asked of the path itself (statx's mount-root attribute,
/// constant time) rather than by reading /proc/self/mountinfo, which with a thousand sandboxes
/// holds thousands of lines and took tens of milliseconds off every resume; the table is the
/// answer only where the kernel does not report the attribute.
pub fn is_mounted(path: &Path) -> bool {
    mount_root(path).unwrap_or_else(|| listed_in_mountinfo(path))
}

/// `STATX_ATTR_MOUNT_ROOT` of `path` (its last component not followed); `None` when the
/// kernel does not report that attribute.
fn mount_root(path: &Path) -> Option<bool> {
    let c = CString::new(path.as_os_str().as_bytes()).ok()?;
    let mut st = std::mem::MaybeUninit::<libc::statx>::zeroed();
    // SAFETY: `c` is a NUL-terminated path that outlives the call, and `st` is a writable
    // buffer of the size statx fills.
    let rc = unsafe {
        libc::statx(
            libc::AT_FDCWD,
            c.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW | libc::AT_NO_AUTOMOUNT,
            0,
            st.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return match std::io::Error::last_os_error().raw_os_error() {
            Some(libc::ENOENT) | Some(libc::ENOTDIR) => Some(false),
            _ => None,
        };
    }
    // SAFETY: statx returned 0, so it filled the buffer (zeroed before in any case).
    let st = unsafe { st.assume_init() };
    let attr = libc::STATX_ATTR_MOUNT_ROOT as u64;
    (st.stx_attributes_mask & attr != 0).then_some(st.stx_attributes & attr != 0)
}

/// Whether `path` is listed as a mount point in /proc/self/mountinfo.
fn listed_in_mountinfo(path: &Path) -> bool {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let want = path.to_string_lossy();
    info.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .any(|mp| unescape_mount(mp) == want)
}

fn unescape_mount(s: &str) -> String {
    // mountinfo escapes space, tab, newline and backslash as \ooo.
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 4 <= b.len() {
            if let Ok(v) =
                u8::from_str_radix(std::str::from_utf8(&b[i + 1..i + 4]).unwrap_or("x"), 8)
            {
                out.push(v);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Every mount point at or under `dir` (from /proc/self/mountinfo), deepest first, so they can
/// be unmounted in the order given.
pub fn mounts_under(dir: &Path) -> Vec<std::path::PathBuf> {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    let mut found: Vec<std::path::PathBuf> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|mp| std::path::PathBuf::from(unescape_mount(mp)))
        .filter(|mp| mp.starts_with(dir))
        .collect();
    // Later mounts over the same point come later in mountinfo: keep them first after the
    // stable sort by depth.
    found.reverse();
    found.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    found
}

/// `mount(2)` of `src` at `target`: `src` a path (bind, move) or a file system's name (a new
/// mount of type `fstype`, with `data` as its options); None for a propagation change or a
/// remount. `what` names the operation in the error.
pub(super) fn mount_call(
    src: Option<&Path>,
    target: &Path,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
    what: impl FnOnce() -> String,
) -> Result<()> {
    let src = src.map(cstr).transpose()?;
    let dst = cstr(target)?;
    let text = |s: &str| {
        CString::new(s).map_err(|_| DriverError::Other(format!("{s:?} contains a NUL byte")))
    };
    let fstype = fstype.map(text).transpose()?;
    let data = data.map(text).transpose()?;
    let ptr = |c: &Option<CString>| c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
    // SAFETY: every pointer is null or a valid NUL-terminated string that outlives the call;
    // the file system type and data may be null for bind, move, propagation and remounts.
    let rc = unsafe {
        libc::mount(
            ptr(&src),
            dst.as_ptr(),
            ptr(&fstype),
            flags,
            ptr(&data).cast(),
        )
    };
    if rc != 0 {
        return Err(DriverError::Io {
            what: what(),
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// A new mount of file system `fstype` (no device: tmpfs, ramfs) at `target`.
pub(super) fn mount_fs(
    fstype: &str,
    target: &Path,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> Result<()> {
    mount_call(
        Some(Path::new(fstype)),
        target,
        Some(fstype),
        flags,
        data,
        || format!("mounting a {fstype} at {}", target.display()),
    )
}

/// Moves the mount at `source` to `target` (an existing directory) with `MS_MOVE`. The mount
/// `source` sits on must not be a shared mount (see [`make_private_mount`]).
pub fn move_mount(source: &Path, target: &Path) -> Result<()> {
    mount_call(Some(source), target, None, libc::MS_MOVE, None, || {
        format!(
            "moving the mount {} to {}",
            source.display(),
            target.display()
        )
    })
}

/// Makes `dir` a mount point of its own (a bind mount onto itself) with private propagation,
/// so mounts under it can be moved elsewhere with [`move_mount`] even on hosts whose root is
/// a shared mount (systemd), and nothing mounted under it propagates anywhere.
pub fn make_private_mount(dir: &Path) -> Result<()> {
    if !is_mounted(dir) {
        mount_call(Some(dir), dir, None, libc::MS_BIND, None, || {
            format!("bind-mounting {} onto itself", dir.display())
        })?;
    }
    mount_call(None, dir, None, libc::MS_PRIVATE, None, || {
        format!("making the mount {} private", dir.display())
    })
}

/// Mounts an overlay of `lowers` (topmost first) under the writable `upper`.
pub fn mount_overlay_stack(
    lowers: &[std::path::PathBuf],
    upper: &Path,
    work: &Path,
    target: &Path,
) -> Result<()> {
    for p in lowers.iter().map(|p| p.as_path()).chain([upper, work]) {
        if p.to_string_lossy().contains([',', ':']) {
            return Err(DriverError::Other(format!(
                "overlay layer path {} contains ',' or ':', which overlayfs cannot take",
                p.display()
            )));
        }
    }
    let lower = lowers
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(":");
    let opts = format!(
        "lowerdir={},upperdir={},workdir={}",
        lower,
        upper.display(),
        work.display()
    );
    let src = CString::new("overlay").expect("static");
    let fstype = CString::new("overlay").expect("static");
    let target_c = cstr(target)?;
    let data =
        CString::new(opts).map_err(|_| DriverError::Other("NUL in overlay options".into()))?;
    // SAFETY: all pointers are valid NUL-terminated strings that outlive the call.
    let rc = unsafe {
        libc::mount(
            src.as_ptr(),
            target_c.as_ptr(),
            fstype.as_ptr(),
            0,
            data.as_ptr().cast(),
        )
    };
    if rc != 0 {
        let source = std::io::Error::last_os_error();
        let hint = match source.raw_os_error() {
            Some(libc::EPERM | libc::EACCES) => "; kiln serve must run as root",
            Some(libc::ENOENT) => "; a layer of its stack is gone",
            _ => "",
        };
        return Err(DriverError::Io {
            what: format!(
                "mounting the sandbox overlay at {} (lower {}){hint}",
                target.display(),
                lower
            ),
            source,
        });
    }
    Ok(())
}

/// Bytes and files the sandbox's `run/` tmpfs holds: the agent's socket, its detach marker and
/// a syscall-trace socket need a few inodes and no data.
const RUN_DIR_BYTES: u32 = 64 << 10;
const RUN_DIR_INODES: u32 = 32;

/// Mounts a tiny tmpfs at `target` (the sandbox's `run/`, shared with the sandbox at
/// `/run/kiln`): whatever a root process inside writes there is bounded in size and count,
/// costs no host disk, and goes with the unmount. Nothing when it is mounted already.
pub fn mount_run_dir(target: &Path) -> Result<()> {
    if is_mounted(target) {
        return Ok(());
    }
    let data = format!("size={RUN_DIR_BYTES},nr_inodes={RUN_DIR_INODES},mode=0755");
    let flags = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    mount_fs("tmpfs", target, flags, Some(&data))
}

pub fn unmount(target: &Path) -> Result<()> {
    if !is_mounted(target) {
        return Ok(());
    }
    let c = cstr(target)?;
    // SAFETY: c is a valid NUL-terminated path.
    let rc = unsafe { libc::umount2(c.as_ptr(), 0) };
    if rc != 0 {
        // Something still holds it (a gofer that has not exited yet): detach lazily so nothing
        // is left mounted once the last user goes away.
        // SAFETY: as above.
        let rc = unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        if rc != 0 {
            return Err(DriverError::Io {
                what: format!("unmounting {}", target.display()),
                source: std::io::Error::last_os_error(),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn private_mount_moves_and_lists_deepest_first() {
        let d = tempfile::tempdir().unwrap();
        let pool = d.path().join("pool");
        let (a, b) = (pool.join("a"), d.path().join("b"));
        for p in [&a, &b] {
            std::fs::create_dir_all(p).unwrap();
        }
        make_private_mount(&pool).unwrap();
        // Idempotent: a second call does not stack a second bind mount.
        make_private_mount(&pool).unwrap();
        mount_fs("tmpfs", &a, 0, None).unwrap();
        std::fs::write(a.join("f"), b"x").unwrap();
        assert_eq!(mounts_under(d.path()), vec![a.clone(), pool.clone()]);
        move_mount(&a, &b).unwrap();
        assert!(b.join("f").exists() && !a.join("f").exists());
        assert_eq!(mounts_under(&pool), vec![pool.clone()]);
        for m in mounts_under(d.path()) {
            unmount(&m).unwrap();
        }
        assert!(mounts_under(d.path()).is_empty());
    }

    #[test]
    fn a_mount_point_is_told_from_the_path_as_the_table_tells_it() {
        let d = tempfile::tempdir().unwrap();
        let (m, inner, file) = (
            d.path().join("m"),
            d.path().join("m/inner"),
            d.path().join("f"),
        );
        std::fs::create_dir_all(&m).unwrap();
        std::fs::write(&file, b"x").unwrap();
        let both = |p: &Path| (mount_root(p), listed_in_mountinfo(p));
        assert_eq!(both(&m), (Some(false), false));
        mount_fs("tmpfs", &m, 0, None).unwrap();
        std::fs::create_dir(&inner).unwrap();
        assert_eq!(
            both(&m),
            (Some(true), true),
            "the kernel reports mount roots here"
        );
        assert!(is_mounted(&m));
        for p in [&inner, &file, &d.path().join("absent"), &file.join("x")] {
            assert_eq!(both(p), (Some(false), false), "{}", p.display());
        }
        unmount(&m).unwrap();
        assert_eq!(both(&m), (Some(false), false));
        assert!(!is_mounted(&m));
    }

    #[test]
    fn mountinfo_unescape() {
        assert_eq!(unescape_mount("/a\\040b"), "/a b");
        assert_eq!(unescape_mount("/plain"), "/plain");
    }
}
