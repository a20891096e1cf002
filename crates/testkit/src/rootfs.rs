//! A minimal template rootfs built from host files: the agent, bash and a few coreutils, each
//! with the shared libraries `ldd` names.

use std::path::Path;
use std::process::Command;

use crate::{agent, host};

/// The host tools [`build`] installs (when the host has them).
pub const TOOLS: &[&str] = &[
    "bash", "sh", "cat", "echo", "ls", "id", "sleep", "touch", "rm", "mkdir", "pwd", "env", "head",
];

fn copy_into(root: &Path, src: &Path, dest_in_root: &Path) {
    let dest = root.join(dest_in_root.strip_prefix("/").unwrap_or(dest_in_root));
    std::fs::create_dir_all(dest.parent().expect("a file path has a parent"))
        .unwrap_or_else(|e| panic!("mkdir for {}: {e}", dest.display()));
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

/// A minimal template rootfs at `root`: kiln-agent ([`agent::bin`]) at /usr/bin/kiln-agent,
/// the [`TOOLS`] in /bin and /usr/bin, users root and user (uid 1000), /home/user.
pub fn build(root: &Path) {
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
        std::fs::create_dir_all(root.join(d))
            .unwrap_or_else(|e| panic!("mkdir {}: {e}", root.join(d).display()));
    }
    install_with_libs(root, &agent::bin(), "/usr/bin/kiln-agent");
    for tool in TOOLS {
        if let Some(p) = host::which(tool) {
            install_with_libs(root, &p, &format!("/bin/{tool}"));
            install_with_libs(root, &p, &format!("/usr/bin/{tool}"));
        }
    }
    std::fs::write(
        root.join("etc/passwd"),
        "root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000:user:/home/user:/bin/bash\n",
    )
    .expect("writing etc/passwd");
    std::fs::write(root.join("etc/group"), "root:x:0:\nuser:x:1000:\n").expect("writing etc/group");
    let _ = Command::new("chown")
        .arg("1000:1000")
        .arg(root.join("home/user"))
        .status();
    let _ = Command::new("chmod")
        .arg("1777")
        .arg(root.join("tmp"))
        .status();
}
