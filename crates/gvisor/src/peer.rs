//! Who is at the other end of a connection to a sandbox's agent socket.
//!
//! `SO_PEERCRED` of a connected Unix socket names the host process that called `listen(2)` on
//! the socket it reached. For an agent socket made by `--host-uds=create` that is the sandbox's
//! own `runsc-gofer` (measured with runsc 0.0~20240729: the peer of the host's `agent.sock` is
//! the gofer, `--bundle=<sandbox dir>/bundle` on its command line, in the sandbox's host
//! cgroup; never the `runsc-sandbox` sentry), after a boot and after a restore alike. Anything
//! else — a host socket the sandbox got the server to reach, another sandbox's gofer, the
//! sentry — is refused.
//!
//! The check runs on every connection (the hot path of every envd request), so what was
//! verified is kept per sandbox as (pid, start time) with a pidfd of the process: a connection
//! to a known peer costs one `getsockopt` and one `pidfd_send_signal(fd, 0)` (the process is
//! still alive, so its pid is still its own), no `/proc` read (measured in
//! `container::tests::connect_cost`). Where pidfds are missing (Linux before 5.3) the start
//! time is read from `/proc/<pid>/stat` instead.

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::sync::Mutex;

use super::reap::{self, Process};

/// The refusal a client may see (no host paths).
pub const FOREIGN_PEER: &str =
    "the agent socket is not served by this sandbox's runtime; the connection was refused";

/// The host pid of the process that listens on the socket `s` is connected to.
pub fn peer_pid(s: &impl AsFd) -> std::io::Result<libc::pid_t> {
    let cred = nix::sys::socket::getsockopt(s, nix::sys::socket::sockopt::PeerCredentials)
        .map_err(std::io::Error::from)?;
    Ok(cred.pid())
}

/// Whether the command line `cmdline` (NUL-separated, as in `/proc/<pid>/cmdline`) is the
/// runsc gofer of the sandbox whose directory is `dir`: it names the bundle in `dir`
/// (`--bundle=<dir>/bundle`, or `--bundle <dir>/bundle`).
pub fn is_gofer_of(cmdline: &[u8], dir: &Path) -> bool {
    let mut args = cmdline.split(|b| *b == 0).map(String::from_utf8_lossy);
    if args.next().as_deref() != Some("runsc-gofer") {
        return false;
    }
    let bundle = dir.join("bundle");
    let bundle = bundle.to_string_lossy();
    let mut prev_flag = false;
    args.any(|a| {
        let hit = match a.strip_prefix("--bundle=") {
            Some(v) => v == bundle.as_ref(),
            None => prev_flag && a == bundle,
        };
        prev_flag = a == "--bundle";
        hit
    })
}

/// A pidfd of process `pid` (None where the kernel has none).
fn pidfd_open(pid: libc::pid_t) -> Option<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags; it returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    // SAFETY: a descriptor pidfd_open just returned, owned by nobody else.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Whether the process of `pidfd` is still alive (signal 0: no signal is sent).
fn alive(pidfd: &OwnedFd) -> bool {
    // SAFETY: pidfd_send_signal with signal 0 and no siginfo only checks the process; the
    // descriptor is open.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            0,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    rc == 0
}

/// A verified peer: the process, and a pidfd of it to tell cheaply that it is still the same.
struct Verified {
    process: Process,
    pidfd: Option<OwnedFd>,
}

impl Verified {
    fn pid(&self) -> libc::pid_t {
        self.process.pid()
    }

    /// Whether it is still the process verified (a live process keeps its pid).
    fn still_running(&self) -> bool {
        match &self.pidfd {
            Some(fd) => alive(fd),
            None => !reap::still_running(&[self.process]).is_empty(),
        }
    }
}

/// The peers verified so far, per sandbox.
#[derive(Default)]
pub struct Peers {
    known: Mutex<HashMap<String, Vec<Verified>>>,
}

impl Peers {
    /// Checks that the process listening at the other end of `s` is sandbox `id`'s own runsc
    /// gofer (directory `dir`); the error is [`FOREIGN_PEER`].
    pub fn check(&self, id: &str, dir: &Path, s: &impl AsFd) -> std::io::Result<()> {
        let refused = || std::io::Error::new(std::io::ErrorKind::PermissionDenied, FOREIGN_PEER);
        let pid = peer_pid(s)?;
        let mut known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(v) = known.get(id) {
            if v.iter().any(|p| p.pid() == pid && p.still_running()) {
                return Ok(());
            }
        }
        // (A peer that is gone, or not in this pid namespace (pid 0), is refused.)
        let Some(me) = reap::identify(&[pid]).pop() else {
            return Err(refused());
        };
        let pidfd = pidfd_open(pid);
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        // The same process still (its start time read before its pidfd and command line).
        if !is_gofer_of(&cmdline, dir) || reap::still_running(&[me]).is_empty() {
            tracing::warn!(
                sandbox = id,
                pid,
                "the agent socket's peer is not the sandbox's"
            );
            return Err(refused());
        }
        let v = known.entry(id.to_string()).or_default();
        // The gofers of a sandbox's later generations (restores) replace earlier ones.
        v.retain(Verified::still_running);
        v.push(Verified { process: me, pidfd });
        Ok(())
    }

    /// Forgets sandbox `id`'s peers (it is gone).
    pub fn forget(&self, id: &str) {
        self.known
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::CommandExt;

    fn cmd(args: &[&str]) -> Vec<u8> {
        args.join("\0").into_bytes()
    }

    #[test]
    fn the_sandboxs_gofer_only() {
        let dir = Path::new("/s/gvisor/sandboxes/abc");
        // As measured (runsc 0.0~20240729), with a trailing NUL.
        let measured = "runsc-gofer\0--root=/s/gvisor/runsc\0--overlay2=none\0--host-uds=create\0\
                        gofer\0--bundle=/s/gvisor/sandboxes/abc/bundle\0--io-fds=5,6\0";
        assert!(is_gofer_of(measured.as_bytes(), dir));
        let gofer = |b: &str| cmd(&["runsc-gofer", "--root=/r", "gofer", "--bundle", b]);
        assert!(is_gofer_of(&gofer("/s/gvisor/sandboxes/abc/bundle"), dir));
        // Another sandbox whose id starts with this one's, or a path that only contains it.
        assert!(!is_gofer_of(&gofer("/s/gvisor/sandboxes/abcd/bundle"), dir));
        assert!(!is_gofer_of(
            &gofer("/x/s/gvisor/sandboxes/abc/bundle"),
            dir
        ));
        assert!(!is_gofer_of(
            &cmd(&["runsc-gofer", "--log=/s/gvisor/sandboxes/abc/bundle"]),
            dir
        ));
        // The sentry, or not runsc at all, whatever the arguments.
        let bundle = "--bundle=/s/gvisor/sandboxes/abc/bundle";
        assert!(!is_gofer_of(
            &cmd(&["runsc-sandbox", "boot", bundle, "abc"]),
            dir
        ));
        assert!(!is_gofer_of(&cmd(&["python3", bundle]), dir));
        assert!(!is_gofer_of(b"", dir));
    }

    #[test]
    fn a_peer_outside_the_sandbox_is_refused() {
        // This test process listens: not a runsc process of any sandbox.
        let d = tempfile::tempdir().unwrap();
        let l = std::os::unix::net::UnixListener::bind(d.path().join("s")).unwrap();
        let c = std::os::unix::net::UnixStream::connect(d.path().join("s")).unwrap();
        // SAFETY: getpid has no preconditions.
        assert_eq!(peer_pid(&c).unwrap(), unsafe { libc::getpid() });
        let peers = Peers::default();
        let e = peers.check("abc", d.path(), &c).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied);
        assert_eq!(e.to_string(), FOREIGN_PEER);
        assert!(!e
            .to_string()
            .contains(&d.path().to_string_lossy().to_string()));
        drop(l);
    }

    #[test]
    fn the_sandboxs_gofer_is_accepted_and_remembered() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("sandboxes").join("abc");
        let sock = d.path().join("agent.sock");
        let bundle = dir.join("bundle");
        // A process that calls itself runsc-gofer of this sandbox listens on the socket.
        let script = "import socket,sys,time\n\
                      s=socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(8)\n\
                      print('up', flush=True); time.sleep(30)";
        let mut child = std::process::Command::new("/usr/bin/python3")
            .arg0("runsc-gofer")
            .args(["-c", script, sock.to_str().unwrap(), "--bundle"])
            .arg(&bundle)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.take().unwrap()),
            &mut line,
        )
        .unwrap();
        assert_eq!(line, "up\n");
        let peers = Peers::default();
        for _ in 0..3 {
            let c = std::os::unix::net::UnixStream::connect(&sock).unwrap();
            assert_eq!(peer_pid(&c).unwrap(), child.id() as libc::pid_t);
            peers.check("abc", &dir, &c).unwrap();
        }
        assert_eq!(peers.known.lock().unwrap()["abc"].len(), 1);
        // The same process is not another sandbox's.
        let c = std::os::unix::net::UnixStream::connect(&sock).unwrap();
        let other = d.path().join("sandboxes").join("abd");
        assert!(peers.check("abd", &other, &c).is_err());
        child.kill().unwrap();
        child.wait().unwrap();
        // Gone: a connection that outlived its listener is refused.
        assert!(peers.check("abc", &dir, &c).is_err());
    }
}
