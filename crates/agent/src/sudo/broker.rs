//! The agent's side of `sudo`: accepts requests from the shim, checks them against sudoers and
//! runs the command as the target user with the caller's stdin/stdout/stderr.

use std::io::IoSliceMut;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use nix::sys::socket::{
    self, sockopt, AddressFamily, ControlMessageOwned, MsgFlags, SockFlag, SockType,
};

use super::policy::{self, Caller, Verdict};
use super::{Msg, Request, MAX_REQUEST, SECURE_PATH, SOCKET_NAME};
use crate::reaper::{self, Exit};
use crate::users::{self, User};

/// Environment variables kept from the caller without `-E` (sudo's `env_keep` defaults).
const ENV_KEEP: &[&str] = &[
    "TERM",
    "COLORTERM",
    "COLORS",
    "DISPLAY",
    "LANG",
    "LANGUAGE",
    "LS_COLORS",
    "TZ",
    "XAUTHORITY",
];

/// Binds the broker's socket and serves it on a thread. Call once, as root, before any user
/// process runs (so nobody else can take the name).
pub fn start() -> std::io::Result<()> {
    let fd = socket::socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    let addr = socket::UnixAddr::new_abstract(SOCKET_NAME)?;
    socket::bind(fd.as_raw_fd(), &addr)?;
    socket::setsockopt(&fd, sockopt::PassCred, &true)?;
    socket::listen(
        &fd,
        socket::Backlog::new(64).unwrap_or(socket::Backlog::MAXCONN),
    )?;
    std::thread::Builder::new()
        .name("sudo-broker".into())
        .spawn(move || loop {
            match socket::accept4(fd.as_raw_fd(), SockFlag::SOCK_CLOEXEC) {
                Ok(c) => {
                    // SAFETY: accept4 returned a new descriptor that we now own.
                    let conn = unsafe { OwnedFd::from_raw_fd(c) };
                    let _ = std::thread::Builder::new()
                        .name("sudo".into())
                        .spawn(move || serve(conn));
                }
                Err(nix::errno::Errno::EINTR) | Err(nix::errno::Errno::ECONNABORTED) => {}
                Err(e) => {
                    tracing::error!("sudo broker: accept failed, stopping: {e}");
                    return;
                }
            }
        })?;
    Ok(())
}

fn send(fd: &OwnedFd, msg: &Msg) {
    if let Ok(b) = serde_json::to_vec(msg) {
        let _ = socket::send(fd.as_raw_fd(), &b, MsgFlags::MSG_NOSIGNAL);
    }
}

/// The caller's identity as the kernel vouches for it: `SCM_CREDENTIALS` sent by the shim
/// (a process can only send its own pid and ids). Not `SO_PEERCRED`: gVisor answers that with
/// the asker's own credentials, which would make every caller root.
struct Cred {
    pid: i32,
    uid: u32,
}

fn serve(conn: OwnedFd) {
    let _ = socket::setsockopt(&conn, sockopt::PassCred, &true);
    let mut buf = vec![0u8; MAX_REQUEST];
    let mut cmsg = nix::cmsg_space!([RawFd; 3], libc::ucred);
    let mut cred = None;
    let (n, fds) = {
        let mut iov = [IoSliceMut::new(&mut buf)];
        let msg = match socket::recvmsg::<()>(
            conn.as_raw_fd(),
            &mut iov,
            Some(&mut cmsg),
            MsgFlags::MSG_CMSG_CLOEXEC,
        ) {
            Ok(m) => m,
            Err(_) => return,
        };
        let mut fds: Vec<OwnedFd> = Vec::new();
        if let Ok(cmsgs) = msg.cmsgs() {
            for c in cmsgs {
                match c {
                    ControlMessageOwned::ScmRights(list) => {
                        // SAFETY: SCM_RIGHTS delivered these descriptors to us; each is owned
                        // once.
                        fds.extend(list.into_iter().map(|f| unsafe { OwnedFd::from_raw_fd(f) }));
                    }
                    // pid 0 is what a receiver gets when the sender attached nothing.
                    ControlMessageOwned::ScmCredentials(c) if c.pid() > 0 => {
                        cred = Some(Cred {
                            pid: c.pid(),
                            uid: c.uid(),
                        });
                    }
                    _ => {}
                }
            }
        }
        (msg.bytes, fds)
    };
    let Some(cred) = cred else {
        send(
            &conn,
            &Msg::Error("the request carried no credentials".into()),
        );
        return;
    };
    match start_command(&conn, &buf[..n], fds, cred) {
        Ok(()) => {}
        Err(text) => send(&conn, &Msg::Error(text)),
    }
}

fn start_command(conn: &OwnedFd, body: &[u8], fds: Vec<OwnedFd>, cred: Cred) -> Result<(), String> {
    let req: Request =
        serde_json::from_slice(body).map_err(|e| format!("malformed request: {e}"))?;
    let caller = users::lookup_uid(cred.uid)
        .map_err(|_| format!("you do not exist in the passwd database (uid {})", cred.uid))?;
    let group_names: Vec<String> = caller
        .groups
        .iter()
        .map(|g| users::group_name(*g))
        .collect();
    let target_name = req.user.clone().unwrap_or_else(|| "root".into());
    let target_name = target_name.strip_prefix('#').unwrap_or(&target_name);
    let target = users::lookup(target_name).map_err(|_| format!("unknown user {target_name}"))?;
    let env_of = |k: &str| {
        req.env
            .iter()
            .rev()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.clone())
    };
    let shell = if req.login || env_of("SHELL").is_none() {
        target.shell.clone()
    } else {
        env_of("SHELL").unwrap_or_default()
    };
    let shell = if shell.is_empty() {
        "/bin/sh".into()
    } else {
        shell
    };
    let (program, args) = if req.login || req.shell {
        let mut a = Vec::new();
        if req.login {
            a.push("-l".to_string());
        }
        if !req.argv.is_empty() {
            a.push("-c".to_string());
            a.push(
                req.argv
                    .iter()
                    .map(|s| escape(s))
                    .collect::<Vec<_>>()
                    .join(" "),
            );
        }
        (PathBuf::from(&shell), a)
    } else if req.check_only {
        (PathBuf::from("/bin/true"), Vec::new())
    } else {
        let cmd = &req.argv[0];
        let path = resolve(cmd, &req.cwd).ok_or_else(|| format!("{cmd}: command not found"))?;
        (path, req.argv[1..].to_vec())
    };
    let verdict = policy::check(
        &policy::load(),
        &Caller {
            name: &caller.name,
            uid: caller.uid,
            groups: &group_names,
        },
        &target.name,
        &program,
    );
    let why = match verdict {
        Verdict::Allow => None,
        Verdict::NeedsPassword => Some("a password is required".to_string()),
        Verdict::Deny => Some(format!(
            "Sorry, user {} is not allowed to execute '{}' as {} in this sandbox.",
            caller.name,
            program.display(),
            target.name
        )),
    };
    if let Some(why) = why {
        let detail = match verdict {
            Verdict::NeedsPassword => "the rule wants a password",
            _ => "no rule allows it",
        };
        crate::kills::record(
            crate::kills::Reason::SudoRefused,
            format!(
                "sudo refused: user {} (uid {}) asked to run {} as {} ({detail})",
                caller.name,
                caller.uid,
                program.display(),
                target.name
            ),
        );
        return Err(why);
    }
    if req.check_only {
        send(conn, &Msg::Exit(0));
        return Ok(());
    }
    let cwd = if req.login {
        target.home.to_string_lossy().into_owned()
    } else {
        req.cwd.clone()
    };
    let env = build_env(&req, &caller, &target, &program);
    run(conn, program, args, env, cwd, &target, cred.pid, fds)
}

/// The command's environment: sudo's `env_reset` (or the caller's with `-E`), then the target's
/// identity, `secure_path` and the `SUDO_*` variables.
fn build_env(req: &Request, caller: &User, target: &User, program: &Path) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = if req.preserve_env {
        req.env.clone()
    } else {
        req.env
            .iter()
            .filter(|(k, _)| ENV_KEEP.contains(&k.as_str()) || k.starts_with("LC_"))
            .cloned()
            .collect()
    };
    let mut set = |k: &str, v: String| {
        env.retain(|(n, _)| n != k);
        env.push((k.to_string(), v));
    };
    set("PATH", SECURE_PATH.into());
    if !req.preserve_env || req.login {
        set("HOME", target.home.to_string_lossy().into_owned());
        set("SHELL", target.shell.clone());
        set("USER", target.name.clone());
        set("LOGNAME", target.name.clone());
        set("MAIL", format!("/var/mail/{}", target.name));
    }
    let mut command = vec![program.to_string_lossy().into_owned()];
    command.extend(req.argv.iter().skip(1).cloned());
    set("SUDO_COMMAND", command.join(" "));
    set("SUDO_USER", caller.name.clone());
    set("SUDO_UID", caller.uid.to_string());
    set("SUDO_GID", caller.gid.to_string());
    for (k, v) in &req.set_env {
        set(k, v.clone());
    }
    env
}

/// `cmd` as sudo finds it: a path as given (relative to the caller's cwd), else the first
/// executable in `secure_path`.
fn resolve(cmd: &str, cwd: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let is_exec = |p: &Path| {
        p.metadata()
            .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
            .unwrap_or(false)
    };
    if cmd.contains('/') {
        let p = Path::new(cwd).join(cmd);
        return is_exec(&p).then_some(p);
    }
    SECURE_PATH
        .split(':')
        .map(|d| Path::new(d).join(cmd))
        .find(|p| is_exec(p))
}

/// sudo's quoting of the command for `-s`/`-i`: a backslash before every character other than
/// alphanumerics, `_`, `-` and `$`.
fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if !(c.is_alphanumeric() || c == '_' || c == '-' || c == '$') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[allow(clippy::too_many_arguments)]
fn run(
    conn: &OwnedFd,
    program: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    cwd: String,
    target: &User,
    caller_pid: i32,
    fds: Vec<OwnedFd>,
) -> Result<(), String> {
    let mut fds = fds.into_iter();
    let (Some(i), Some(o), Some(e)) = (fds.next(), fds.next(), fds.next()) else {
        return Err("the request carried no stdin/stdout/stderr".into());
    };
    let mut cmd = Command::new(&program);
    cmd.args(&args)
        .env_clear()
        .envs(env)
        .stdin(Stdio::from(i))
        .stdout(Stdio::from(o))
        .stderr(Stdio::from(e));
    let c_cwd = std::ffi::CString::new(cwd).map_err(|_| "cwd contains a NUL byte".to_string())?;
    let groups: Vec<libc::gid_t> = target.groups.clone();
    let (uid, gid) = (target.uid, target.gid);
    // The command joins the caller's limits (its cgroup), so sudo is no way around them.
    let cgroup = crate::cmd_cgroups::cgroup_procs_of(caller_pid);
    let limited = cgroup.is_some();
    // SAFETY: the closure makes only async-signal-safe syscalls with data prepared above.
    unsafe {
        cmd.pre_exec(move || {
            // And its process limit (RLIMIT_NPROC, which gVisor holds strictly).
            if limited {
                crate::limits::limit_nproc_raw()?;
            }
            if libc::setsid() < 0
                || libc::setgroups(groups.len(), groups.as_ptr()) < 0
                || libc::setgid(gid) < 0
                || libc::setuid(uid) < 0
            {
                return Err(std::io::Error::last_os_error());
            }
            if libc::chdir(c_cwd.as_ptr()) < 0 {
                libc::chdir(c"/".as_ptr());
            }
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigprocmask(libc::SIG_SETMASK, &set, std::ptr::null_mut());
            Ok(())
        });
    }
    let (pid, _child, exit_rx) = reaper::spawn_registered(|| {
        let child = cmd.spawn()?;
        if let Some(procs) = &cgroup {
            let _ = std::fs::write(procs, child.id().to_string());
        }
        Ok((child.id(), child))
    })
    .map_err(|e| format!("unable to execute {}: {e}", program.display()))?;
    drop(cmd);
    let done = Arc::new(AtomicBool::new(false));
    let relay = conn.try_clone().map_err(|e| e.to_string())?;
    let done2 = done.clone();
    std::thread::spawn(move || {
        let mut buf = [0u8; 256];
        loop {
            let n = socket::recv(relay.as_raw_fd(), &mut buf, MsgFlags::empty()).unwrap_or(0);
            if n == 0 {
                // The shim is gone before its command: end the command too.
                if !done2.load(Ordering::SeqCst) {
                    // SAFETY: signalling the process group of the command we started.
                    unsafe { libc::kill(-(pid as i32), libc::SIGKILL) };
                }
                return;
            }
            if let Ok(Msg::Signal(sig)) = serde_json::from_slice::<Msg>(&buf[..n]) {
                // SAFETY: signalling the process group of the command we started.
                unsafe { libc::kill(-(pid as i32), sig) };
            }
        }
    });
    let exit = exit_rx.blocking_recv().unwrap_or(Exit::Code(1));
    done.store(true, Ordering::SeqCst);
    send(
        conn,
        &match exit {
            Exit::Code(c) => Msg::Exit(c),
            Exit::Signal { sig, .. } => Msg::Killed(sig),
        },
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_like_sudo() {
        assert_eq!(escape("echo"), "echo");
        assert_eq!(escape("a b"), "a\\ b");
        assert_eq!(escape("$HOME/x"), "$HOME\\/x");
    }

    #[test]
    fn env_reset_keeps_little() {
        let u = |name: &str, uid| User {
            name: name.into(),
            uid,
            gid: uid,
            home: format!("/home/{name}").into(),
            shell: "/bin/bash".into(),
            groups: vec![uid],
        };
        let req = Request {
            env: vec![
                ("TERM".into(), "xterm".into()),
                ("SECRET".into(), "x".into()),
                ("PATH".into(), "/evil".into()),
            ],
            argv: vec!["id".into(), "-u".into()],
            set_env: vec![("FOO".into(), "1".into())],
            ..Default::default()
        };
        let env = build_env(
            &req,
            &u("user", 1000),
            &u("root", 0),
            Path::new("/usr/bin/id"),
        );
        let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        assert_eq!(get("TERM"), Some("xterm"));
        assert_eq!(get("SECRET"), None);
        assert_eq!(get("PATH"), Some(SECURE_PATH));
        assert_eq!(get("HOME"), Some("/home/root"));
        assert_eq!(get("SUDO_USER"), Some("user"));
        assert_eq!(get("SUDO_COMMAND"), Some("/usr/bin/id -u"));
        assert_eq!(get("FOO"), Some("1"));
        let req = Request {
            preserve_env: true,
            ..req
        };
        let env = build_env(
            &req,
            &u("user", 1000),
            &u("root", 0),
            Path::new("/usr/bin/id"),
        );
        assert!(env.iter().any(|(k, _)| k == "SECRET"));
    }
}
