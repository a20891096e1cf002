//! Shared helpers of the server's integration tests: a minimal template rootfs built from the
//! kiln-agent binary plus a few host tools (with their shared libraries).

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// The kiln-agent binary: `KILN_AGENT_BIN` (set by scripts/test.sh).
pub fn agent_bin() -> PathBuf {
    let p = std::env::var_os("KILN_AGENT_BIN").map(PathBuf::from).unwrap_or_else(|| {
        panic!(
            "KILN_AGENT_BIN is not set: build the static agent (RUSTFLAGS=\"-C target-feature=+crt-static\" \
             cargo build --release -p kiln-agent --target x86_64-unknown-linux-gnu) and point \
             KILN_AGENT_BIN at it (scripts/test.sh does)"
        )
    });
    assert!(p.is_file(), "KILN_AGENT_BIN={} does not exist", p.display());
    p
}

/// Panics with a clear message unless this test can run real sandboxes.
pub fn require_runsc_root() {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    assert!(
        root,
        "this test runs real gVisor sandboxes and must run as root"
    );
    assert!(
        kiln_host::prereq::which("runsc").is_some(),
        "runsc is not installed (apt-get install runsc)"
    );
}

fn copy_into(root: &Path, src: &Path, dest_in_root: &Path) {
    let dest = root.join(dest_in_root.strip_prefix("/").unwrap_or(dest_in_root));
    std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
    if !dest.exists() {
        std::fs::copy(src, &dest).unwrap_or_else(|e| panic!("copy {}: {e}", src.display()));
    }
}

/// Copies `bin` to `dest` inside `root` with every shared library it needs (per ldd).
pub fn install_with_libs(root: &Path, bin: &Path, dest: &str) {
    copy_into(root, bin, Path::new(dest));
    let out = Command::new("ldd").arg(bin).output().expect("running ldd");
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        // "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x…)" or "/lib64/ld-linux-x86-64.so.2 (0x…)"
        let path = line
            .split("=>")
            .nth(1)
            .unwrap_or(line)
            .split_whitespace()
            .next()
            .unwrap_or("");
        if path.starts_with('/') {
            let p = Path::new(path);
            copy_into(root, p, p);
            // Keep the canonical location too (symlinked lib dirs).
            if let Ok(real) = std::fs::canonicalize(p) {
                copy_into(root, &real, &real);
            }
        }
    }
}

/// A minimal template rootfs: kiln-agent at /usr/bin/kiln-agent, bash and a few coreutils,
/// users root and user (uid 1000), /home/user.
pub fn build_rootfs(root: &Path) {
    for d in [
        "proc",
        "dev",
        "sys",
        "tmp",
        "run",
        "root",
        "etc",
        "home/user",
        "usr/bin",
        "bin",
    ] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    install_with_libs(root, &agent_bin(), "/usr/bin/kiln-agent");
    for tool in [
        "bash", "sh", "cat", "echo", "ls", "id", "sleep", "touch", "rm", "mkdir", "pwd", "env",
        "head",
    ] {
        if let Some(p) = kiln_host::prereq::which(tool) {
            install_with_libs(root, &p, &format!("/bin/{tool}"));
            install_with_libs(root, &p, &format!("/usr/bin/{tool}"));
        }
    }
    std::fs::write(
        root.join("etc/passwd"),
        "root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000:user:/home/user:/bin/bash\n",
    )
    .unwrap();
    std::fs::write(root.join("etc/group"), "root:x:0:\nuser:x:1000:\n").unwrap();
    let _ = Command::new("chown")
        .args(["1000:1000", root.join("home/user").to_str().unwrap()])
        .status();
    let _ = Command::new("chmod")
        .args(["1777", root.join("tmp").to_str().unwrap()])
        .status();
}

/// Whether anything is mounted at or under `dir`.
pub fn mounts_under(dir: &Path) -> Vec<String> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let d = dir.to_string_lossy().to_string();
    info.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|mp| mp.starts_with(&d))
        .map(str::to_string)
        .collect()
}

/// Processes whose command line mentions `needle`.
pub fn processes_mentioning(needle: &str) -> Vec<String> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir("/proc") {
        for e in rd.flatten() {
            if let Ok(cmd) = std::fs::read(e.path().join("cmdline")) {
                let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
                if cmd.contains(needle) {
                    out.push(cmd);
                }
            }
        }
    }
    out
}
