//! What kiln adds to an unpacked image so E2B's conventions hold: the user `user` (uid 1000
//! when free) with a home, no password and passwordless sudo through kiln's sudo broker
//! (`/etc/sudoers.d/kiln-user`, `/usr/bin/sudo` → kiln-agent), and the user/workdir the
//! image's config names resolved against its own `/etc/passwd`. Files are edited by writing a
//! new file and renaming it over the old one (the image stage is hard-linked into each
//! template and must never change), always resolved inside the root.

use std::os::unix::fs::{lchown, PermissionsExt};
use std::path::{Path, PathBuf};

use super::rootpath::{resolve, Resolve};
use super::OciError;

/// E2B's default user.
pub const DEFAULT_USER: &str = "user";
const DEFAULT_UID: u32 = 1000;
const SUDOERS_RULE: &str = "user ALL=(ALL:ALL) NOPASSWD: ALL\n";

/// A `/etc/passwd` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PasswdEntry {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: String,
}

fn inside(root: &Path, path: &str) -> Result<PathBuf, OciError> {
    resolve(
        root,
        Path::new(path),
        Resolve {
            follow_last: true,
            create_parents: true,
        },
    )
}

/// Like [`inside`], but a symlink in the last component is the answer (to be replaced).
fn entry_inside(root: &Path, path: &str) -> Result<PathBuf, OciError> {
    resolve(
        root,
        Path::new(path),
        Resolve {
            follow_last: false,
            create_parents: true,
        },
    )
}

fn read_lines(p: &Path) -> Vec<String> {
    std::fs::read_to_string(p)
        .map(|t| t.lines().map(str::to_string).collect())
        .unwrap_or_default()
}

/// Replaces `p` with `text` (new inode), mode `mode`, owned by root.
fn replace_file(p: &Path, text: &str, mode: u32) -> Result<(), OciError> {
    let dir = p.parent().unwrap_or(Path::new("/"));
    let tmp = dir.join(format!(
        ".kiln-{}",
        p.file_name().unwrap_or_default().to_string_lossy()
    ));
    let _ = std::fs::remove_file(&tmp);
    std::fs::write(&tmp, text)
        .map_err(|e| OciError::io(format!("writing {}", tmp.display()), e))?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode))
        .map_err(|e| OciError::io(format!("chmod {}", tmp.display()), e))?;
    lchown(&tmp, Some(0), Some(0))
        .map_err(|e| OciError::io(format!("chown {}", tmp.display()), e))?;
    std::fs::rename(&tmp, p).map_err(|e| OciError::io(format!("replacing {}", p.display()), e))
}

fn append_line(p: &Path, line: &str, mode: u32) -> Result<(), OciError> {
    let mut text = std::fs::read_to_string(p).unwrap_or_default();
    if !text.is_empty() && !text.ends_with('\n') {
        text.push('\n');
    }
    text.push_str(line);
    text.push('\n');
    let mode = p
        .symlink_metadata()
        .map(|m| m.permissions().mode() & 0o7777)
        .unwrap_or(mode);
    replace_file(p, &text, mode)
}

/// The entries of the image's `/etc/passwd`.
pub fn passwd(root: &Path) -> Result<Vec<PasswdEntry>, OciError> {
    let p = inside(root, "/etc/passwd")?;
    Ok(read_lines(&p)
        .iter()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            if f.len() < 7 {
                return None;
            }
            Some(PasswdEntry {
                name: f[0].to_string(),
                uid: f[2].parse().ok()?,
                gid: f[3].parse().ok()?,
                home: f[5].to_string(),
            })
        })
        .collect())
}

fn group_ids(root: &Path) -> Result<Vec<(String, u32)>, OciError> {
    let p = inside(root, "/etc/group")?;
    Ok(read_lines(&p)
        .iter()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            Some((f.first()?.to_string(), f.get(2)?.parse().ok()?))
        })
        .collect())
}

/// Creates `user` unless the image has it; returns its entry.
pub fn ensure_default_user(root: &Path) -> Result<PasswdEntry, OciError> {
    let users = passwd(root)?;
    if let Some(u) = users.iter().find(|u| u.name == DEFAULT_USER) {
        return Ok(u.clone());
    }
    let groups = group_ids(root)?;
    let free = |taken: &dyn Fn(u32) -> bool| {
        (DEFAULT_UID..60000)
            .find(|id| !taken(*id))
            .unwrap_or(DEFAULT_UID)
    };
    let uid = free(&|id| users.iter().any(|u| u.uid == id));
    let gid = match groups.iter().find(|(n, _)| n == DEFAULT_USER) {
        Some((_, g)) => *g,
        None => {
            let gid = if groups.iter().any(|(_, g)| *g == uid) {
                free(&|id| groups.iter().any(|(_, g)| *g == id))
            } else {
                uid
            };
            append_line(
                &inside(root, "/etc/group")?,
                &format!("{DEFAULT_USER}:x:{gid}:"),
                0o644,
            )?;
            gid
        }
    };
    let home = format!("/home/{DEFAULT_USER}");
    append_line(
        &inside(root, "/etc/passwd")?,
        &format!("{DEFAULT_USER}:x:{uid}:{gid}::{home}:/bin/bash"),
        0o644,
    )?;
    let shadow = inside(root, "/etc/shadow")?;
    if shadow.exists() {
        append_line(
            &shadow,
            &format!("{DEFAULT_USER}::19000:0:99999:7:::"),
            0o640,
        )?;
    }
    let home_dir = inside(root, &home)?;
    if home_dir.symlink_metadata().is_err() {
        std::fs::create_dir(&home_dir)
            .map_err(|e| OciError::io(format!("creating {}", home_dir.display()), e))?;
        copy_skel(root, &home_dir, uid, gid)?;
    }
    lchown(&home_dir, Some(uid), Some(gid))
        .map_err(|e| OciError::io(format!("chown {}", home_dir.display()), e))?;
    std::fs::set_permissions(&home_dir, std::fs::Permissions::from_mode(0o750))
        .map_err(|e| OciError::io(format!("chmod {}", home_dir.display()), e))?;
    Ok(PasswdEntry {
        name: DEFAULT_USER.into(),
        uid,
        gid,
        home,
    })
}

/// Top-level regular files of `/etc/skel` (`.bashrc`, `.profile`) into the new home.
fn copy_skel(root: &Path, home: &Path, uid: u32, gid: u32) -> Result<(), OciError> {
    let skel = inside(root, "/etc/skel")?;
    let Ok(entries) = std::fs::read_dir(&skel) else {
        return Ok(());
    };
    for e in entries.flatten() {
        if !e.file_type().is_ok_and(|t| t.is_file()) {
            continue;
        }
        let dest = home.join(e.file_name());
        std::fs::copy(e.path(), &dest)
            .map_err(|err| OciError::io(format!("copying {}", e.path().display()), err))?;
        lchown(&dest, Some(uid), Some(gid))
            .map_err(|err| OciError::io(format!("chown {}", dest.display()), err))?;
    }
    Ok(())
}

/// Passwordless sudo for `user` through kiln's broker: the sudoers rule (and `/etc/sudoers`
/// including `/etc/sudoers.d` when the image lacks it) and `/usr/bin/sudo` → kiln-agent.
pub fn install_sudo(root: &Path) -> Result<(), OciError> {
    let sudoers = inside(root, "/etc/sudoers")?;
    let text = std::fs::read_to_string(&sudoers).unwrap_or_default();
    let includes = text.lines().any(|l| {
        let l = l.trim();
        l.starts_with("@includedir /etc/sudoers.d") || l.starts_with("#includedir /etc/sudoers.d")
    });
    if text.is_empty() {
        replace_file(
            &sudoers,
            "root ALL=(ALL:ALL) ALL\n@includedir /etc/sudoers.d\n",
            0o440,
        )?;
    } else if !includes {
        append_line(&sudoers, "@includedir /etc/sudoers.d", 0o440)?;
    }
    let rule = inside(root, "/etc/sudoers.d/kiln-user")?;
    replace_file(&rule, SUDOERS_RULE, 0o440)?;
    let sudo = entry_inside(root, "/usr/bin/sudo")?;
    if sudo.symlink_metadata().is_ok() {
        std::fs::remove_file(&sudo)
            .map_err(|e| OciError::io(format!("removing {}", sudo.display()), e))?;
    }
    std::os::unix::fs::symlink("kiln-agent", &sudo)
        .map_err(|e| OciError::io(format!("linking {} to kiln-agent", sudo.display()), e))
}

/// Copies the agent to `/usr/bin/kiln-agent` inside the root (a new inode).
pub fn install_agent(root: &Path, agent: &Path) -> Result<(), OciError> {
    let dest = entry_inside(root, "/usr/bin/kiln-agent")?;
    let _ = std::fs::remove_file(&dest);
    std::fs::copy(agent, &dest).map_err(|e| {
        OciError::io(
            format!("copying {} to {}", agent.display(), dest.display()),
            e,
        )
    })?;
    std::fs::set_permissions(&dest, std::fs::Permissions::from_mode(0o755))
        .map_err(|e| OciError::io("chmod kiln-agent", e))
}

/// Mount points and `/tmp` that sandboxes expect, created when the image lacks them.
pub fn ensure_dirs(root: &Path) -> Result<(), OciError> {
    for (d, mode) in [
        ("proc", 0o555),
        ("sys", 0o555),
        ("dev", 0o755),
        ("run", 0o755),
        ("tmp", 0o1777),
        ("home", 0o755),
    ] {
        let p = inside(root, d)?;
        if p.symlink_metadata().is_err() {
            std::fs::create_dir(&p)
                .map_err(|e| OciError::io(format!("creating {}", p.display()), e))?;
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode))
                .map_err(|e| OciError::io(format!("chmod {}", p.display()), e))?;
        }
    }
    Ok(())
}

/// The image's `User` (`name`, `uid`, `name:group`, `uid:gid`) as a user name of its passwd.
pub fn user_name(root: &Path, user: &str) -> Result<String, OciError> {
    let u = user.split(':').next().unwrap_or(user);
    let users = passwd(root)?;
    let found = match u.parse::<u32>() {
        Ok(uid) => users.iter().find(|e| e.uid == uid),
        Err(_) => users.iter().find(|e| e.name == u),
    };
    found.map(|e| e.name.clone()).ok_or_else(|| {
        OciError::Invalid(format!(
            "the image's config sets User {user:?}, which its /etc/passwd does not have"
        ))
    })
}

/// Fails unless `/bin/bash` exists in the root (the E2B SDK runs every command through
/// `/bin/bash -l -c`).
pub fn require_bash(root: &Path, image: &str) -> Result<(), OciError> {
    let bash = resolve(
        root,
        Path::new("/bin/bash"),
        Resolve {
            follow_last: true,
            create_parents: false,
        },
    );
    match bash {
        Ok(p) if p.is_file() => Ok(()),
        _ => Err(OciError::Invalid(format!(
            "{image} has no /bin/bash: kiln and the E2B SDK run every command through `/bin/bash -l -c`. \
             Use an image that has bash (e.g. install it: `apk add bash`, `apt-get install bash`) or build one FROM it"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root_with(passwd: &str, group: &str) -> tempfile::TempDir {
        let t = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(t.path().join("etc/skel")).unwrap();
        std::fs::write(t.path().join("etc/passwd"), passwd).unwrap();
        std::fs::write(t.path().join("etc/group"), group).unwrap();
        std::fs::write(t.path().join("etc/skel/.bashrc"), "# hi\n").unwrap();
        t
    }

    #[test]
    fn user_is_created_with_uid_1000_when_free() {
        let t = root_with("root:x:0:0:root:/root:/bin/sh\n", "root:x:0:\n");
        let before = std::fs::symlink_metadata(t.path().join("etc/passwd")).unwrap();
        let u = ensure_default_user(t.path()).unwrap();
        assert_eq!((u.uid, u.gid, u.home.as_str()), (1000, 1000, "/home/user"));
        let p = std::fs::read_to_string(t.path().join("etc/passwd")).unwrap();
        assert!(
            p.ends_with("user:x:1000:1000::/home/user:/bin/bash\n"),
            "{p}"
        );
        // Replaced, not written through (the stage below is hard-linked).
        use std::os::unix::fs::MetadataExt;
        let after = std::fs::symlink_metadata(t.path().join("etc/passwd")).unwrap();
        assert_ne!(before.ino(), after.ino());
        assert!(std::fs::read_to_string(t.path().join("etc/group"))
            .unwrap()
            .contains("user:x:1000:"));
        assert!(t.path().join("home/user/.bashrc").is_file());
        // A second call finds it.
        assert_eq!(ensure_default_user(t.path()).unwrap(), u);
        assert_eq!(user_name(t.path(), "1000:1000").unwrap(), "user");
        assert!(user_name(t.path(), "nobody").is_err());
    }

    #[test]
    fn taken_uid_moves_on() {
        let t = root_with(
            "root:x:0:0:root:/root:/bin/sh\nnode:x:1000:1000::/home/node:/bin/sh\n",
            "root:x:0:\nnode:x:1000:\n",
        );
        let u = ensure_default_user(t.path()).unwrap();
        assert_eq!((u.uid, u.gid), (1001, 1001));
    }

    #[test]
    fn sudo_goes_through_the_agent_and_bash_is_required() {
        let t = root_with("root:x:0:0:root:/root:/bin/sh\n", "root:x:0:\n");
        std::fs::create_dir_all(t.path().join("usr/bin")).unwrap();
        install_sudo(t.path()).unwrap();
        assert_eq!(
            std::fs::read_link(t.path().join("usr/bin/sudo")).unwrap(),
            Path::new("kiln-agent")
        );
        let s = std::fs::read_to_string(t.path().join("etc/sudoers")).unwrap();
        assert!(s.contains("@includedir /etc/sudoers.d"), "{s}");
        assert_eq!(
            std::fs::read_to_string(t.path().join("etc/sudoers.d/kiln-user")).unwrap(),
            SUDOERS_RULE
        );
        let e = require_bash(t.path(), "img").unwrap_err().to_string();
        assert!(e.contains("img has no /bin/bash"), "{e}");
        std::os::unix::fs::symlink("usr/bin", t.path().join("bin")).unwrap();
        std::fs::write(t.path().join("usr/bin/bash"), "").unwrap();
        require_bash(t.path(), "img").unwrap();
    }
}
