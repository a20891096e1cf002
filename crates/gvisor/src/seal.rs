//! Sealing `run/`, the host directory a sandbox sees at `/run/kiln`.
//!
//! The directory must be writable while runsc's gofer creates the agent's socket in it
//! (`--host-uds=create`: at boot and again after every restore) and while the agent writes its
//! detach marker before a checkpoint. Outside those windows it is *sealed*: everything but the
//! socket the agent made there through runsc (`agent.sock`) is
//! removed (without following anything, relative to a directory fd
//! opened `O_NOFOLLOW | O_DIRECTORY`) and the directory gets the immutable flag
//! (`FS_IOC_SETFLAGS` `FS_IMMUTABLE_FL`, which tmpfs takes since Linux 6.0). An immutable
//! directory refuses every create, link, rename and unlink, to root too, on the host, so the
//! sandbox (whose gofer and sentry lack `CAP_LINUX_IMMUTABLE`) can neither add anything nor
//! remove or replace the socket. Only the server lifts it, for its own windows (see
//! [`Seals`]).
//!
//! Where the flag cannot be set (an older kernel, no `CAP_LINUX_IMMUTABLE`), the directory
//! stays as before: a 64 KiB, 32-inode tmpfs that the server never follows links in, and the
//! server says so once ([`fallback_reason`]).

use std::collections::HashMap;
use std::ffi::OsStr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use nix::fcntl::OFlag;
use nix::sys::stat::Mode;
use nix::unistd::UnlinkatFlags;

/// `FS_IMMUTABLE_FL` of `<linux/fs.h>` (the libc crate has the ioctls but not the flag).
const FS_IMMUTABLE_FL: libc::c_int = 0x10;

/// How deep a planted directory tree is removed (the tmpfs holds 32 inodes at most).
const MAX_DEPTH: usize = 40;

/// How many times a seal cleans and checks again when something appeared meanwhile.
const SEAL_ATTEMPTS: usize = 4;

/// Why the immutable flag cannot be used on this host, for an `FS_IOC_SETFLAGS` that failed
/// with `errno`; None when the error is not about support (a real failure to report).
pub fn fallback_reason(errno: i32) -> Option<&'static str> {
    match errno {
        libc::ENOTTY | libc::EOPNOTSUPP | libc::EINVAL | libc::ENOSYS => {
            Some("the kernel's tmpfs does not take the immutable flag (Linux 6.0 or newer does)")
        }
        libc::EPERM | libc::EACCES => {
            Some("kiln lacks CAP_LINUX_IMMUTABLE (run kiln serve as root on the host)")
        }
        _ => None,
    }
}

fn open_dir_at(parent: Option<&OwnedFd>, name: &Path) -> nix::Result<OwnedFd> {
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let fd = nix::fcntl::openat(parent.map(|p| p.as_raw_fd()), name, flags, Mode::empty())?;
    // SAFETY: openat returned a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn get_flags(dir: &OwnedFd) -> std::io::Result<libc::c_int> {
    let mut flags: libc::c_int = 0;
    // SAFETY: FS_IOC_GETFLAGS writes one int (the kernel's size for it, whatever the ioctl
    // number says) through a pointer to a live local; the descriptor is open.
    let rc = unsafe { libc::ioctl(dir.as_raw_fd(), libc::FS_IOC_GETFLAGS, &mut flags) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(flags)
}

fn set_flags(dir: &OwnedFd, flags: libc::c_int) -> std::io::Result<()> {
    // SAFETY: FS_IOC_SETFLAGS reads one int through a pointer to a live local; the descriptor
    // is open.
    let rc = unsafe { libc::ioctl(dir.as_raw_fd(), libc::FS_IOC_SETFLAGS, &flags) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Sets or clears the immutable flag of the directory open as `dir`.
fn set_immutable(dir: &OwnedFd, on: bool) -> std::io::Result<()> {
    let flags = get_flags(dir)?;
    let want = match on {
        true => flags | FS_IMMUTABLE_FL,
        false => flags & !FS_IMMUTABLE_FL,
    };
    if want == flags {
        return Ok(());
    }
    set_flags(dir, want)
}

/// An entry of a directory: its name and type (never followed).
struct Entry {
    name: std::ffi::OsString,
    kind: Kind,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Dir,
    Socket,
    Other,
}

fn entries(dir: &OwnedFd) -> nix::Result<Vec<Entry>> {
    use nix::dir::Type;
    // From the start (the descriptor is listed more than once); Dir takes a duplicate of its
    // own, which shares the offset.
    // SAFETY: lseek on an open descriptor with constant arguments.
    unsafe { libc::lseek(dir.as_raw_fd(), 0, libc::SEEK_SET) };
    let dup = nix::unistd::dup(dir.as_raw_fd())?;
    let mut d = nix::dir::Dir::from_fd(dup)?;
    let mut out = Vec::new();
    for e in d.iter() {
        let e = e?;
        let name = OsStr::from_bytes(e.file_name().to_bytes());
        if name == "." || name == ".." {
            continue;
        }
        let ty = match e.file_type() {
            Some(t) => Some(t),
            None => {
                let st = nix::sys::stat::fstatat(
                    Some(dir.as_raw_fd()),
                    name,
                    nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
                )?;
                match st.st_mode & libc::S_IFMT {
                    libc::S_IFDIR => Some(Type::Directory),
                    libc::S_IFSOCK => Some(Type::Socket),
                    _ => None,
                }
            }
        };
        let kind = match ty {
            Some(Type::Directory) => Kind::Dir,
            Some(Type::Socket) => Kind::Socket,
            _ => Kind::Other,
        };
        out.push(Entry {
            name: name.to_owned(),
            kind,
        });
    }
    Ok(out)
}

/// Removes `name` from the directory open as `parent`, a directory with all it holds;
/// nothing is followed.
fn remove_at(parent: &OwnedFd, e: &Entry, depth: usize) -> nix::Result<()> {
    let name = Path::new(&e.name);
    if e.kind == Kind::Dir {
        if depth >= MAX_DEPTH {
            return Err(nix::errno::Errno::ELOOP);
        }
        let child = open_dir_at(Some(parent), name)?;
        // A planted directory the sandbox made immutable itself (if it could).
        let _ = set_immutable(&child, false);
        for sub in entries(&child)? {
            remove_at(&child, &sub, depth + 1)?;
        }
        return nix::unistd::unlinkat(Some(parent.as_raw_fd()), name, UnlinkatFlags::RemoveDir);
    }
    nix::unistd::unlinkat(Some(parent.as_raw_fd()), name, UnlinkatFlags::NoRemoveDir)
}

/// Whether `e` is one of the sockets named in `keep`.
fn kept(e: &Entry, keep: &[&str]) -> bool {
    e.kind == Kind::Socket && keep.iter().any(|k| e.name == *k)
}

/// Removes everything in the directory open as `dir` except the sockets named in `keep`;
/// returns how many entries went.
fn clean(dir: &OwnedFd, keep: &[&str]) -> nix::Result<usize> {
    let mut removed = 0;
    for e in entries(dir)? {
        if kept(&e, keep) {
            continue;
        }
        match remove_at(dir, &e, 0) {
            Ok(()) => removed += 1,
            // Gone meanwhile.
            Err(nix::errno::Errno::ENOENT) => {}
            Err(err) => return Err(err),
        }
    }
    Ok(removed)
}

/// Whether the directory open as `dir` holds only sockets named in `keep` (or nothing).
fn holds_only(dir: &OwnedFd, keep: &[&str]) -> nix::Result<bool> {
    Ok(entries(dir)?.iter().all(|e| kept(e, keep)))
}

/// What sealing did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sealed {
    /// The directory is immutable and holds only the sockets kept; `removed` entries went
    /// first.
    Immutable { removed: usize },
    /// The flag cannot be set here (see [`fallback_reason`]): cleaned only.
    Bounded { removed: usize },
}

/// Errors of sealing and unsealing (they name the directory: for the server's log only).
#[derive(Debug, thiserror::Error)]
pub enum SealError {
    #[error("opening {dir} without following links: {source}")]
    Open { dir: String, source: nix::Error },
    #[error("removing what the sandbox left in {dir}: {source}")]
    Clean { dir: String, source: nix::Error },
    #[error("setting the immutable flag of {dir}: {source}")]
    Flag { dir: String, source: std::io::Error },
    #[error("{dir} kept changing while it was being sealed")]
    Busy { dir: String },
}

/// Removes everything but the sockets named in `keep` from `dir` and makes it immutable; an immutable
/// directory that holds only those is left as it is. `immutable: false` (a host that
/// cannot, see [`fallback_reason`]) only cleans.
pub fn seal(dir: &Path, keep: &[&str], immutable: bool) -> Result<Sealed, SealError> {
    let name = || dir.display().to_string();
    let fd = open_dir_at(None, dir).map_err(|source| SealError::Open {
        dir: name(),
        source,
    })?;
    let cleaned = |fd: &OwnedFd| {
        clean(fd, keep).map_err(|source| SealError::Clean {
            dir: name(),
            source,
        })
    };
    if !immutable {
        return Ok(Sealed::Bounded {
            removed: cleaned(&fd)?,
        });
    }
    let flag = |source: std::io::Error| SealError::Flag {
        dir: name(),
        source,
    };
    let only = |fd: &OwnedFd| {
        holds_only(fd, keep).map_err(|source| SealError::Clean {
            dir: name(),
            source,
        })
    };
    let mut removed = 0;
    for _ in 0..SEAL_ATTEMPTS {
        let flags = get_flags(&fd).map_err(flag)?;
        if flags & FS_IMMUTABLE_FL != 0 {
            if only(&fd)? {
                return Ok(Sealed::Immutable { removed });
            }
            set_flags(&fd, flags & !FS_IMMUTABLE_FL).map_err(flag)?;
        }
        removed += cleaned(&fd)?;
        set_flags(&fd, flags | FS_IMMUTABLE_FL).map_err(flag)?;
        // Whatever was made between the cleaning and the flag is found here, and the loop
        // lifts the flag once more to remove it.
        if only(&fd)? {
            return Ok(Sealed::Immutable { removed });
        }
    }
    Err(SealError::Busy { dir: name() })
}

/// Lifts the immutable flag of `dir` (nothing when it has none, or cannot have one).
pub fn unseal(dir: &Path) -> Result<(), SealError> {
    let name = || dir.display().to_string();
    let fd = open_dir_at(None, dir).map_err(|source| SealError::Open {
        dir: name(),
        source,
    })?;
    match set_immutable(&fd, false) {
        Ok(()) => Ok(()),
        Err(e) if e.raw_os_error().and_then(fallback_reason).is_some() => Ok(()),
        Err(source) => Err(SealError::Flag {
            dir: name(),
            source,
        }),
    }
}

/// Where a sandbox's directory stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Sealed (or cleaned, on a host that cannot seal).
    Sealed,
    /// Open for one of the server's windows (a detach, a restore and attach): a connection
    /// does not seal it; the end of the window does.
    Open,
}

/// The seal state of every sandbox's shared directory, kept by the driver. A sandbox it knows
/// nothing about (just booted, or adopted after a server restart) is sealed after its first
/// connection ([`Seals::after_connect`]); the server's windows are [`Seals::open`] …
/// [`Seals::close`].
#[derive(Default)]
pub struct Seals {
    state: Mutex<HashMap<String, State>>,
    /// Set once sealing turned out to be impossible here (warned once).
    bounded: AtomicBool,
}

impl Seals {
    /// Seals `dir` of sandbox `id` under the lock; returns the new state to record.
    fn seal_now(&self, id: &str, dir: &Path, keep: &[&str]) -> State {
        let immutable = !self.bounded.load(Ordering::Relaxed);
        match seal(dir, keep, immutable) {
            Ok(Sealed::Immutable { removed }) | Ok(Sealed::Bounded { removed }) => {
                if removed > 0 {
                    tracing::info!(
                        sandbox = id,
                        removed,
                        "removed what the sandbox put in /run/kiln"
                    );
                }
            }
            Err(SealError::Flag { source, .. })
                if source.raw_os_error().and_then(fallback_reason).is_some() =>
            {
                let reason = source.raw_os_error().and_then(fallback_reason);
                if !self.bounded.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        reason = reason.unwrap_or_default(),
                        "the directory shared with sandboxes at /run/kiln cannot be sealed \
                         here: it stays a bounded 64 KiB tmpfs that root in a sandbox can write"
                    );
                }
                let _ = seal(dir, keep, false);
            }
            Err(e) => tracing::warn!(sandbox = id, error = %e, "sealing /run/kiln"),
        }
        State::Sealed
    }

    /// After a connection to sandbox `id`'s agent through its socket in `dir`: seals
    /// the directory the first time (a boot, an adoption), unless a window is open. The usual
    /// case is one lock and one lookup.
    pub fn after_connect(&self, id: &str, dir: &Path, keep: &[&str]) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if state.contains_key(id) {
            return;
        }
        let s = self.seal_now(id, dir, keep);
        state.insert(id.to_string(), s);
    }

    /// Opens `dir` of sandbox `id` for one of the server's windows: connections do not seal
    /// it until [`Self::close`].
    pub fn open(&self, id: &str, dir: &Path) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = unseal(dir) {
            tracing::warn!(sandbox = id, error = %e, "unsealing /run/kiln");
        }
        state.insert(id.to_string(), State::Open);
    }

    /// Ends a window: the agent's socket is back, the directory is sealed again.
    pub fn close(&self, id: &str, dir: &Path, keep: &[&str]) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let s = self.seal_now(id, dir, keep);
        state.insert(id.to_string(), s);
    }

    /// Forgets sandbox `id` (it boots afresh, and its first connection seals it again; or
    /// it is being removed) and lifts the flag so its directory can go.
    pub fn forget(&self, id: &str, dir: &Path) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if dir.exists() {
            if let Err(e) = unseal(dir) {
                tracing::warn!(sandbox = id, error = %e, "unsealing /run/kiln");
            }
        }
        state.remove(id);
    }
}

#[cfg(test)]
#[path = "seal_tests.rs"]
mod tests;
