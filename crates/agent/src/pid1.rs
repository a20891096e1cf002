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
