//! Duties when running as PID 1: mount the basic filesystems and forward termination signals.

use std::path::Path;

fn mounted(target: &str) -> bool {
    std::fs::read_to_string("/proc/self/mounts")
        .map(|m| {
            m.lines()
                .any(|l| l.split_whitespace().nth(1) == Some(target))
        })
        .unwrap_or(false)
}

fn mount(src: &str, target: &str, fstype: &str, flags: nix::mount::MsFlags, data: Option<&str>) {
    if Path::new("/proc/self/mounts").exists() && mounted(target) {
        return;
    }
    let _ = std::fs::create_dir_all(target);
    if let Err(e) = nix::mount::mount(Some(src), target, Some(fstype), flags, data) {
        tracing::warn!("cannot mount {fstype} on {target}: {e}");
    }
}

/// Mount /proc, /sys, /dev, /dev/pts, /dev/shm and /tmp when missing.
pub fn mount_basics() {
    use nix::mount::MsFlags as F;
    let nosuid = F::MS_NOSUID | F::MS_NODEV | F::MS_NOEXEC;
    mount("proc", "/proc", "proc", nosuid, None);
    mount("sysfs", "/sys", "sysfs", nosuid, None);
    if !Path::new("/dev/null").exists() {
        mount(
            "devtmpfs",
            "/dev",
            "devtmpfs",
            F::MS_NOSUID,
            Some("mode=0755"),
        );
    }
    mount(
        "devpts",
        "/dev/pts",
        "devpts",
        F::MS_NOSUID | F::MS_NOEXEC,
        Some("mode=0620,ptmxmode=0666"),
    );
    if !Path::new("/dev/ptmx").exists() {
        let _ = std::os::unix::fs::symlink("pts/ptmx", "/dev/ptmx");
    }
    mount(
        "shm",
        "/dev/shm",
        "tmpfs",
        F::MS_NOSUID | F::MS_NODEV,
        Some("mode=1777"),
    );
    if !mounted("/tmp") {
        // Only mount a tmpfs on /tmp when it is missing or not writable.
        let writable = std::fs::create_dir_all("/tmp").is_ok() && tempfile_probe("/tmp");
        if !writable {
            mount(
                "tmpfs",
                "/tmp",
                "tmpfs",
                F::MS_NOSUID | F::MS_NODEV,
                Some("mode=1777"),
            );
        }
    }
}

/// The `/etc/hosts` a sandbox gets when its root filesystem has none (Debian's minbase
/// variant ships none): without it `localhost` does not resolve for glibc programs.
pub fn etc_hosts_text(hostname: &str) -> String {
    let mut text = String::from(
        "# Written by kiln-agent at boot: the root filesystem had no /etc/hosts.\n\
         127.0.0.1\tlocalhost\n\
         ::1\tlocalhost ip6-localhost ip6-loopback\n\
         ff02::1\tip6-allnodes\n\
         ff02::2\tip6-allrouters\n",
    );
    let name = hostname.trim();
    let valid = !name.is_empty()
        && name.len() <= 253
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.');
    if valid && name != "localhost" {
        text.push_str(&format!("127.0.1.1\t{name}\n"));
    }
    text
}

/// Writes [`etc_hosts_text`] to `<root>/etc/hosts` unless something (a file, a link) is
/// there already. Returns whether it wrote.
pub fn ensure_etc_hosts_in(root: &Path, hostname: &str) -> std::io::Result<bool> {
    use std::io::Write;
    let path = root.join("etc/hosts");
    if path.symlink_metadata().is_ok() {
        return Ok(false);
    }
    let mut f = match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => return Ok(false),
        Err(e) => return Err(e),
    };
    f.write_all(etc_hosts_text(hostname).as_bytes())?;
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o644))?;
    Ok(true)
}

/// [`ensure_etc_hosts_in`] for the sandbox's own root, with its host name (PID 1 at boot).
pub fn ensure_etc_hosts() {
    let hostname = nix::unistd::gethostname()
        .map(|h| h.to_string_lossy().into_owned())
        .unwrap_or_default();
    if let Err(e) = ensure_etc_hosts_in(Path::new("/"), &hostname) {
        tracing::warn!("cannot write /etc/hosts: {e}");
    }
}

/// Writes a fresh `<root>/etc/machine-id` (32 lowercase hex digits, as systemd makes at first
/// boot) when the file is missing or empty — images built for containers ship it empty — so
/// D-Bus sessions and dconf work. `id` is the random source (a UUID's hex digits). Returns
/// whether it wrote.
pub fn ensure_machine_id_in(root: &Path, id: &str) -> std::io::Result<bool> {
    let path = root.join("etc/machine-id");
    match std::fs::read(&path) {
        Ok(b) if !b.iter().all(|c| c.is_ascii_whitespace()) => return Ok(false),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let hex: String = id
        .chars()
        .filter(|c| c.is_ascii_hexdigit())
        .map(|c| c.to_ascii_lowercase())
        .take(32)
        .collect();
    if hex.len() != 32 {
        return Err(std::io::Error::other("no random machine id available"));
    }
    // A new file renamed into place: the old one may be a hard link into the template.
    let tmp = root.join("etc/.machine-id.kiln");
    std::fs::write(&tmp, format!("{hex}\n"))?;
    std::fs::set_permissions(&tmp, std::os::unix::fs::PermissionsExt::from_mode(0o444))?;
    std::fs::rename(&tmp, &path)?;
    Ok(true)
}

/// [`ensure_machine_id_in`] for the sandbox's own root (PID 1 at boot), from the kernel's
/// random UUID.
pub fn ensure_machine_id() {
    let id = std::fs::read_to_string("/proc/sys/kernel/random/uuid").unwrap_or_default();
    if let Err(e) = ensure_machine_id_in(Path::new("/"), &id) {
        tracing::warn!("cannot write /etc/machine-id: {e}");
    }
}

fn tempfile_probe(dir: &str) -> bool {
    let p = Path::new(dir).join(format!(".kiln-agent-probe-{}", std::process::id()));
    let ok = std::fs::write(&p, b"").is_ok();
    let _ = std::fs::remove_file(&p);
    ok
}

/// Send `sig` to every process we can see except ourselves (used by PID 1 at shutdown).
pub fn signal_all(sig: i32) {
    // SAFETY: kill(-1, sig) signals every process except init (us) when we are PID 1.
    unsafe {
        libc::kill(-1, sig);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_name_localhost_and_the_host() {
        let t = etc_hosts_text("isb4xk2m0");
        assert!(t.contains("127.0.0.1\tlocalhost\n"), "{t}");
        assert!(t.contains("::1\tlocalhost ip6-localhost"), "{t}");
        assert!(t.ends_with("127.0.1.1\tisb4xk2m0\n"), "{t}");
        assert!(!etc_hosts_text("").contains("127.0.1.1"));
        assert!(!etc_hosts_text("bad name\n1.2.3.4 evil").contains("evil"));
    }

    #[test]
    fn machine_id_written_when_missing_or_empty() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("etc")).unwrap();
        let p = d.path().join("etc/machine-id");
        let uuid = "0F8FAD5B-D9CB-469F-A165-70867728950E\n";
        assert!(ensure_machine_id_in(d.path(), uuid).unwrap());
        assert_eq!(
            std::fs::read_to_string(&p).unwrap(),
            "0f8fad5bd9cb469fa16570867728950e\n"
        );
        // Kept once it holds an id; written again over an empty one.
        assert!(!ensure_machine_id_in(d.path(), "ffffffff-ffff-ffff-ffff-ffffffffffff").unwrap());
        std::fs::remove_file(&p).unwrap();
        std::fs::write(&p, "\n").unwrap();
        assert!(ensure_machine_id_in(d.path(), uuid).unwrap());
        // No random digits to use: an error, nothing written.
        std::fs::remove_file(&p).unwrap();
        assert!(ensure_machine_id_in(d.path(), "short").is_err());
        assert!(!p.exists());
    }

    #[test]
    fn hosts_written_only_when_missing() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("etc")).unwrap();
        assert!(ensure_etc_hosts_in(d.path(), "sbx").unwrap());
        let p = d.path().join("etc/hosts");
        assert!(std::fs::read_to_string(&p).unwrap().contains("\tsbx\n"));
        std::fs::write(&p, "10.0.0.1 mine\n").unwrap();
        assert!(!ensure_etc_hosts_in(d.path(), "sbx").unwrap());
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "10.0.0.1 mine\n");
        // A dangling link is the image's choice too.
        std::fs::remove_file(&p).unwrap();
        std::os::unix::fs::symlink("/nonexistent", &p).unwrap();
        assert!(!ensure_etc_hosts_in(d.path(), "sbx").unwrap());
    }
}
