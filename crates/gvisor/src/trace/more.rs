//! The trace points of syscall auditing beyond open/execve/connect ([`super`]): `dup2`
//! and `dup3` (what puts a connection on a process's stdio), `accept` and `accept4` (a
//! connection taken on a listening socket), the raw system calls escape probes use (mount,
//! ptrace, module loads, kexec, bpf, namespaces) and the raw `chmod`, `fchmod` and
//! `fchmodat` (with the mode they set), plus [`Sockets`], which tells which descriptors of a
//! process are network connections (made or accepted), so a `dup2` record can say what it
//! duplicated.

use std::collections::HashMap;

use serde_json::{json, Value};

use crate::proto::Field;

/// The raw system calls recorded (number, name): a sandboxed program has no use for them, and
/// they are what escape attempts try first (gVisor refuses most of them).
pub const ESCAPE_SYSCALLS: [(i64, &str); 13] = [
    (101, "ptrace"),
    (155, "pivot_root"),
    (165, "mount"),
    (166, "umount2"),
    (175, "init_module"),
    (176, "delete_module"),
    (246, "kexec_load"),
    (272, "unshare"),
    (298, "perf_event_open"),
    (308, "setns"),
    (313, "finit_module"),
    (320, "kexec_file_load"),
    (321, "bpf"),
];

/// The raw system calls that set a file's mode (number, name, index of the mode argument).
pub const MODE_SYSCALLS: [(i64, &str, usize); 3] =
    [(90, "chmod", 1), (91, "fchmod", 1), (268, "fchmodat", 2)];

const DUP2: i64 = 33;
const ACCEPT: i64 = 43;
const ACCEPT4: i64 = 288;
const DUP3: i64 = 292;
/// A non-blocking connect under way.
const EINPROGRESS: i64 = 115;

/// The message type of raw system calls (`syscall/sysno/N/…` points).
const RAW: u16 = 6;

/// The body of a `dup2`/`dup3` (by its system call number `sysno`) or raw-syscall message
/// (type [`RAW`]), `None` for anything else. Raw messages carry no context (no pid or process
/// name, as runsc sends them).
pub fn decode(kind: u16, sysno: Option<i64>, f: &[Field<'_>]) -> Option<Value> {
    if kind == RAW {
        // Syscall: sysno 4, arg1 … arg6 5 … 10.
        let sysno = f.iter().find_map(|x| x.int(4))?;
        let args: Vec<i64> = (5..=10)
            .map(|k| f.iter().find_map(|x| x.int(k)).unwrap_or(0))
            .collect();
        if let Some((_, name, at)) = MODE_SYSCALLS.iter().find(|(n, _, _)| *n == sysno) {
            // The mode as `chmod` prints it: octal, setuid/setgid/sticky digit first.
            let mode = format!("{:o}", args[*at] & 0o7777);
            return Some(json!({"call": name, "sysno": sysno, "args": args, "mode": mode}));
        }
        let (_, name) = ESCAPE_SYSCALLS.iter().find(|(n, _)| *n == sysno)?;
        return Some(json!({"call": name, "sysno": sysno, "args": args}));
    }
    let sysno = sysno?;
    if sysno == ACCEPT || sysno == ACCEPT4 {
        // Accept: fd 4, fd_path 5, address 6 (the peer), flags 7.
        return Some(json!({
            "call": if sysno == ACCEPT { "accept" } else { "accept4" },
            "fd": f.iter().find_map(|x| x.int(4)),
            "address": f.iter().find_map(|x| x.bytes(6)).filter(|a| !a.is_empty()).map(super::sockaddr),
        }));
    }
    if sysno != DUP2 && sysno != DUP3 {
        return None;
    }
    // Dup: old_fd 4, new_fd 5, fd_path 6, flags 7.
    Some(json!({
        "call": if sysno == DUP2 { "dup2" } else { "dup3" },
        "oldfd": f.iter().find_map(|x| x.int(4)).unwrap_or(0),
        "newfd": f.iter().find_map(|x| x.int(5)).unwrap_or(0),
        "fdPath": f.iter().find_map(|x| x.str(6)).filter(|p| !p.is_empty()),
    }))
}

/// Most descriptors remembered per sandbox (the table starts over beyond).
const MAX: usize = 4096;

/// The network connections each process of one sandbox opened or accepted, by (pid, fd):
/// the peer's address and whether it was accepted, from its `connect` and `accept` records;
/// an `open` or `accept` that returns the descriptor, or a `dup2` over it, ends the entry.
/// (Descriptors closed and reused by calls that are not traced — `socket`, `pipe` — stay
/// known until then.)
#[derive(Default)]
pub struct Sockets(HashMap<(i64, i64), (String, bool)>);

impl Sockets {
    fn put(&mut self, key: (i64, i64), peer: (String, bool)) {
        if self.0.len() >= MAX {
            self.0.clear();
        }
        self.0.insert(key, peer);
    }

    /// Updates the table from `body` and, for a `dup2`/`dup3` of a known connection, adds
    /// its peer's address to the body: `socket` for a connection the process made,
    /// `accepted` for one it accepted.
    pub fn note(&mut self, body: &mut Value) {
        let Some(pid) = body["pid"].as_i64() else {
            return;
        };
        let failed = body.get("errno").is_some();
        match body["call"].as_str().unwrap_or("") {
            "connect" => {
                let (Some(fd), Some(addr)) = (body["fd"].as_i64(), body["address"].as_str()) else {
                    return;
                };
                let inet = !addr.starts_with("unix:") && !addr.starts_with("family");
                let ok = !failed || body["errno"].as_i64() == Some(EINPROGRESS);
                if inet && ok {
                    self.put((pid, fd), (addr.to_string(), false));
                } else {
                    self.0.remove(&(pid, fd));
                }
            }
            "accept" | "accept4" if !failed => {
                let Some(fd) = body["result"].as_i64() else {
                    return;
                };
                match body["address"].as_str() {
                    Some(a) if !a.starts_with("unix:") && !a.starts_with("family") => {
                        self.put((pid, fd), (a.to_string(), true));
                    }
                    _ => {
                        self.0.remove(&(pid, fd));
                    }
                }
            }
            "open" | "openat" if !failed => {
                if let Some(fd) = body["result"].as_i64() {
                    self.0.remove(&(pid, fd));
                }
            }
            "dup2" | "dup3" if !failed => {
                let (Some(old), Some(new)) = (body["oldfd"].as_i64(), body["newfd"].as_i64())
                else {
                    return;
                };
                match self.0.get(&(pid, old)).cloned() {
                    Some((addr, accepted)) => {
                        let key = if accepted { "accepted" } else { "socket" };
                        body[key] = json!(addr);
                        self.0.insert((pid, new), (addr, accepted));
                    }
                    None => {
                        self.0.remove(&(pid, new));
                    }
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dup_and_raw_calls_are_decoded() {
        let dup = [
            Field::Varint(4, 3),
            Field::Varint(5, 1),
            Field::Bytes(6, b"socket:[7]"),
        ];
        assert_eq!(
            decode(19, Some(33), &dup),
            Some(json!({"call": "dup2", "oldfd": 3, "newfd": 1, "fdPath": "socket:[7]"}))
        );
        assert_eq!(decode(19, Some(0), &dup), None);
        // As runsc sent `unshare(CLONE_NEWNS)` failing with EPERM: exit{errno 1}, sysno 272,
        // arg1 0x20000, arg2 and arg3 (no context).
        let raw =
            b"\x12\x02\x10\x01\x20\x90\x02\x28\x80\x80\x08\x30\xc0\xef\x95\xbd\xd4\xdb\x1f\x40\x08";
        let f = crate::proto::fields(raw).unwrap();
        let b = decode(RAW, None, &f).unwrap();
        assert_eq!(
            (b["call"].as_str(), b["sysno"].as_i64()),
            (Some("unshare"), Some(272))
        );
        assert_eq!(b["args"][0], 0x20000);
        // Through the message decoder: the exit's errno is kept.
        let mut m = vec![8, 0, 6, 0, 0, 0, 0, 0];
        m.extend(raw);
        let b = super::super::decode(&m).unwrap();
        assert_eq!(
            (b["call"].as_str(), b["errno"].as_i64()),
            (Some("unshare"), Some(1))
        );
        // A raw call not on the list is not recorded.
        assert_eq!(decode(RAW, None, &[Field::Varint(4, 0)]), None);
        // chmod(path, 04755) and fchmodat(dirfd, path, 0644): the mode in octal.
        let chmod = [
            Field::Varint(4, 90),
            Field::Varint(5, 1),
            Field::Varint(6, 0o4755),
        ];
        let b = decode(RAW, None, &chmod).unwrap();
        assert_eq!(
            (b["call"].as_str(), b["mode"].as_str()),
            (Some("chmod"), Some("4755"))
        );
        let at = [
            Field::Varint(4, 268),
            Field::Varint(6, 7),
            Field::Varint(7, 0o100644),
        ];
        let b = decode(RAW, None, &at).unwrap();
        assert_eq!(
            (b["call"].as_str(), b["mode"].as_str()),
            (Some("fchmodat"), Some("644"))
        );
        // accept4 of a TCP peer.
        let mut addr = vec![2, 0, 0x9c, 0x40, 198, 51, 100, 9];
        addr.extend([0; 8]);
        let acc = [Field::Varint(4, 3), Field::Bytes(6, &addr)];
        let b = decode(12, Some(288), &acc).unwrap();
        assert_eq!(
            (b["call"].as_str(), b["fd"].as_i64(), b["address"].as_str()),
            (Some("accept4"), Some(3), Some("198.51.100.9:40000"))
        );
    }

    #[test]
    fn a_dup_of_an_accepted_connection_names_it_accepted() {
        let mut s = Sockets::default();
        let mut a = json!({"call": "accept4", "pid": 9, "fd": 3, "address": "198.51.100.9:40000", "result": 4});
        s.note(&mut a);
        let mut d = json!({"call": "dup2", "pid": 9, "oldfd": 4, "newfd": 0, "result": 0});
        s.note(&mut d);
        assert_eq!(d["accepted"], "198.51.100.9:40000");
        assert!(d.get("socket").is_none());
        // A Unix peer is not a network connection; a failed accept changes nothing.
        let mut a =
            json!({"call": "accept", "pid": 9, "fd": 3, "address": "unix:/run/x", "result": 5});
        s.note(&mut a);
        let mut f = json!({"call": "accept", "pid": 9, "fd": 3, "result": -1, "errno": 11});
        s.note(&mut f);
        let mut d = json!({"call": "dup2", "pid": 9, "oldfd": 5, "newfd": 1, "result": 1});
        s.note(&mut d);
        assert!(
            d.get("accepted").is_none() && d.get("socket").is_none(),
            "{d}"
        );
    }

    #[test]
    fn a_dup_of_a_connection_names_its_peer() {
        let mut s = Sockets::default();
        let mut c = json!({"call": "connect", "pid": 9, "fd": 3, "address": "198.51.100.7:4444", "result": 0});
        s.note(&mut c);
        let mut d = json!({"call": "dup2", "pid": 9, "oldfd": 3, "newfd": 0, "result": 0});
        s.note(&mut d);
        assert_eq!(d["socket"], "198.51.100.7:4444");
        // The copy on fd 0 is known too; another process's fd 3 is not.
        let mut d = json!({"call": "dup2", "pid": 9, "oldfd": 0, "newfd": 2, "result": 2});
        s.note(&mut d);
        assert_eq!(d["socket"], "198.51.100.7:4444");
        let mut d = json!({"call": "dup2", "pid": 10, "oldfd": 3, "newfd": 0, "result": 0});
        s.note(&mut d);
        assert!(d.get("socket").is_none());
        // A Unix socket, a refused connect, a reused descriptor: not connections.
        for mut c in [
            json!({"call": "connect", "pid": 11, "fd": 4, "address": "unix:/run/x", "result": 0}),
            json!({"call": "connect", "pid": 11, "fd": 5, "address": "198.51.100.7:1", "result": -1, "errno": 111}),
        ] {
            s.note(&mut c);
        }
        let mut o = json!({"call": "openat", "pid": 9, "path": "/tmp/x", "result": 3});
        s.note(&mut o);
        for (pid, old) in [(11, 4), (11, 5), (9, 3)] {
            let mut d = json!({"call": "dup2", "pid": pid, "oldfd": old, "newfd": 1, "result": 1});
            s.note(&mut d);
            assert!(d.get("socket").is_none(), "{d}");
        }
        // A non-blocking connect under way counts.
        let mut c = json!({"call": "connect", "pid": 12, "fd": 6, "address": "198.51.100.7:80", "result": -1, "errno": 115});
        s.note(&mut c);
        let mut d = json!({"call": "dup3", "pid": 12, "oldfd": 6, "newfd": 1, "result": 1});
        s.note(&mut d);
        assert_eq!(d["socket"], "198.51.100.7:80");
    }
}
