//! What the guards look at, and what tests check a host for afterwards.

use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// Whether this process runs as root.
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// `program` on PATH, else in an sbin directory (tests run as root with a user's PATH too).
pub fn which(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let sbin = ["/usr/local/sbin", "/usr/sbin", "/sbin"];
    std::env::split_paths(&path)
        .chain(sbin.iter().map(PathBuf::from))
        .map(|dir| dir.join(program))
        .find(|p| is_executable(p))
}

fn is_executable(p: &Path) -> bool {
    p.metadata()
        .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// The runsc under test: `KILN_RUNSC` (scripts/test.sh exports kiln's pinned one), else runsc
/// on PATH.
pub fn runsc() -> Result<PathBuf, String> {
    match std::env::var_os("KILN_RUNSC").map(PathBuf::from) {
        Some(p) if p.is_file() => Ok(p),
        Some(p) => Err(format!("KILN_RUNSC={} does not exist", p.display())),
        None => which("runsc").ok_or_else(|| {
            "runsc is not installed (`kiln runtime ensure`, or set KILN_RUNSC)".to_string()
        }),
    }
}

/// Whether `/dev/kvm` opens read-write; why not when it does not.
pub fn kvm() -> Result<(), String> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .map(drop)
        .map_err(|e| format!("/dev/kvm cannot be opened ({e}); KVM guests need it"))
}

/// A free TCP port on 127.0.0.1 (free when this returns; a race with other binders is
/// possible but rare).
pub fn free_port() -> u16 {
    free_ports(1)[0]
}

/// `n` distinct free loopback ports (held until all are chosen, then released).
pub fn free_ports(n: usize) -> Vec<u16> {
    let held: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("binding a loopback port"))
        .collect();
    held.iter()
        .map(|l| l.local_addr().expect("a bound port").port())
        .collect()
}

/// Mount points at or under `dir` (from /proc/self/mountinfo).
pub fn mounts_under(dir: &Path) -> Vec<String> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let d = dir.to_string_lossy();
    info.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|mp| mp.starts_with(d.as_ref()))
        .map(str::to_string)
        .collect()
}

/// Command lines of the processes that mention `needle`.
pub fn processes_mentioning(needle: &str) -> Vec<String> {
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .map(|cmd| String::from_utf8_lossy(&cmd).replace('\0', " "))
        .filter(|cmd| cmd.contains(needle))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn which_finds_sh_and_not_nonsense() {
        assert!(which("sh").is_some());
        assert!(which("kiln-no-such-program-xyz").is_none());
    }

    #[test]
    fn free_ports_are_distinct() {
        let p = free_ports(3);
        assert!(p[0] != p[1] && p[1] != p[2] && p[0] != p[2], "{p:?}");
    }

    #[test]
    fn this_process_mentions_itself_and_root_is_mounted() {
        let me = std::env::args().next().unwrap();
        assert!(!processes_mentioning(&me).is_empty());
        assert!(mounts_under(Path::new("/")).contains(&"/".to_string()));
    }
}
