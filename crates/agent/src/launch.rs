//! Starting a command's program without copying the agent: the child shares the agent's memory
//! until it execs (`clone(CLONE_VM | CLONE_VFORK)`, as `posix_spawn` does), so a command does
//! not pay for a fork of the agent's address space and the copy-on-write faults after it —
//! under gVisor about 20 ms of every command on the development host (docs/speed.md).
//!
//! Before its exec the child does what a command needs: its standard streams, its pids cgroup
//! and `RLIMIT_NPROC` ([`crate::limits::join_raw`]), a new session (and the PTY as its
//! controlling terminal), the user's groups and ids, the working directory, default signal
//! dispositions and an empty signal mask. It runs on a stack the parent lent it, in the
//! parent's memory, while the parent's other threads go on: so it only makes system calls —
//! no allocation, no locks, and raw `setgroups`/`setgid`/`setuid` (glibc's wrappers would
//! signal the agent's threads to change theirs too). A failed step sends its errno through a
//! close-on-exec pipe and the child exits 127.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::raw::{c_char, c_int, c_void};

/// Bytes of the stack the child runs on until its exec.
const CHILD_STACK: usize = 64 * 1024;
/// Where a command name without a slash is looked for when its environment has no `PATH`.
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// The user a command runs as.
pub struct Creds {
    pub uid: libc::uid_t,
    pub gid: libc::gid_t,
    pub groups: Vec<libc::gid_t>,
}

/// A program to start.
pub struct Launch<'a> {
    /// As the request names it: a path, or a name looked up in the environment's `PATH`.
    pub program: &'a str,
    pub args: &'a [String],
    /// The whole environment of the program, each name once.
    pub env: &'a [(String, String)],
    /// The child's stdin, stdout and stderr.
    pub stdio: [RawFd; 3],
    /// `cgroup.procs` of the command's pids cgroup, joined before the exec.
    pub cgroup_procs: Option<RawFd>,
    /// Stdin is a PTY that becomes the controlling terminal of the new session.
    pub pty: bool,
    /// Switch to this user (the agent runs as root); `None` keeps the agent's ids.
    pub creds: Option<&'a Creds>,
    pub cwd: &'a str,
}

/// What the child reads: everything prepared by the parent, pointers into its memory.
struct ChildArgs {
    program: *const c_char,
    argv: *const *const c_char,
    envp: *const *const c_char,
    stdio: [c_int; 3],
    cgroup_procs: c_int,
    pty: bool,
    switch: bool,
    uid: libc::uid_t,
    gid: libc::gid_t,
    groups: *const libc::gid_t,
    ngroups: usize,
    cwd: *const c_char,
    err_fd: c_int,
}

fn cstring(what: &str, s: &str) -> io::Result<CString> {
    CString::new(s).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{what} contains a NUL byte"),
        )
    })
}

/// The file `program` names: itself when it has a slash, else the first executable
/// `dir/program` over `path` (the program's own `PATH`, as `execvp` in the child would).
fn resolve(program: &str, path: Option<&str>) -> io::Result<CString> {
    if program.is_empty() {
        return Err(io::Error::from_raw_os_error(libc::ENOENT));
    }
    if program.contains('/') {
        return cstring("the program", program);
    }
    for dir in path.unwrap_or(DEFAULT_PATH).split(':') {
        let dir = if dir.is_empty() { "." } else { dir };
        let candidate = cstring("PATH", &format!("{dir}/{program}"))?;
        let is_file = std::fs::metadata(format!("{dir}/{program}")).is_ok_and(|m| m.is_file());
        // SAFETY: access reads a NUL-terminated path.
        if is_file && unsafe { libc::access(candidate.as_ptr(), libc::X_OK) } == 0 {
            return Ok(candidate);
        }
    }
    Err(io::Error::from_raw_os_error(libc::ENOENT))
}

/// Starts `l`'s program; its pid once it has exec'd (an exec that failed is its error).
pub fn launch(l: &Launch) -> io::Result<u32> {
    let path = l
        .env
        .iter()
        .rev()
        .find(|(k, _)| k == "PATH")
        .map(|(_, v)| v.as_str());
    let program = resolve(l.program, path)?;
    let argv: Vec<CString> = std::iter::once(l.program)
        .chain(l.args.iter().map(String::as_str))
        .map(|a| cstring("an argument", a))
        .collect::<io::Result<_>>()?;
    let envp: Vec<CString> = l
        .env
        .iter()
        .map(|(k, v)| cstring("an environment variable", &format!("{k}={v}")))
        .collect::<io::Result<_>>()?;
    let cwd = cstring("cwd", l.cwd)?;
    let ptrs = |v: &[CString]| -> Vec<*const c_char> {
        v.iter()
            .map(|c| c.as_ptr())
            .chain(std::iter::once(std::ptr::null()))
            .collect()
    };
    let (argv_p, envp_p) = (ptrs(&argv), ptrs(&envp));
    // Sources of the child's stdio above 2, so that no dup2 onto 0..2 overwrites another.
    let mut lifted = Vec::new();
    let mut stdio = l.stdio;
    for fd in stdio.iter_mut() {
        if *fd < 3 {
            // SAFETY: F_DUPFD_CLOEXEC duplicates a descriptor the caller holds open.
            let d = unsafe { libc::fcntl(*fd, libc::F_DUPFD_CLOEXEC, 3) };
            if d < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: `d` was just created and is owned by nobody else.
            lifted.push(unsafe { OwnedFd::from_raw_fd(d) });
            *fd = d;
        }
    }
    let (err_r, err_w) = cloexec_pipe()?;
    let args = ChildArgs {
        program: program.as_ptr(),
        argv: argv_p.as_ptr(),
        envp: envp_p.as_ptr(),
        stdio,
        cgroup_procs: l.cgroup_procs.unwrap_or(-1),
        pty: l.pty,
        switch: l.creds.is_some(),
        uid: l.creds.map_or(0, |c| c.uid),
        gid: l.creds.map_or(0, |c| c.gid),
        groups: l.creds.map_or(std::ptr::null(), |c| c.groups.as_ptr()),
        ngroups: l.creds.map_or(0, |c| c.groups.len()),
        cwd: cwd.as_ptr(),
        err_fd: err_w.as_raw_fd(),
    };
    let mut stack = vec![0u8; CHILD_STACK];
    // The stack grows down from its (16-byte aligned) end.
    let top = (stack.as_mut_ptr() as usize + CHILD_STACK) & !15;

    // SAFETY: sigfillset/pthread_sigmask on valid sigset_t values of this frame; clone runs
    // `child` on `stack`, which outlives it (CLONE_VFORK: this thread waits until the child
    // has exec'd or exited), with `args` and everything it points to alive in this frame.
    let pid = unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        // No handler of the agent's may run in the child while it shares the agent's memory.
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
        let pid = libc::clone(
            child,
            top as *mut c_void,
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            &args as *const ChildArgs as *mut c_void,
        );
        let e = io::Error::last_os_error();
        libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
        if pid < 0 {
            return Err(e);
        }
        pid
    };
    drop(err_w);
    drop(stack);
    drop(lifted);
    let mut errno = [0u8; 4];
    let n = loop {
        // SAFETY: reading at most 4 bytes into a 4-byte buffer from a descriptor we own.
        let n = unsafe { libc::read(err_r.as_raw_fd(), errno.as_mut_ptr().cast(), 4) };
        if n >= 0 || io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            break n;
        }
    };
    if n == 4 {
        // The child exited 127; the reaper collects it as an unregistered child.
        return Err(io::Error::from_raw_os_error(i32::from_ne_bytes(errno)));
    }
    Ok(pid as u32)
}

fn cloexec_pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two fds into the array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both fds were just created and are owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// The child: each step, then the exec; on a failure its errno to the parent and exit 127.
extern "C" fn child(arg: *mut c_void) -> c_int {
    // SAFETY: `arg` is the parent's `ChildArgs`, alive until this child execs or exits.
    let a = unsafe { &*(arg as *const ChildArgs) };
    // SAFETY: see `steps`; write and _exit are async-signal-safe.
    unsafe {
        let errno = steps(a);
        let bytes = errno.to_ne_bytes();
        libc::write(a.err_fd, bytes.as_ptr().cast(), bytes.len());
        libc::_exit(127)
    }
}

/// The child's steps up to its exec; returns the errno of the one that failed.
///
/// # Safety
/// Only in the child of [`launch`]'s clone: it changes the calling process's descriptors,
/// session, ids, directory and signal state, and reads `a`'s pointers.
unsafe fn steps(a: &ChildArgs) -> c_int {
    let errno = || {
        io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO)
    };
    for (target, &fd) in (0..).zip(a.stdio.iter()) {
        if libc::dup2(fd, target) < 0 {
            return errno();
        }
    }
    if a.cgroup_procs >= 0 && crate::limits::join_raw(a.cgroup_procs).is_err() {
        return errno();
    }
    if libc::setsid() < 0 {
        return errno();
    }
    if a.pty && libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
        return errno();
    }
    if a.switch
        && (libc::syscall(libc::SYS_setgroups, a.ngroups, a.groups) < 0
            || libc::syscall(libc::SYS_setgid, a.gid) < 0
            || libc::syscall(libc::SYS_setuid, a.uid) < 0)
    {
        return errno();
    }
    if libc::chdir(a.cwd) < 0 {
        return errno();
    }
    // Handlers of the agent's become defaults before signals are let in (exec would reset
    // them, but not before it); SIGPIPE, which the agent ignores, too.
    for sig in 1..=64 {
        if sig == libc::SIGKILL || sig == libc::SIGSTOP {
            continue;
        }
        let mut old: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(sig, std::ptr::null(), &mut old) == 0
            && (old.sa_sigaction != libc::SIG_DFL && old.sa_sigaction != libc::SIG_IGN
                || sig == libc::SIGPIPE)
        {
            let mut dfl: libc::sigaction = std::mem::zeroed();
            dfl.sa_sigaction = libc::SIG_DFL;
            libc::sigaction(sig, &dfl, std::ptr::null_mut());
        }
    }
    let mut none: libc::sigset_t = std::mem::zeroed();
    libc::sigemptyset(&mut none);
    libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
    libc::execve(a.program, a.argv, a.envp);
    errno()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_looked_up_in_the_programs_own_path() {
        let dir = tempfile::tempdir().unwrap();
        let exe = dir.path().join("tool");
        std::fs::write(&exe, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&exe, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let path = format!("/nonexistent:{}", dir.path().display());
        assert_eq!(
            resolve("tool", Some(&path)).unwrap().to_str().unwrap(),
            exe.to_str().unwrap()
        );
        assert_eq!(resolve("/x/y", None).unwrap().to_str().unwrap(), "/x/y");
        for missing in ["", "no-such-tool-kiln"] {
            let e = resolve(missing, Some(&path)).unwrap_err();
            assert_eq!(e.raw_os_error(), Some(libc::ENOENT), "{missing:?}");
        }
    }

    fn wait(pid: u32) -> i32 {
        let mut status = 0;
        // SAFETY: waitpid on our own child with a valid status pointer.
        let waited = unsafe { libc::waitpid(pid as i32, &mut status, 0) };
        assert_eq!(waited, pid as i32);
        libc::WEXITSTATUS(status)
    }

    /// The program runs with exactly the environment, directory, user and streams asked for.
    #[test]
    fn the_child_gets_its_streams_directory_user_and_environment() {
        let (r, w) = cloexec_pipe().unwrap();
        let null = std::fs::File::open("/dev/null").unwrap();
        // SAFETY: geteuid has no preconditions.
        let euid = unsafe { libc::geteuid() };
        let root = euid == 0;
        let creds = Creds {
            uid: 65534,
            gid: 65534,
            groups: vec![65534],
        };
        let env = vec![
            ("PATH".to_string(), "/usr/bin:/bin".to_string()),
            ("K".to_string(), "v w".to_string()),
        ];
        let args = [
            "-c".to_string(),
            "id -u; pwd; echo \"$K\"; env | wc -l".to_string(),
        ];
        let pid = launch(&Launch {
            program: "sh",
            args: &args,
            env: &env,
            stdio: [null.as_raw_fd(), w.as_raw_fd(), w.as_raw_fd()],
            cgroup_procs: None,
            pty: false,
            creds: root.then_some(&creds),
            cwd: "/",
        })
        .unwrap();
        drop(w);
        assert_eq!(wait(pid), 0);
        let mut out = String::new();
        std::io::Read::read_to_string(&mut std::fs::File::from(r), &mut out).unwrap();
        let lines: Vec<&str> = out.lines().collect();
        let uid = if root { 65534 } else { euid }.to_string();
        // PWD, SHLVL and _ are the shell's own.
        assert_eq!(lines[..3], [uid.as_str(), "/", "v w"], "{out}");
        assert!(lines[3].trim().parse::<u32>().unwrap() <= 5, "{out}");
    }

    #[test]
    fn an_exec_that_fails_is_the_launchs_error() {
        let null = std::fs::File::open("/dev/null").unwrap();
        let fd = null.as_raw_fd();
        let base = Launch {
            program: "/nonexistent/kiln-tool",
            args: &[],
            env: &[],
            stdio: [fd, fd, fd],
            cgroup_procs: None,
            pty: false,
            creds: None,
            cwd: "/",
        };
        let e = launch(&base).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOENT));
        let e = launch(&Launch {
            program: "/bin/true",
            cwd: "/nonexistent-dir",
            ..base
        })
        .unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOENT));
    }
}
