//! The `sudo` command in a sandbox: parses sudo's command line, hands the request to the
//! agent's broker and ends the way the command ended. Runs as the calling user, synchronously.

use std::io::IoSlice;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{SigSet, SigmaskHow, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::socket::{self, AddressFamily, ControlMessage, MsgFlags, SockFlag, SockType};

use super::{Msg, Request, SOCKET_NAME};

/// Signals relayed to the command, as sudo relays them.
const RELAYED: &[Signal] = &[
    Signal::SIGINT,
    Signal::SIGTERM,
    Signal::SIGHUP,
    Signal::SIGQUIT,
    Signal::SIGUSR1,
    Signal::SIGUSR2,
    Signal::SIGWINCH,
    Signal::SIGCONT,
];

const USAGE: &str =
    "usage: sudo [-EHinsv] [-u user] [-D directory] [VAR=value] [command [arg ...]]";

/// What the command line asks for.
#[derive(Debug, PartialEq, Eq)]
pub enum Parsed {
    Run(Request),
    /// Print this and exit 0 (`-V`, `-h`, `-k`, `-K`).
    Print(String),
    /// Print `sudo: <this>` and exit 1.
    Usage(String),
}

/// Parses sudo's arguments (after argv[0]).
pub fn parse(args: &[String]) -> Parsed {
    let mut req = Request::default();
    let mut cwd_override = None;
    let mut i = 0;
    let value = |i: &mut usize, attached: &str, name: &str| -> Result<String, String> {
        if !attached.is_empty() {
            return Ok(attached.to_string());
        }
        *i += 1;
        args.get(*i)
            .cloned()
            .ok_or_else(|| format!("option requires an argument -- '{name}'\n{USAGE}"))
    };
    while i < args.len() {
        let a = args[i].as_str();
        if a == "--" {
            i += 1;
            break;
        }
        if let Some(long) = a.strip_prefix("--") {
            let (name, val) = match long.split_once('=') {
                Some((n, v)) => (n, Some(v.to_string())),
                None => (long, None),
            };
            match name {
                "user" => match val.map(Ok).unwrap_or_else(|| value(&mut i, "", "user")) {
                    Ok(v) => req.user = Some(v),
                    Err(e) => return Parsed::Usage(e),
                },
                "chdir" => match val.map(Ok).unwrap_or_else(|| value(&mut i, "", "chdir")) {
                    Ok(v) => cwd_override = Some(v),
                    Err(e) => return Parsed::Usage(e),
                },
                "preserve-env" => req.preserve_env = true,
                "login" => req.login = true,
                "shell" => req.shell = true,
                "non-interactive" | "set-home" | "stdin" | "askpass" => {}
                "validate" | "list" => req.check_only = true,
                "reset-timestamp" | "remove-timestamp" => return Parsed::Print(String::new()),
                "version" => return Parsed::Print(version()),
                "help" => return Parsed::Print(USAGE.to_string()),
                _ => return Parsed::Usage(format!("unrecognized option '--{name}'\n{USAGE}")),
            }
            i += 1;
            continue;
        }
        if a.len() < 2 || !a.starts_with('-') {
            break;
        }
        let flags = &a[1..];
        for (pos, c) in flags.char_indices() {
            let rest = &flags[pos + c.len_utf8()..];
            match c {
                'u' | 'D' | 'p' | 'g' | 'C' | 'T' | 'r' | 't' | 'U' => {
                    let v = match value(&mut i, rest, &c.to_string()) {
                        Ok(v) => v,
                        Err(e) => return Parsed::Usage(e),
                    };
                    match c {
                        'u' => req.user = Some(v),
                        'D' => cwd_override = Some(v),
                        'g' => return Parsed::Usage("-g is not supported by kiln's sudo".into()),
                        _ => {}
                    }
                    break;
                }
                'E' => req.preserve_env = true,
                'i' => req.login = true,
                's' => req.shell = true,
                'v' | 'l' => req.check_only = true,
                'n' | 'H' | 'S' | 'A' | 'P' => {}
                'k' | 'K' => {
                    if args.len() == 1 {
                        return Parsed::Print(String::new());
                    }
                }
                'V' => return Parsed::Print(version()),
                'h' => return Parsed::Print(USAGE.to_string()),
                'b' => return Parsed::Usage("-b is not supported by kiln's sudo".into()),
                _ => return Parsed::Usage(format!("invalid option -- '{c}'\n{USAGE}")),
            }
        }
        i += 1;
    }
    while let Some((k, v)) = args.get(i).and_then(|a| a.split_once('=')) {
        if k.is_empty() || !k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
            break;
        }
        req.set_env.push((k.to_string(), v.to_string()));
        i += 1;
    }
    req.argv = args[i..].to_vec();
    if req.argv.is_empty() && !req.login && !req.shell && !req.check_only {
        return Parsed::Usage(USAGE.to_string());
    }
    req.cwd = cwd_override.unwrap_or_else(|| {
        std::env::current_dir()
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_else(|_| "/".into())
    });
    Parsed::Run(req)
}

fn version() -> String {
    format!(
        "Sudo version 1.9 (kiln-agent {} privilege broker)",
        env!("CARGO_PKG_VERSION")
    )
}

/// Entry point when kiln-agent runs as `sudo`; returns the exit code (or kills itself with the
/// command's signal).
pub fn main() -> i32 {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut req = match parse(&args) {
        Parsed::Run(r) => r,
        Parsed::Print(s) => {
            if !s.is_empty() {
                println!("{s}");
            }
            return 0;
        }
        Parsed::Usage(s) => {
            eprintln!("sudo: {s}");
            return 1;
        }
    };
    req.env = std::env::vars_os()
        .map(|(k, v)| {
            (
                k.to_string_lossy().into_owned(),
                v.to_string_lossy().into_owned(),
            )
        })
        .collect();
    match run(&req) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("sudo: {e}");
            1
        }
    }
}

fn connect() -> Result<OwnedFd, String> {
    let fd = socket::socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(|e| format!("cannot create a socket: {e}"))?;
    let addr = socket::UnixAddr::new_abstract(SOCKET_NAME).map_err(|e| e.to_string())?;
    socket::connect(fd.as_raw_fd(), &addr).map_err(|e| {
        format!("the sandbox's privilege broker (kiln-agent) is not reachable: {e}")
    })?;
    // No SO_PEERCRED check of the broker: gVisor answers it with the caller's own
    // credentials. The name is bound by PID 1 before any user process exists.
    Ok(fd)
}

/// Our stdin/stdout/stderr, with /dev/null standing in for a closed one.
fn std_fds() -> Vec<OwnedFd> {
    (0..3)
        .map(|fd: RawFd| {
            let dup = nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(3));
            match dup {
                // SAFETY: F_DUPFD_CLOEXEC returned a new descriptor that we own.
                Ok(n) => unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(n) },
                Err(_) => std::fs::File::open("/dev/null")
                    .map(OwnedFd::from)
                    .unwrap_or_else(|_| {
                        // SAFETY: a last resort only reached when /dev/null is missing; fd is
                        // a descriptor number that the broker will find invalid and reject.
                        unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) }
                    }),
            }
        })
        .collect()
}

fn send(fd: &OwnedFd, msg: &Msg) {
    if let Ok(b) = serde_json::to_vec(msg) {
        let _ = socket::send(fd.as_raw_fd(), &b, MsgFlags::MSG_NOSIGNAL);
    }
}

fn run(req: &Request) -> Result<i32, String> {
    let sock = connect()?;
    let mut mask = SigSet::empty();
    for s in RELAYED {
        mask.add(*s);
    }
    mask.thread_set_mask()
        .map_err(|e| format!("cannot block signals: {e}"))?;
    let body = serde_json::to_vec(req).map_err(|e| e.to_string())?;
    if body.len() > super::MAX_REQUEST {
        return Err("argument list and environment too long".into());
    }
    let fds = std_fds();
    let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
    socket::sendmsg::<()>(
        sock.as_raw_fd(),
        &[IoSlice::new(&body)],
        // Who we are, vouched for by the kernel (a process can only send its own ids).
        &[
            ControlMessage::ScmRights(&raw),
            ControlMessage::ScmCredentials(&socket::UnixCredentials::new()),
        ],
        MsgFlags::MSG_NOSIGNAL,
        None,
    )
    .map_err(|e| format!("sending the request to the privilege broker: {e}"))?;
    drop(fds);
    // Signals sent to us go to the command; read from a signalfd beside the broker's socket
    // (no thread: under a process flood a thread may be one task too many).
    let signals = SignalFd::with_flags(&mask, SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC)
        .map_err(|e| format!("cannot watch signals: {e}"))?;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let mut ready = [
            PollFd::new(sock.as_fd(), PollFlags::POLLIN),
            PollFd::new(signals.as_fd(), PollFlags::POLLIN),
        ];
        match poll(&mut ready, PollTimeout::NONE) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(format!("waiting for the privilege broker: {e}")),
        }
        let has = |p: &PollFd| p.revents().is_some_and(|r| !r.is_empty());
        if has(&ready[1]) {
            while let Ok(Some(info)) = signals.read_signal() {
                send(&sock, &Msg::Signal(info.ssi_signo as i32));
            }
        }
        if !has(&ready[0]) {
            continue;
        }
        let n = socket::recv(sock.as_raw_fd(), &mut buf, MsgFlags::empty())
            .map_err(|e| format!("reading from the privilege broker: {e}"))?;
        if n == 0 {
            return Err("the privilege broker went away".into());
        }
        match serde_json::from_slice::<Msg>(&buf[..n]) {
            Ok(Msg::Exit(code)) => return Ok(code),
            Ok(Msg::Killed(sig)) => return Ok(die_by(sig)),
            Ok(Msg::Error(text)) => return Err(text),
            Ok(Msg::Signal(_)) | Err(_) => continue,
        }
    }
}

/// Ends this process with `sig` (default disposition), as sudo does when its command was
/// killed; returns the conventional 128+sig if the signal does not kill.
fn die_by(sig: i32) -> i32 {
    if let Ok(s) = Signal::try_from(sig) {
        // SAFETY: restoring the default disposition of a valid signal.
        unsafe {
            let _ = nix::sys::signal::signal(s, nix::sys::signal::SigHandler::SigDfl);
        }
        let mut set = SigSet::empty();
        set.add(s);
        let _ = nix::sys::signal::pthread_sigmask(SigmaskHow::SIG_UNBLOCK, Some(&set), None);
        let _ = nix::sys::signal::raise(s);
    }
    128 + sig
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(args: &[&str]) -> Parsed {
        parse(&args.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    fn run_req(args: &[&str]) -> Request {
        match p(args) {
            Parsed::Run(r) => r,
            other => panic!("{args:?}: {other:?}"),
        }
    }

    #[test]
    fn parses_sudo_command_lines() {
        let r = run_req(&["id", "-u"]);
        assert_eq!(r.argv, vec!["id", "-u"]);
        assert_eq!(r.user, None);
        let r = run_req(&["-u", "user", "whoami"]);
        assert_eq!(r.user.as_deref(), Some("user"));
        let r = run_req(&["-nEu", "nobody", "--", "ls", "-l"]);
        assert_eq!(r.user.as_deref(), Some("nobody"));
        assert!(r.preserve_env);
        assert_eq!(r.argv, vec!["ls", "-l"]);
        let r = run_req(&["-uuser", "FOO=bar", "env"]);
        assert_eq!(r.user.as_deref(), Some("user"));
        assert_eq!(r.set_env, vec![("FOO".into(), "bar".into())]);
        assert_eq!(r.argv, vec!["env"]);
        let r = run_req(&["--user=root", "-D", "/tmp", "pwd"]);
        assert_eq!(r.cwd, "/tmp");
        let r = run_req(&["-i"]);
        assert!(r.login && r.argv.is_empty());
        let r = run_req(&["sh", "-c", "echo -u"]);
        assert_eq!(r.argv, vec!["sh", "-c", "echo -u"]);
        assert!(matches!(p(&[]), Parsed::Usage(_)));
        assert!(matches!(p(&["-u"]), Parsed::Usage(_)));
        assert!(matches!(p(&["-Z", "x"]), Parsed::Usage(_)));
        assert!(matches!(p(&["-V"]), Parsed::Print(_)));
        assert!(matches!(p(&["-k"]), Parsed::Print(_)));
        assert!(run_req(&["-v"]).check_only);
    }
}
