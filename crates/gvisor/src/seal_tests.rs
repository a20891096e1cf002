//! Tests of [`super`]: on a real tmpfs like the sandboxes' `run/` (the tests run as root, as
//! the server does).

use super::*;
use std::os::unix::fs::FileTypeExt;

const SOCK: &str = "agent.sock";
const KEEP: &[&str] = &[SOCK, "trace.sock"];

/// A tmpfs mounted on a fresh directory, unmounted (after lifting the flag) when dropped.
struct Tmpfs {
    _base: tempfile::TempDir,
    dir: std::path::PathBuf,
}

impl Tmpfs {
    fn new() -> Self {
        let base = tempfile::tempdir().unwrap();
        let dir = base.path().join("run");
        std::fs::create_dir(&dir).unwrap();
        super::super::mounts::mount_run_dir(&dir).unwrap();
        Self { _base: base, dir }
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = unseal(&self.dir);
        let _ = super::super::mounts::unmount(&self.dir);
    }
}

/// Whether the directory at `dir` has the immutable flag.
fn is_sealed(dir: &Path) -> std::io::Result<bool> {
    let fd = open_dir_at(None, dir)?;
    Ok(get_flags(&fd)? & FS_IMMUTABLE_FL != 0)
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn errno(r: std::io::Result<impl Sized>) -> Option<i32> {
    r.err().and_then(|e| e.raw_os_error())
}

/// What root in a sandbox can plant in the unsealed directory.
fn plant(dir: &Path, outside: &Path) {
    std::fs::write(dir.join("file"), b"x").unwrap();
    std::fs::create_dir_all(dir.join("d/e/f")).unwrap();
    std::fs::write(dir.join("d/e/f/deep"), b"x").unwrap();
    // A link into the directory tree of a planted dir, and one to a host file outside.
    std::os::unix::fs::symlink(outside, dir.join("d/e/out")).unwrap();
    std::os::unix::fs::symlink(outside, dir.join("link")).unwrap();
    std::os::unix::fs::symlink(dir.join("d"), dir.join("dirlink")).unwrap();
    nix::unistd::mkfifo(&dir.join("fifo"), Mode::S_IRWXU).unwrap();
    std::fs::hard_link(dir.join("file"), dir.join("hard")).unwrap();
    let _other = std::os::unix::net::UnixListener::bind(dir.join("other.sock")).unwrap();
}

#[test]
fn seal_removes_all_but_the_socket_and_refuses_everything_after() {
    let t = Tmpfs::new();
    let outside_dir = tempfile::tempdir().unwrap();
    let outside = outside_dir.path().join("host-file");
    std::fs::write(&outside, b"keep me").unwrap();
    let _agent = std::os::unix::net::UnixListener::bind(t.dir.join(SOCK)).unwrap();
    // The server's own syscall-trace sink stays too.
    let _sink = std::os::unix::net::UnixListener::bind(t.dir.join(KEEP[1])).unwrap();
    plant(&t.dir, &outside);
    assert_eq!(
        seal(&t.dir, KEEP, true).unwrap(),
        Sealed::Immutable { removed: 7 }
    );
    assert_eq!(names(&t.dir), KEEP);
    assert!(is_sealed(&t.dir).unwrap());
    // Nothing planted was followed.
    assert_eq!(std::fs::read(&outside).unwrap(), b"keep me");
    // Nothing new, nothing removed or renamed, even by root.
    let d = &t.dir;
    assert_eq!(errno(std::fs::write(d.join("new"), b"")), Some(libc::EPERM));
    assert_eq!(
        errno(std::fs::create_dir(d.join("newdir"))),
        Some(libc::EPERM)
    );
    assert_eq!(
        errno(std::os::unix::fs::symlink("/", d.join("l"))),
        Some(libc::EPERM)
    );
    assert_eq!(
        nix::unistd::mkfifo(&d.join("p"), Mode::S_IRWXU).err(),
        Some(nix::errno::Errno::EPERM)
    );
    assert_eq!(
        errno(std::os::unix::net::UnixListener::bind(d.join("s"))),
        Some(libc::EPERM)
    );
    assert_eq!(errno(std::fs::remove_file(d.join(SOCK))), Some(libc::EPERM));
    assert_eq!(
        errno(std::fs::rename(d.join(SOCK), d.join("x"))),
        Some(libc::EPERM)
    );
    // The socket still takes connections.
    std::os::unix::net::UnixStream::connect(d.join(SOCK)).unwrap();
    // Sealing again is a no-op; unsealing lets the server (and the agent) write again.
    assert_eq!(
        seal(&t.dir, KEEP, true).unwrap(),
        Sealed::Immutable { removed: 0 }
    );
    unseal(&t.dir).unwrap();
    assert!(!is_sealed(&t.dir).unwrap());
    std::fs::write(d.join("marker"), b"").unwrap();
    std::fs::remove_file(d.join(SOCK)).unwrap();
}

#[test]
fn a_link_or_file_in_place_of_the_socket_goes_too() {
    let t = Tmpfs::new();
    let outside_dir = tempfile::tempdir().unwrap();
    let bait = outside_dir.path().join("bait.sock");
    let _bait = std::os::unix::net::UnixListener::bind(&bait).unwrap();
    std::os::unix::fs::symlink(&bait, t.dir.join(SOCK)).unwrap();
    assert_eq!(
        seal(&t.dir, KEEP, true).unwrap(),
        Sealed::Immutable { removed: 1 }
    );
    assert!(names(&t.dir).is_empty());
    assert!(std::fs::symlink_metadata(&bait)
        .unwrap()
        .file_type()
        .is_socket());
    unseal(&t.dir).unwrap();
    std::fs::create_dir(t.dir.join(SOCK)).unwrap();
    std::fs::write(t.dir.join(SOCK).join("x"), b"").unwrap();
    seal(&t.dir, KEEP, true).unwrap();
    assert!(names(&t.dir).is_empty());
}

#[test]
fn a_sealed_dir_with_something_in_it_is_cleaned_again() {
    let t = Tmpfs::new();
    let _agent = std::os::unix::net::UnixListener::bind(t.dir.join(SOCK)).unwrap();
    std::fs::write(t.dir.join("late"), b"").unwrap();
    // Immutable with an extra entry (as if it appeared just before the flag).
    let fd = open_dir_at(None, &t.dir).unwrap();
    set_immutable(&fd, true).unwrap();
    assert_eq!(
        seal(&t.dir, KEEP, true).unwrap(),
        Sealed::Immutable { removed: 1 }
    );
    assert_eq!(names(&t.dir), [SOCK]);
}

#[test]
fn bounded_mode_cleans_without_the_flag() {
    let t = Tmpfs::new();
    let _agent = std::os::unix::net::UnixListener::bind(t.dir.join(SOCK)).unwrap();
    std::fs::write(t.dir.join("x"), b"").unwrap();
    assert_eq!(
        seal(&t.dir, KEEP, false).unwrap(),
        Sealed::Bounded { removed: 1 }
    );
    assert!(!is_sealed(&t.dir).unwrap());
    std::fs::write(t.dir.join("y"), b"").unwrap();
}

#[test]
fn fallback_decision() {
    // No support for the flag, or no right to set it: the bounded directory, with a reason.
    for e in [libc::ENOTTY, libc::EOPNOTSUPP, libc::EINVAL, libc::ENOSYS] {
        assert!(fallback_reason(e).unwrap().contains("Linux 6.0"), "{e}");
    }
    for e in [libc::EPERM, libc::EACCES] {
        assert!(
            fallback_reason(e).unwrap().contains("CAP_LINUX_IMMUTABLE"),
            "{e}"
        );
    }
    // Anything else is a failure to report, not a reason to stop sealing.
    for e in [libc::EIO, libc::ENOENT, libc::EBADF, libc::ENOSPC] {
        assert_eq!(fallback_reason(e), None, "{e}");
    }
}

#[test]
fn seals_follow_the_servers_windows() {
    let t = Tmpfs::new();
    let seals = Seals::default();
    let _agent = std::os::unix::net::UnixListener::bind(t.dir.join(SOCK)).unwrap();
    std::fs::write(t.dir.join("planted"), b"").unwrap();
    // First connection (a boot, an adoption): sealed.
    seals.after_connect("s1", &t.dir, KEEP);
    assert!(is_sealed(&t.dir).unwrap());
    assert_eq!(names(&t.dir), [SOCK]);
    // A window: open until closed, whatever connects meanwhile.
    seals.open("s1", &t.dir);
    assert!(!is_sealed(&t.dir).unwrap());
    seals.after_connect("s1", &t.dir, KEEP);
    assert!(!is_sealed(&t.dir).unwrap());
    std::fs::write(t.dir.join("agent.sock.detached"), b"").unwrap();
    seals.close("s1", &t.dir, KEEP);
    assert!(is_sealed(&t.dir).unwrap());
    assert_eq!(names(&t.dir), [SOCK]);
    // Forgotten (a fresh boot): open, and sealed again on the next connection.
    seals.forget("s1", &t.dir);
    assert!(!is_sealed(&t.dir).unwrap());
    seals.after_connect("s1", &t.dir, KEEP);
    assert!(is_sealed(&t.dir).unwrap());
    assert!(!seals.bounded.load(Ordering::Relaxed));
}

#[test]
fn a_filesystem_without_the_flag_falls_back_to_cleaning() {
    // ramfs takes no FS_IOC_SETFLAGS (ENOTTY), as tmpfs before Linux 6.0.
    let base = tempfile::tempdir().unwrap();
    let dir = base.path().join("run");
    std::fs::create_dir(&dir).unwrap();
    super::super::mounts::mount_fs("ramfs", &dir, 0, None).unwrap();
    let _agent = std::os::unix::net::UnixListener::bind(dir.join(SOCK)).unwrap();
    std::fs::write(dir.join("planted"), b"").unwrap();
    let fd = open_dir_at(None, &dir).unwrap();
    let errno = get_flags(&fd).unwrap_err().raw_os_error().unwrap();
    assert!(fallback_reason(errno).is_some(), "{errno}");
    let seals = Seals::default();
    seals.after_connect("s1", &dir, KEEP);
    assert!(seals.bounded.load(Ordering::Relaxed));
    assert_eq!(names(&dir), [SOCK]);
    // Still writable (bounded, not sealed), and later seals only clean.
    std::fs::write(dir.join("again"), b"").unwrap();
    seals.close("s1", &dir, KEEP);
    assert_eq!(names(&dir), [SOCK]);
    super::super::mounts::unmount(&dir).unwrap();
}
