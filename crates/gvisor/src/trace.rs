//! Syscall-level auditing (opt-in per sandbox) with gVisor's runtime monitoring: runsc starts
//! the sandbox with `--pod-init-config` naming a trace session whose points are the `open`,
//! `openat`, `execve`, `execveat`, `connect`, `accept`, `accept4`, `dup2` and `dup3` system
//! calls and the raw escape-probe and chmod calls of [`more`], and whose `remote` sink is a
//! `SOCK_SEQPACKET` Unix socket kiln listens on (`trace.sock` in the sandbox's directory, not in
//! the `run/` it shares with the sandbox: nothing inside can reach it).
//!
//! The wire format (gVisor's `pkg/sentry/seccheck/sinks/remote`): the sandbox sends a
//! `Handshake{version}` protobuf and waits for ours; then one message per event: an 8-byte
//! header (`u16` header size, `u16` message type, `u32` dropped count, little-endian) and a
//! protobuf of the point's type. Only the fields kiln records are decoded here.
//!
//! Events of the agent itself (PID 1, whose file operations the proxy records) are
//! skipped. A thread per traced sandbox reads its socket and hands each event to the observer
//! (waiting for it: a slow audit writer slows the sandbox's traced calls, nothing is dropped
//! by kiln; gVisor counts what its own queue dropped, recorded as `dropped`).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::socket::{self as ns, AddressFamily, MsgFlags, SockFlag, SockType, UnixAddr};
use serde_json::{json, Value};

use super::proto::fields;

use crate::driver::{io_err, DriverError, Result, SyscallObserver};
use more::{Sockets, ESCAPE_SYSCALLS, MODE_SYSCALLS};

pub mod more;

/// The pod init config, in the sandbox's directory.
pub const POD_CONFIG: &str = "trace.json";
/// The sink socket the server listens on, in the sandbox's directory (runsc connects to it from
/// the host; the sandbox cannot see it).
pub const SINK: &str = "trace.sock";
/// How long a started sandbox has to connect to its sink.
const ACCEPT_TIMEOUT: Duration = Duration::from_secs(60);
const AGENT_COMM: &str = "kiln-agent";

const POINTS: [&str; 7] = [
    "syscall/open/exit",
    "syscall/openat/exit",
    "syscall/execve/enter",
    "syscall/execveat/enter",
    "syscall/connect/exit",
    "syscall/accept/exit",
    "syscall/accept4/exit",
];
/// Points whose `fd_path` is asked for too.
const DUP_POINTS: [&str; 2] = ["syscall/dup2/exit", "syscall/dup3/exit"];

/// Writes the sandbox's pod init config (its syscalls are audited from its start).
pub fn write_config(dir: &Path) -> Result<()> {
    let ctx = json!(["group_id", "process_name", "credentials"]);
    let mut points: Vec<Value> = POINTS
        .iter()
        .map(|p| json!({"name": p, "context_fields": ctx}))
        .collect();
    points.extend(
        DUP_POINTS
            .iter()
            .map(|p| json!({"name": p, "optional_fields": ["fd_path"], "context_fields": ctx})),
    );
    let raw = ESCAPE_SYSCALLS
        .iter()
        .map(|(n, _)| *n)
        .chain(MODE_SYSCALLS.iter().map(|(n, _, _)| *n));
    points.extend(
        raw.map(|n| json!({"name": format!("syscall/sysno/{n}/exit"), "context_fields": ctx})),
    );
    let cfg = json!({"trace_session": {
        "name": "Default",
        "points": points,
        "sinks": [{"name": "remote", "config": {"endpoint": dir.join(SINK)}}],
    }});
    let path = dir.join(POD_CONFIG);
    std::fs::write(&path, cfg.to_string()).map_err(io_err(format!("writing {}", path.display())))
}

/// The pod init config of sandbox directory `dir`, if its syscalls are audited.
pub fn config_of(dir: &Path) -> Option<PathBuf> {
    Some(dir.join(POD_CONFIG)).filter(|p| p.exists())
}

/// Before runsc starts sandbox directory `dir`: when its syscalls are audited and there is an
/// observer, starts listening and returns the pod init config to pass.
pub fn start(dir: &Path, id: &str, obs: Option<&SyscallObserver>) -> Result<Option<PathBuf>> {
    match (config_of(dir), obs) {
        (Some(pod), Some(o)) => {
            listen(dir, id, o.clone())?;
            Ok(Some(pod))
        }
        _ => Ok(None),
    }
}

/// Listens on the sandbox's sink socket and records what comes (in a thread of its own, until
/// the sandbox closes the connection).
pub fn listen(dir: &Path, id: &str, obs: SyscallObserver) -> Result<()> {
    let path = dir.join(SINK);
    let _ = std::fs::remove_file(&path);
    let sys = |what: &'static str| move |e: nix::Error| io_err(what)(std::io::Error::from(e));
    let fd = ns::socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(sys("creating the trace socket"))?;
    let addr = UnixAddr::new(&path).map_err(sys("trace socket path"))?;
    ns::bind(fd.as_raw_fd(), &addr).map_err(sys("binding the trace socket"))?;
    ns::listen(&fd, ns::Backlog::new(1).map_err(sys("backlog"))?)
        .map_err(sys("listening on the trace socket"))?;
    let tv = nix::sys::time::TimeVal::new(ACCEPT_TIMEOUT.as_secs() as i64, 0);
    ns::setsockopt(&fd, ns::sockopt::ReceiveTimeout, &tv).map_err(sys("trace socket timeout"))?;
    let rt = tokio::runtime::Handle::current();
    let id = id.to_string();
    // The socket file this listener bound: a later session of the same sandbox (its next
    // container, restored while this one's ends) binds a new one at the same path.
    let mine = inode(&path);
    std::thread::Builder::new()
        .name("kiln-trace".into())
        .spawn(move || {
            if let Err(e) = serve(&fd, &id, &obs, &rt) {
                tracing::warn!(sandbox = %id, error = %e, "syscall audit stream");
            }
            if mine.is_some() && inode(&path) == mine {
                let _ = std::fs::remove_file(&path);
            }
        })
        .map_err(|e| DriverError::Other(format!("starting the trace reader: {e}")))?;
    Ok(())
}

/// The (device, inode) of the file at `path`.
fn inode(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino()))
}

fn serve(
    l: &OwnedFd,
    id: &str,
    obs: &SyscallObserver,
    rt: &tokio::runtime::Handle,
) -> std::io::Result<()> {
    let raw = ns::accept(l.as_raw_fd())?;
    // SAFETY: accept returned a new descriptor that nothing else owns.
    let c = unsafe { OwnedFd::from_raw_fd(raw) };
    let none = nix::sys::time::TimeVal::new(0, 0);
    ns::setsockopt(&c, ns::sockopt::ReceiveTimeout, &none)?;
    let mut buf = vec![0u8; 1 << 20];
    // Their handshake, then ours: version 1.
    ns::recv(c.as_raw_fd(), &mut buf, MsgFlags::empty())?;
    ns::send(c.as_raw_fd(), &[0x08, 0x01], MsgFlags::empty())?;
    let mut sockets = Sockets::default();
    loop {
        let n = ns::recv(c.as_raw_fd(), &mut buf, MsgFlags::empty())?;
        if n == 0 {
            return Ok(());
        }
        if let Some(mut body) = decode(&buf[..n]) {
            sockets.note(&mut body);
            rt.block_on(obs(id, body));
        }
    }
}

/// One message's record body (`None`: not recorded).
pub fn decode(msg: &[u8]) -> Option<Value> {
    let h = msg.get(..8)?;
    let size = usize::from(u16::from_le_bytes([h[0], h[1]]));
    let kind = u16::from_le_bytes([h[2], h[3]]);
    let dropped = u32::from_le_bytes([h[4], h[5], h[6], h[7]]);
    let f = fields(msg.get(size..)?)?;
    let ctx = f.iter().find_map(|x| x.msg(1)).unwrap_or_default();
    let process = ctx.iter().find_map(|x| x.str(9)).unwrap_or_default();
    let pid = ctx.iter().find_map(|x| x.int(4));
    // Credentials (context field 7): real uid 1, effective uid 2; a zero is not on the wire.
    let creds = ctx.iter().find_map(|x| x.msg(7));
    // The agent is PID 1; the name is its thread's (`tokio-rt-worker` for most of its calls),
    // so the pid is what tells.
    if process == AGENT_COMM || pid == Some(1) {
        return None;
    }
    let exit = f.iter().find_map(|x| x.msg(2));
    let result = exit.as_ref().and_then(|e| e.iter().find_map(|x| x.int(1)));
    let errno = exit
        .as_ref()
        .and_then(|e| e.iter().find_map(|x| x.int(2)))
        .filter(|e| *e != 0);
    let sysno = f.iter().find_map(|x| x.int(3));
    let mut b = match kind {
        // Open: fd 4, fd_path 5, pathname 6, flags 7.
        7 => json!({
            "call": if sysno == Some(2) { "open" } else { "openat" },
            "path": f.iter().find_map(|x| x.str(6)),
            "dirPath": f.iter().find_map(|x| x.str(5)).filter(|p| !p.is_empty()),
            "flags": f.iter().find_map(|x| x.int(7)).unwrap_or(0),
        }),
        // Connect: fd 4, fd_path 5, address 6.
        10 => json!({
            "call": "connect",
            "fd": f.iter().find_map(|x| x.int(4)),
            "address": f.iter().find_map(|x| x.bytes(6)).map(sockaddr),
        }),
        // Execve: fd 4, fd_path 5, pathname 6, argv 7.
        11 => json!({
            "call": if sysno == Some(322) { "execveat" } else { "execve" },
            "path": f.iter().find_map(|x| x.str(6)),
            "argv": f.iter().filter_map(|x| x.str(7)).collect::<Vec<_>>(),
        }),
        _ => more::decode(kind, sysno, &f)?,
    };
    b["pid"] = json!(pid);
    b["process"] = json!(process);
    if let Some(c) = creds {
        b["uid"] = json!(c.iter().find_map(|x| x.int(1)).unwrap_or(0));
        b["euid"] = json!(c.iter().find_map(|x| x.int(2)).unwrap_or(0));
    }
    if exit.is_some() {
        b["result"] = json!(result.unwrap_or(0));
        if let Some(e) = errno {
            b["errno"] = json!(e);
        }
    }
    if dropped > 0 {
        b["dropped"] = json!(dropped);
    }
    Some(b)
}

/// A socket address as text: `1.2.3.4:80`, `[::1]:80`, `unix:/path`, or `family N`.
fn sockaddr(a: &[u8]) -> String {
    let family = a.get(..2).map(|f| u16::from_le_bytes([f[0], f[1]]));
    match (family, a.len()) {
        (Some(2), n) if n >= 8 => format!(
            "{}.{}.{}.{}:{}",
            a[4],
            a[5],
            a[6],
            a[7],
            u16::from_be_bytes([a[2], a[3]])
        ),
        (Some(10), n) if n >= 24 => {
            let mut b = [0u8; 16];
            b.copy_from_slice(&a[8..24]);
            format!(
                "[{}]:{}",
                std::net::Ipv6Addr::from(b),
                u16::from_be_bytes([a[2], a[3]])
            )
        }
        (Some(1), _) => {
            let p = &a[2..];
            let end = p.iter().position(|c| *c == 0).unwrap_or(p.len());
            format!("unix:{}", String::from_utf8_lossy(&p[..end]))
        }
        (f, _) => format!("family {}", f.unwrap_or(0)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(kind: u16, payload: &[u8]) -> Vec<u8> {
        let mut m = vec![8, 0];
        m.extend(kind.to_le_bytes());
        m.extend(0u32.to_le_bytes());
        m.extend(payload);
        m
    }

    #[test]
    fn an_openat_is_decoded() {
        // As runsc sent it (context: group_id 7, process python3; sysno 257, fd AT_FDCWD,
        // pathname, flags), plus an exit with result 3.
        let mut p = b"\n\x0b\x20\x07J\x07python3\x12\x02\x08\x03\x18\x81\x02".to_vec();
        p.extend(b"\x20\x9c\xff\xff\xff\xff\xff\xff\xff\xff\x01");
        p.extend(b"\x32\x0d/etc/hostname\x38\x80\x80\x20");
        let b = decode(&message(7, &p)).unwrap();
        assert_eq!(b["call"], "openat");
        assert_eq!(b["path"], "/etc/hostname");
        assert_eq!(b["pid"], 7);
        assert_eq!(b["process"], "python3");
        assert_eq!(b["result"], 3);
        assert_eq!(b["flags"], 0x80000);
        assert!(b.get("errno").is_none() && b.get("dropped").is_none());
        // The agent's own calls are not recorded; garbage is not either.
        let agent = b"\n\x0c\x4a\x0akiln-agent\x32\x01/".to_vec();
        assert_eq!(decode(&message(7, &agent)), None);
        assert_eq!(decode(&message(7, b"\x32\x09/x")), None);
        assert_eq!(decode(b"\x08\x00"), None);
    }

    #[test]
    fn connect_and_execve_are_decoded() {
        let mut addr = vec![2, 0, 0, 80, 198, 51, 100, 10];
        addr.extend([0; 8]);
        let mut p = vec![0x20, 3, 0x32, addr.len() as u8];
        p.extend(&addr);
        let b = decode(&message(10, &p)).unwrap();
        assert_eq!(
            (b["call"].as_str(), b["address"].as_str()),
            (Some("connect"), Some("198.51.100.10:80"))
        );
        assert_eq!(sockaddr(b"\x01\x00/run/x\x00\x00"), "unix:/run/x");
        let p = b"\x32\x08/bin/cat\x3a\x03cat\x3a\x02/x";
        let b = decode(&message(11, p)).unwrap();
        assert_eq!(b["call"], "execve");
        assert_eq!(b["argv"], json!(["cat", "/x"]));
        assert!(b.get("result").is_none());
        assert!(b.get("uid").is_none(), "no credentials, no uid");
    }

    #[test]
    fn credentials_give_the_real_and_effective_uid() {
        // Context: group_id 9, credentials {real_uid 1000, effective_uid 0 (absent)}, process su.
        let p = b"\n\x0b\x20\x09\x3a\x03\x08\xe8\x07J\x02su\x32\x01/";
        let b = decode(&message(7, p)).unwrap();
        assert_eq!(
            (b["pid"].as_i64(), b["uid"].as_i64(), b["euid"].as_i64()),
            (Some(9), Some(1000), Some(0))
        );
        // An empty credentials message: root all through.
        let p = b"\n\x08\x20\x09\x3a\x00J\x02id\x32\x01/";
        let b = decode(&message(7, p)).unwrap();
        assert_eq!((b["uid"].as_i64(), b["euid"].as_i64()), (Some(0), Some(0)));
    }
}
