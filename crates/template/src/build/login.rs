//! Login shells that start no programs: the SDK runs every command as `/bin/bash -l -c CMD`,
//! and under gVisor each program a profile starts costs milliseconds (docs/speed.md). Stage 2
//! rewrites the two places where Debian's login scripts start one for a non-interactive shell,
//! keeping what they compute:
//!
//! - `/etc/profile` picks root's or a user's `PATH` with `"$(id -u)"`: bash already knows the
//!   effective uid (`$EUID`), so that becomes `"${EUID:-$(id -u)}"` (other shells, which have
//!   no `EUID`, still run `id`).
//! - root's `~/.profile` runs `mesg n`, which only acts on a terminal: it now runs when stdin
//!   is one (`[ -t 0 ]`, a builtin), so PTY shells still get it.
//!
//! Interactive shells (PTY) are untouched: `~/.bashrc` returns at once for a non-interactive
//! shell, and keeps its colours, prompt and completion for an interactive one.

use std::path::Path;

use crate::{io_err, Result};

/// `/etc/profile`'s uid test, and what it becomes.
const ID_CALL: &str = "\"$(id -u)\"";
const ID_BUILTIN: &str = "\"${EUID:-$(id -u)}\"";
/// root's `~/.profile` line, and what it becomes.
const MESG: &str = "mesg n 2> /dev/null || true";
const MESG_ON_TTY: &str = "if [ -t 0 ]; then mesg n 2> /dev/null || true; fi";

/// `/etc/profile` without the `id -u` subprocess for bash.
pub fn profile_text(text: &str) -> String {
    text.replace(ID_CALL, ID_BUILTIN)
}

/// root's `~/.profile` with `mesg` only on a terminal.
pub fn root_profile_text(text: &str) -> String {
    text.lines()
        .map(|l| if l.trim() == MESG { MESG_ON_TTY } else { l })
        .collect::<Vec<_>>()
        .join("\n")
        + if text.ends_with('\n') { "\n" } else { "" }
}

/// Rewrites the login scripts of `rootfs` that exist (see the module docs).
pub(super) fn quiet_login(rootfs: &Path) -> Result<()> {
    rewrite(&rootfs.join("etc/profile"), profile_text)?;
    rewrite(&rootfs.join("root/.profile"), root_profile_text)
}

/// Replaces `path` with `f(text)` when that differs, keeping its mode. The base stage is
/// hard-linked: the entry is replaced, never written through.
fn rewrite(path: &Path, f: fn(&str) -> String) -> Result<()> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(());
    };
    let new = f(&text);
    if new == text {
        return Ok(());
    }
    let meta =
        std::fs::symlink_metadata(path).map_err(io_err(format!("stat {}", path.display())))?;
    if !meta.is_file() {
        return Ok(());
    }
    std::fs::remove_file(path).map_err(io_err(format!("removing {}", path.display())))?;
    std::fs::write(path, new).map_err(io_err(format!("writing {}", path.display())))?;
    std::fs::set_permissions(path, meta.permissions())
        .map_err(io_err(format!("chmod {}", path.display())))?;
    use std::os::unix::fs::MetadataExt;
    std::os::unix::fs::lchown(path, Some(meta.uid()), Some(meta.gid()))
        .map_err(io_err(format!("chown {}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEBIAN_PROFILE: &str = "if [ \"$(id -u)\" -eq 0 ]; then\n  PATH=\"/usr/local/sbin\"\nelse\n  PATH=\"/usr/bin\"\nfi\nexport PATH\n";

    #[test]
    fn profile_uses_euid_and_keeps_id_for_other_shells() {
        let t = profile_text(DEBIAN_PROFILE);
        assert!(
            t.starts_with("if [ \"${EUID:-$(id -u)}\" -eq 0 ]; then\n"),
            "{t}"
        );
        assert_eq!(profile_text(&t), t, "idempotent");
        // The rewritten text picks the same PATH under bash (EUID) and under sh (id -u).
        for shell in ["bash", "sh"] {
            let out = std::process::Command::new(shell)
                .args(["-c", &format!("{t}\necho \"$PATH\"")])
                .output()
                .unwrap();
            // SAFETY: geteuid has no preconditions.
            let want = if unsafe { libc::geteuid() } == 0 {
                "/usr/local/sbin"
            } else {
                "/usr/bin"
            };
            assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), want, "{shell}");
        }
    }

    #[test]
    fn root_profile_runs_mesg_only_on_a_terminal() {
        let text = "if [ \"$BASH\" ]; then\n  . ~/.bashrc\nfi\n\nmesg n 2> /dev/null || true\n";
        let t = root_profile_text(text);
        assert!(
            t.ends_with("\nif [ -t 0 ]; then mesg n 2> /dev/null || true; fi\n"),
            "{t}"
        );
        assert!(t.starts_with("if [ \"$BASH\" ]; then\n"));
        assert_eq!(root_profile_text(&t), t);
    }

    #[test]
    fn rewrite_replaces_a_hard_linked_file_and_keeps_its_mode() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let etc = dir.path().join("etc");
        std::fs::create_dir(&etc).unwrap();
        let shared = dir.path().join("shared");
        std::fs::write(&shared, DEBIAN_PROFILE).unwrap();
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o644)).unwrap();
        std::fs::hard_link(&shared, etc.join("profile")).unwrap();
        quiet_login(dir.path()).unwrap();
        assert_eq!(std::fs::read_to_string(&shared).unwrap(), DEBIAN_PROFILE);
        let got = std::fs::read_to_string(etc.join("profile")).unwrap();
        assert!(got.contains("${EUID:-$(id -u)}"));
        let mode = std::fs::metadata(etc.join("profile"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o644);
    }
}
