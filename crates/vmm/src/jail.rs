//! The jailer, in the manner of Firecracker's: before the VMM opens anything it
//!
//! 1. closes every inherited fd but stdin/stdout/stderr;
//! 2. unshares the mount, pid, network, IPC, UTS and cgroup namespaces and forks, so the VMM is
//!    PID 1 of its own pid namespace (the parent only waits for it and passes its exit status or
//!    fatal signal on, itself unprivileged and under a seccomp filter);
//! 3. builds a root on the per-VM directory: a private tmpfs holding a `/dev/kvm` node owned by the
//!    VMM's uid, a fresh `/proc` of the new pid namespace (process directories only), and bind
//!    mounts (`nosuid,nodev,noexec`; read-only unless writable) of exactly the host paths the VM
//!    needs, at their host paths;
//! 4. `pivot_root`s into it, detaches the old root and makes the new root read-only;
//! 5. drops to the unprivileged uid/gid (no supplementary groups, no capabilities,
//!    `no_new_privs`).
//!
//! The network namespace has only a down loopback device, so the VMM reaches no network; Unix
//! sockets in the bound directories still work (they are file system objects).

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// A host path made visible inside the jail at the same path.
#[derive(Debug, Clone)]
pub struct Bind {
    pub path: PathBuf,
    pub writable: bool,
}

/// What the jail is built from.
#[derive(Debug, Clone)]
pub struct JailConfig {
    /// Per-VM directory the root is built on (created if missing). A private tmpfs is mounted
    /// on it inside the jail's mount namespace, so the host's copy stays empty.
    pub dir: PathBuf,
    pub uid: u32,
    pub gid: u32,
    /// Host paths the VM needs (kernel, disk images, socket and output directories, ...).
    /// Paths that do not exist are left out: the VMM then reports them missing itself.
    pub binds: Vec<Bind>,
}

#[derive(Debug, thiserror::Error)]
pub enum JailError {
    #[error("the jail needs root (it mounts, creates a /dev/kvm node and changes uid)")]
    NotRoot,
    #[error("jail: {0}")]
    Config(String),
    #[error("jail: {what}: {err}")]
    Sys { what: String, err: io::Error },
}

fn sys(what: impl Into<String>) -> JailError {
    JailError::Sys {
        what: what.into(),
        err: io::Error::last_os_error(),
    }
}

fn check(ret: libc::c_int, what: impl Into<String>) -> Result<(), JailError> {
    if ret < 0 {
        Err(sys(what))
    } else {
        Ok(())
    }
}

fn cpath(p: &Path) -> Result<CString, JailError> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| JailError::Config(format!("path {} contains a NUL byte", p.display())))
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> JailError {
    let what = what.into();
    move |err| JailError::Sys { what, err }
}

/// The binds that exist, absolute, sorted, without those already covered by a bound ancestor.
fn plan_binds(binds: &[Bind]) -> Result<Vec<Bind>, JailError> {
    let mut out: Vec<Bind> = Vec::new();
    let mut all: Vec<Bind> = binds.to_vec();
    for b in &all {
        if !b.path.is_absolute() {
            return Err(JailError::Config(format!(
                "bind path {} is not absolute",
                b.path.display()
            )));
        }
    }
    all.sort_by(|a, b| a.path.cmp(&b.path));
    for b in all {
        if !b.path.exists() {
            continue;
        }
        if let Some(prev) = out.iter_mut().find(|o| b.path.starts_with(&o.path)) {
            prev.writable |= b.writable && prev.path == b.path;
            continue;
        }
        out.push(b);
    }
    Ok(out)
}

/// Enters the jail. Returns in the jailed VMM process only; the supervising parent exits with
/// the VMM's status. Must be called while the process is single-threaded.
pub fn enter(cfg: &JailConfig) -> Result<(), JailError> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err(JailError::NotRoot);
    }
    if cfg.uid == 0 || cfg.gid == 0 {
        return Err(JailError::Config(
            "the jail uid and gid must not be 0".into(),
        ));
    }
    if !cfg.dir.is_absolute() {
        return Err(JailError::Config(
            "the jail directory must be absolute".into(),
        ));
    }
    std::fs::create_dir_all(&cfg.dir).map_err(io_err("creating the jail directory"))?;
    let binds = plan_binds(&cfg.binds)?;
    if binds
        .iter()
        .any(|b| cfg.dir.starts_with(&b.path) || b.path.starts_with(&cfg.dir))
    {
        return Err(JailError::Config(
            "the jail directory and the bound paths must not contain each other".into(),
        ));
    }
    let kvm_rdev = {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata("/dev/kvm")
            .map_err(io_err("/dev/kvm"))?
            .rdev()
    };
    // SAFETY: closes fds this code does not own; the process is single-threaded and nothing in
    // it has opened fds yet besides stdio (0..=2, kept).
    let r = unsafe { libc::close_range(3, u32::MAX, 0) };
    check(r, "closing inherited fds")?;
    let flags = libc::CLONE_NEWNS
        | libc::CLONE_NEWPID
        | libc::CLONE_NEWNET
        | libc::CLONE_NEWIPC
        | libc::CLONE_NEWUTS
        | libc::CLONE_NEWCGROUP;
    // SAFETY: unshare only changes this process's namespaces.
    check(unsafe { libc::unshare(flags) }, "unshare")?;
    // The VMM waits on this pipe until the supervisor has filtered itself: by the time the VMM
    // runs anything, no process of the jail is unfiltered.
    let mut ready = [0 as libc::c_int; 2];
    // SAFETY: `ready` is a valid array of two fds for pipe2 to fill.
    let r = unsafe { libc::pipe2(ready.as_mut_ptr(), libc::O_CLOEXEC) };
    check(r, "pipe2")?;
    let supervisor_filter =
        crate::seccomp::supervisor_filter(ready[1]).map_err(JailError::Config)?;
    // SAFETY: the process is single-threaded (documented precondition), so the child may run
    // arbitrary code.
    let child = unsafe { libc::fork() };
    if child < 0 {
        return Err(sys("fork"));
    }
    if child > 0 {
        // SAFETY: closes the read end, which only the VMM uses.
        unsafe { libc::close(ready[0]) };
        supervise(child, cfg.uid, cfg.gid, &supervisor_filter, ready[1]);
    }
    // SAFETY: closes the write end, which only the supervisor uses.
    unsafe { libc::close(ready[1]) };
    let mut byte = 0u8;
    let n = loop {
        // SAFETY: reads at most one byte into `byte`, a valid buffer of one byte.
        let n = unsafe { libc::read(ready[0], (&mut byte as *mut u8).cast(), 1) };
        if n >= 0 || io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            break n;
        }
    };
    // SAFETY: closes an fd this function opened.
    unsafe { libc::close(ready[0]) };
    if n != 1 {
        return Err(JailError::Config(
            "the jail's supervisor could not drop privileges or filter itself".into(),
        ));
    }
    // SAFETY: prctl(PR_SET_PDEATHSIG) only sets this process's parent-death signal.
    let r = unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) };
    check(r, "PR_SET_PDEATHSIG")?;
    build_root(&cfg.dir, kvm_rdev, cfg.uid, cfg.gid, &binds)?;
    pivot(&cfg.dir)?;
    drop_privileges(cfg.uid, cfg.gid)?;
    Ok(())
}

/// The parent: drops privileges, filters itself, waits for the VMM and mirrors how it ended.
fn supervise(
    child: libc::pid_t,
    uid: u32,
    gid: u32,
    filter: &seccompiler::BpfProgram,
    ready: libc::c_int,
) -> ! {
    let ok = drop_privileges(uid, gid).is_ok() && seccompiler::apply_filter(filter).is_ok();
    if !ok {
        // SAFETY: kill/_exit have no memory-safety preconditions.
        unsafe {
            libc::kill(child, libc::SIGKILL);
            libc::_exit(1)
        }
    }
    // SAFETY: writes one byte from a valid buffer to the pipe this process owns, then closes it.
    unsafe {
        libc::write(ready, [1u8].as_ptr().cast(), 1);
        libc::close(ready);
    }
    let mut status = 0;
    loop {
        // SAFETY: status is a valid out pointer.
        let r = unsafe { libc::waitpid(child, &mut status, 0) };
        if r == child {
            break;
        }
        if r < 0 && io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            // SAFETY: _exit has no preconditions.
            unsafe { libc::_exit(1) }
        }
    }
    if libc::WIFSIGNALED(status) {
        let sig = libc::WTERMSIG(status);
        // SAFETY: signals this process itself; the default action of a fatal signal ends it.
        unsafe { libc::kill(libc::getpid(), sig) };
        // SAFETY: _exit has no preconditions.
        unsafe { libc::_exit(128 + sig) }
    }
    // SAFETY: _exit has no preconditions.
    unsafe { libc::_exit(libc::WEXITSTATUS(status)) }
}

fn mount(
    src: Option<&Path>,
    target: &Path,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> Result<(), JailError> {
    let src = src.map(cpath).transpose()?;
    let t = cpath(target)?;
    let fstype = fstype.map(|s| CString::new(s).unwrap_or_default());
    let data = data.map(|s| CString::new(s).unwrap_or_default());
    let p = |c: &Option<CString>| c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
    // SAFETY: every pointer is null or a NUL-terminated string alive for the call.
    let r = unsafe { libc::mount(p(&src), t.as_ptr(), p(&fstype), flags, p(&data).cast()) };
    check(r, format!("mounting {}", target.display()))
}

fn build_root(
    dir: &Path,
    kvm_rdev: u64,
    uid: u32,
    gid: u32,
    binds: &[Bind],
) -> Result<(), JailError> {
    // Nothing mounted from here on propagates back to the host.
    mount(
        None,
        Path::new("/"),
        None,
        libc::MS_REC | libc::MS_PRIVATE,
        None,
    )?;
    mount(
        Some(Path::new("tmpfs")),
        dir,
        Some("tmpfs"),
        libc::MS_NOSUID | libc::MS_NOEXEC,
        Some("mode=0755,size=1m,nr_inodes=4096"),
    )?;
    let dev = dir.join("dev");
    std::fs::create_dir(&dev).map_err(io_err("creating /dev in the jail"))?;
    let kvm = cpath(&dev.join("kvm"))?;
    // SAFETY: kvm is a valid NUL-terminated path; mknod only creates that node.
    let r = unsafe { libc::mknod(kvm.as_ptr(), libc::S_IFCHR | 0o600, kvm_rdev) };
    check(r, "creating /dev/kvm in the jail")?;
    // SAFETY: as above; chown only changes that node's owner.
    let r = unsafe { libc::chown(kvm.as_ptr(), uid, gid) };
    check(r, "chown /dev/kvm")?;
    let proc = dir.join("proc");
    std::fs::create_dir(&proc).map_err(io_err("creating /proc in the jail"))?;
    // Only the process directories (no sysctls, kallsyms, ...); kernels before 5.8 lack `subset`.
    let proc_flags = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    let proc_src = Some(Path::new("proc"));
    mount(
        proc_src,
        &proc,
        Some("proc"),
        proc_flags,
        Some("subset=pid"),
    )
    .or_else(|_| mount(proc_src, &proc, Some("proc"), proc_flags, None))?;
    for b in binds {
        let target = dir.join(b.path.strip_prefix("/").unwrap_or(&b.path));
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent).map_err(io_err("creating a bind mount point"))?;
        }
        if b.path.is_dir() {
            std::fs::create_dir_all(&target)
        } else {
            std::fs::File::create(&target).map(drop)
        }
        .map_err(io_err("creating a bind mount point"))?;
        mount(Some(&b.path), &target, None, libc::MS_BIND, None)?;
        let mut flags =
            libc::MS_BIND | libc::MS_REMOUNT | libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
        if !b.writable {
            flags |= libc::MS_RDONLY;
        }
        mount(None, &target, None, flags, None)?;
    }
    Ok(())
}

fn pivot(dir: &Path) -> Result<(), JailError> {
    let d = cpath(dir)?;
    let dot = c".";
    // SAFETY: valid NUL-terminated paths; chdir/pivot_root/umount2 change only this process's
    // (and its mount namespace's) view of the file system.
    unsafe {
        check(libc::chdir(d.as_ptr()), "chdir into the jail")?;
        check(
            libc::syscall(libc::SYS_pivot_root, dot.as_ptr(), dot.as_ptr()) as libc::c_int,
            "pivot_root",
        )?;
        check(
            libc::umount2(dot.as_ptr(), libc::MNT_DETACH),
            "detaching the old root",
        )?;
        check(libc::chdir(c"/".as_ptr()), "chdir /")?;
    }
    mount(
        None,
        Path::new("/"),
        None,
        libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NOEXEC,
        None,
    )
}

fn drop_privileges(uid: u32, gid: u32) -> Result<(), JailError> {
    // SAFETY: plain credential syscalls on this process; setgroups gets an empty list.
    unsafe {
        check(libc::setgroups(0, std::ptr::null()), "setgroups")?;
        check(libc::setresgid(gid, gid, gid), "setresgid")?;
        check(libc::setresuid(uid, uid, uid), "setresuid")?;
        // Changing uid made the process non-dumpable, which hands /proc/self to root; the VMM
        // reads its own pagemap/smaps for snapshots and stats.
        check(libc::prctl(libc::PR_SET_DUMPABLE, 1), "PR_SET_DUMPABLE")?;
        check(
            libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0),
            "no_new_privs",
        )?;
        if libc::setresuid(0, 0, 0) == 0 {
            return Err(JailError::Config(
                "could regain root after dropping it".into(),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_binds_drops_missing_and_covered_paths() {
        let d = tempfile::tempdir().unwrap();
        let sub = d.path().join("sub");
        std::fs::create_dir(&sub).unwrap();
        let b = |p: &Path, w| Bind {
            path: p.to_path_buf(),
            writable: w,
        };
        let plan = plan_binds(&[
            b(&sub, false),
            b(d.path(), true),
            b(&d.path().join("missing"), true),
        ])
        .unwrap();
        assert_eq!(plan.len(), 1);
        assert_eq!(plan[0].path, d.path());
        assert!(plan[0].writable);
        assert!(plan_binds(&[b(Path::new("rel"), true)]).is_err());
    }
}
