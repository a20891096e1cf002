//! User lookup from /etc/passwd and /etc/group (no NSS: the agent is a static binary), and
//! switching the filesystem identity of the current thread.

use std::io;
use std::path::{Path, PathBuf};

/// A resolved local user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: PathBuf,
    pub shell: String,
    /// Supplementary groups (including the primary group).
    pub groups: Vec<u32>,
}

/// Error looking a user up.
#[derive(Debug, thiserror::Error)]
pub enum UserError {
    #[error("user {0:?} does not exist in /etc/passwd")]
    NotFound(String),
    #[error("cannot read {path}: {source}")]
    Read { path: String, source: io::Error },
}

fn read(path: &str) -> Result<String, UserError> {
    std::fs::read_to_string(path).map_err(|source| UserError::Read {
        path: path.into(),
        source,
    })
}

/// Look `name` up (a numeric name is also accepted as a uid).
pub fn lookup(name: &str) -> Result<User, UserError> {
    lookup_in(name, Path::new("/etc/passwd"), Path::new("/etc/group"))
}

/// Look a user up by uid.
pub fn lookup_uid(uid: u32) -> Result<User, UserError> {
    lookup(&uid.to_string())
}

fn lookup_in(name: &str, passwd: &Path, group: &Path) -> Result<User, UserError> {
    let pw = read(&passwd.to_string_lossy())?;
    let by_uid: Option<u32> = name.parse().ok();
    for line in pw.lines() {
        let f: Vec<&str> = line.split(':').collect();
        if f.len() < 7 || line.starts_with('#') {
            continue;
        }
        let (Ok(uid), Ok(gid)) = (f[2].parse::<u32>(), f[3].parse::<u32>()) else {
            continue;
        };
        if f[0] == name
            || (by_uid == Some(uid) && !pw.lines().any(|l| l.split(':').next() == Some(name)))
        {
            let mut groups = vec![gid];
            if let Ok(gr) = read(&group.to_string_lossy()) {
                for gl in gr.lines() {
                    let g: Vec<&str> = gl.split(':').collect();
                    if g.len() < 4 {
                        continue;
                    }
                    let Ok(ggid) = g[2].parse::<u32>() else {
                        continue;
                    };
                    if g[3].split(',').any(|m| m == f[0]) && !groups.contains(&ggid) {
                        groups.push(ggid);
                    }
                }
            }
            return Ok(User {
                name: f[0].to_string(),
                uid,
                gid,
                home: PathBuf::from(if f[5].is_empty() { "/" } else { f[5] }),
                shell: f[6].to_string(),
                groups,
            });
        }
    }
    Err(UserError::NotFound(name.to_string()))
}

/// Name of the group `gid` (or the number as text).
pub fn group_name(gid: u32) -> String {
    name_of("/etc/group", gid)
}

/// Name of the user `uid` (or the number as text).
pub fn user_name(uid: u32) -> String {
    name_of("/etc/passwd", uid)
}

fn name_of(file: &str, id: u32) -> String {
    if let Ok(s) = std::fs::read_to_string(file) {
        for line in s.lines() {
            let f: Vec<&str> = line.split(':').collect();
            if f.len() >= 3 && f[2].parse::<u32>().ok() == Some(id) {
                return f[0].to_string();
            }
        }
    }
    id.to_string()
}

/// Run `f` on the current thread with the identity (effective uid/gid, hence fsuid/fsgid, and
/// supplementary groups) of `user`, then restore root. Only has an effect when the agent runs as
/// root. The calls are raw per-thread syscalls (the glibc wrappers would broadcast the change
/// to all threads), so other threads are unaffected; the saved uid stays 0 so the switch back
/// is always permitted. Effective ids are used rather than setfsuid because gVisor does not
/// honour setfsuid. Call from a blocking thread only.
pub fn with_fs_identity<T>(user: &User, f: impl FnOnce() -> T) -> T {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    if euid != 0 || user.uid == 0 {
        return f();
    }
    // SAFETY: getgroups with a correctly sized buffer; we only read back `n` entries.
    let saved: Vec<libc::gid_t> = unsafe {
        let n = libc::getgroups(0, std::ptr::null_mut());
        let mut v = vec![0; n.max(0) as usize];
        let n = libc::getgroups(v.len() as i32, v.as_mut_ptr());
        v.truncate(n.max(0) as usize);
        v
    };
    struct Restore(Vec<libc::gid_t>);
    impl Drop for Restore {
        fn drop(&mut self) {
            // SAFETY: back to root: the saved set-user-ID is still 0, so this is permitted;
            // the group calls need the restored root euid and come second.
            unsafe {
                libc::syscall(libc::SYS_setresuid, -1i64, 0i64, -1i64);
                libc::syscall(libc::SYS_setresgid, -1i64, 0i64, -1i64);
                libc::syscall(libc::SYS_setgroups, self.0.len(), self.0.as_ptr());
            }
        }
    }
    let _restore = Restore(saved);
    // SAFETY: raw per-thread credential syscalls with valid pointers/lengths; groups and gid
    // first, while still root.
    unsafe {
        libc::syscall(libc::SYS_setgroups, user.groups.len(), user.groups.as_ptr());
        libc::syscall(libc::SYS_setresgid, -1i64, user.gid as i64, -1i64);
        libc::syscall(libc::SYS_setresuid, -1i64, user.uid as i64, -1i64);
    }
    f()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_passwd_and_groups() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("passwd");
        let g = d.path().join("group");
        std::fs::write(
            &p,
            "root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/home/user:/bin/bash\n",
        )
        .unwrap();
        std::fs::write(
            &g,
            "root:x:0:\nuser:x:1000:\nsudo:x:27:user\nwheel:x:10:a,user,b\n",
        )
        .unwrap();
        let u = lookup_in("user", &p, &g).unwrap();
        assert_eq!(u.uid, 1000);
        assert_eq!(u.home, PathBuf::from("/home/user"));
        assert_eq!(u.groups, vec![1000, 27, 10]);
        assert_eq!(lookup_in("0", &p, &g).unwrap().name, "root");
        assert!(matches!(
            lookup_in("nobody", &p, &g),
            Err(UserError::NotFound(_))
        ));
    }
}
