//! Host prerequisites: which programs each job needs, which Debian package provides each, and
//! installing the missing ones with apt when kiln runs as root on Debian/Ubuntu.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A program kiln runs, and the Debian package that ships it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tool {
    pub program: &'static str,
    pub package: &'static str,
    pub why: &'static str,
}

const MKFS_EXT4: Tool = Tool {
    program: "mkfs.ext4",
    package: "e2fsprogs",
    why: "per-sandbox disk quota images (--disk-mb), microVM template images",
};
const LOSETUP: Tool = Tool {
    program: "losetup",
    package: "mount",
    why: "loop-mounting the per-sandbox disk quota images",
};
const MOUNT: Tool = Tool {
    program: "mount",
    package: "mount",
    why: "loop-mounting the per-sandbox disk quota images",
};

/// Programs the per-sandbox disk quota (`kiln serve --disk-mb`, on by default) runs; part of
/// [`SERVE_TOOLS`], checked on their own by `kiln serve --no-prepare`.
pub const DISK_TOOLS: &[Tool] = &[MKFS_EXT4, LOSETUP, MOUNT];

/// Programs `kiln serve` (and the test suite) need on the host. runsc is not among them: Debian
/// bookworm's own is too old, kiln obtains a recent one itself (see [`crate::runsc`]).
pub const SERVE_TOOLS: &[Tool] = &[
    Tool {
        program: "mmdebstrap",
        package: "mmdebstrap",
        why: "building template root filesystems",
    },
    MKFS_EXT4,
    LOSETUP,
    MOUNT,
    Tool {
        program: "nft",
        package: "nftables",
        why: "sandbox egress policy",
    },
    Tool {
        program: "ip",
        package: "iproute2",
        why: "sandbox network namespaces",
    },
];

#[derive(Debug, thiserror::Error)]
pub enum PrereqError {
    #[error(
        "missing host programs: {missing}. Install them with:\n    {command}\n(kiln installs them itself when run as root on Debian/Ubuntu)"
    )]
    Missing { missing: String, command: String },
    #[error("`{command}` failed with {status}; run it by hand to see why, then start kiln again")]
    AptFailed { command: String, status: String },
    #[error("could not run apt-get: {0}")]
    Spawn(#[from] std::io::Error),
}

/// Finds `program` on `$PATH` (plus the sbin directories, which are not on a user's PATH).
pub fn which(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let extra = ["/usr/local/sbin", "/usr/sbin", "/sbin"];
    std::env::split_paths(&path)
        .chain(extra.iter().map(PathBuf::from))
        .map(|dir| dir.join(program))
        .find(|p| is_executable(p))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    p.metadata()
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// The tools in `tools` that are not installed.
pub fn missing(tools: &[Tool]) -> Vec<Tool> {
    tools
        .iter()
        .copied()
        .filter(|t| which(t.program).is_none())
        .collect()
}

fn install_command(pkgs: &[&str]) -> String {
    format!(
        "sudo apt-get update && sudo apt-get install -y {}",
        pkgs.join(" ")
    )
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

fn run_apt(args: &[&str]) -> Result<(), PrereqError> {
    let command = format!("apt-get {}", args.join(" "));
    eprintln!("kiln: running `{command}`");
    let status = Command::new("apt-get")
        .args(args)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .status()?;
    if status.success() {
        Ok(())
    } else {
        Err(PrereqError::AptFailed {
            command,
            status: status.to_string(),
        })
    }
}

/// Fails naming the missing tools of `tools` and how to install them (nothing is installed).
pub fn check(tools: &[Tool]) -> Result<(), PrereqError> {
    let missing = missing(tools);
    if missing.is_empty() {
        return Ok(());
    }
    let mut pkgs: Vec<&str> = missing.iter().map(|t| t.package).collect();
    pkgs.sort_unstable();
    pkgs.dedup();
    Err(PrereqError::Missing {
        missing: describe(&missing),
        command: install_command(&pkgs),
    })
}

fn describe(missing: &[Tool]) -> String {
    missing
        .iter()
        .map(|t| format!("{} ({}, package {})", t.program, t.why, t.package))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Makes sure every tool in `tools` is installed: installs the missing packages with apt when
/// running as root on a Debian-like system, otherwise fails naming the exact command to run.
pub fn ensure(tools: &[Tool]) -> Result<(), PrereqError> {
    let missing = missing(tools);
    if missing.is_empty() {
        return Ok(());
    }
    let mut pkgs: Vec<&str> = missing.iter().map(|t| t.package).collect();
    pkgs.sort_unstable();
    pkgs.dedup();
    let names = describe(&missing);
    if !(is_root() && which("apt-get").is_some()) {
        return Err(PrereqError::Missing {
            missing: names,
            command: install_command(&pkgs),
        });
    }
    eprintln!("kiln: installing missing host packages: {}", pkgs.join(" "));
    run_apt(&["update", "-q"])?;
    let mut args = vec!["install", "-y", "-q", "--no-install-recommends"];
    args.extend(pkgs.iter().copied());
    run_apt(&args)?;
    let still = missing_names(tools);
    if still.is_empty() {
        Ok(())
    } else {
        Err(PrereqError::Missing {
            missing: still,
            command: install_command(&pkgs),
        })
    }
}

/// Installs Debian packages that ship no program [`ensure`] could look for (an NSS module,
/// say): with apt when running as root, otherwise fails naming the command to run.
pub fn install_packages(pkgs: &[&str]) -> Result<(), PrereqError> {
    if !(is_root() && which("apt-get").is_some()) {
        return Err(PrereqError::Missing {
            missing: pkgs.join(", "),
            command: install_command(pkgs),
        });
    }
    eprintln!("kiln: installing host packages: {}", pkgs.join(" "));
    run_apt(&["update", "-q"])?;
    let mut args = vec!["install", "-y", "-q", "--no-install-recommends"];
    args.extend(pkgs.iter().copied());
    run_apt(&args)
}

fn missing_names(tools: &[Tool]) -> String {
    missing(tools)
        .iter()
        .map(|t| t.program)
        .collect::<Vec<_>>()
        .join(", ")
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
    fn missing_reports_only_absent_tools() {
        let tools = [
            Tool {
                program: "sh",
                package: "dash",
                why: "t",
            },
            Tool {
                program: "kiln-no-such-program-xyz",
                package: "kiln-nope",
                why: "t",
            },
        ];
        let m = missing(&tools);
        assert_eq!(m.len(), 1);
        assert_eq!(m[0].package, "kiln-nope");
    }

    #[test]
    fn serve_tools_name_the_disk_quota_programs() {
        for (program, package) in [
            ("mkfs.ext4", "e2fsprogs"),
            ("losetup", "mount"),
            ("mount", "mount"),
        ] {
            assert!(DISK_TOOLS.iter().any(|t| t.program == program));
            let t = SERVE_TOOLS.iter().find(|t| t.program == program);
            assert_eq!(t.map(|t| t.package), Some(package), "{program}");
            assert!(t.unwrap().why.contains("disk quota"), "{program}");
        }
    }

    #[test]
    fn check_names_the_missing_program_and_its_package() {
        let tools = [Tool {
            program: "kiln-no-such-program-xyz",
            package: "kiln-nope",
            why: "per-sandbox disk quota images",
        }];
        let e = check(&tools).unwrap_err().to_string();
        assert!(e.contains("kiln-no-such-program-xyz"), "{e}");
        assert!(e.contains("apt-get install -y kiln-nope"), "{e}");
        assert!(check(&tools[..0]).is_ok());
    }

    #[test]
    fn install_command_names_every_package() {
        let c = install_command(&["runsc", "mmdebstrap"]);
        assert!(c.ends_with("apt-get install -y runsc mmdebstrap"), "{c}");
    }
}
