//! Which `runsc` kiln runs, and obtaining a recent enough one.
//!
//! kiln needs at least [`MIN_VERSION`] (Debian bookworm-backports' `0.0~20240729`): it has the
//! `systrap` platform, `/proc/sys/kernel/random/boot_id` and accepts `statx(AT_NO_AUTOMOUNT)`.
//! Resolution order ([`resolve`], no network):
//! 1. an explicit path (`--runsc PATH`), then `KILN_RUNSC` — used as given, any version;
//! 2. the binary kiln installed itself under `<cache>/runsc/<package version>/runsc`, verified
//!    against the sha256 in its `manifest.json` on every use;
//! 3. the host's `runsc` on `$PATH` when it is at least [`MIN_VERSION`].
//!
//! [`ensure`] adds step 4: download the bookworm-backports package with apt's own machinery and a
//! private sources list, state and cache dir ([`fetch`]), so the host's apt setup is untouched.

pub mod fetch;
pub mod platform;

use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Oldest runsc kiln accepts without an explicit `--runsc`.
pub const MIN_VERSION: RunscVersion = RunscVersion {
    date: 20240729,
    build: 0,
};
/// The Debian suite kiln downloads runsc from.
pub const SUITE: &str = "bookworm-backports";
/// Environment variable naming the runsc binary (same meaning as `--runsc`).
pub const RUNSC_ENV: &str = "KILN_RUNSC";
/// Name of the manifest next to each runsc kiln installed.
pub const MANIFEST: &str = "manifest.json";

/// A runsc release, from its `--version` line (`0.0~20240729.0` in Debian, `release-20240729.0`
/// upstream): the release date and build number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RunscVersion {
    pub date: u32,
    pub build: u32,
}

impl RunscVersion {
    /// Parses the first `YYYYMMDD[.N]` of `text` (e.g. the output of `runsc --version`).
    pub fn parse(text: &str) -> Option<Self> {
        let b = text.as_bytes();
        let mut i = 0;
        while i + 8 <= b.len() {
            let starts_number = i == 0 || !b[i - 1].is_ascii_digit();
            if starts_number && b[i..i + 8].iter().all(u8::is_ascii_digit) {
                let ends = i + 8 == b.len() || !b[i + 8].is_ascii_digit();
                if ends {
                    let date: u32 = text[i..i + 8].parse().ok()?;
                    let rest = &text[i + 8..];
                    let build = rest
                        .strip_prefix('.')
                        .map(|r| {
                            r.chars()
                                .take_while(char::is_ascii_digit)
                                .collect::<String>()
                        })
                        .and_then(|d| d.parse().ok())
                        .unwrap_or(0);
                    return (19_000_000..30_000_000)
                        .contains(&date)
                        .then_some(Self { date, build });
                }
            }
            i += 1;
        }
        None
    }

    pub fn is_supported(&self) -> bool {
        *self >= MIN_VERSION
    }
}

impl fmt::Display for RunscVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "0.0~{}.{}", self.date, self.build)
    }
}

/// Where a resolved runsc came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Origin {
    /// `--runsc PATH`.
    Flag,
    /// `KILN_RUNSC`.
    Env,
    /// Installed by kiln under its cache dir.
    Kiln,
    /// The host's own `runsc` on `$PATH`.
    Host,
}

/// A runsc binary kiln can use.
#[derive(Debug, Clone, Serialize)]
pub struct Runsc {
    pub path: PathBuf,
    pub version: RunscVersion,
    /// First line of `runsc --version`.
    pub version_line: String,
    pub origin: Origin,
}

/// What kiln records next to each runsc it installs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// Debian package version (`0.0~20240729.0-4~bpo12+2`).
    pub package_version: String,
    /// Parsed `runsc --version`.
    pub version: RunscVersion,
    /// sha256 of the binary, checked on every use.
    pub sha256: String,
    /// Where it came from (mirror and suite, or the .deb file given).
    pub source: String,
}

#[derive(Debug, thiserror::Error)]
pub enum RunscError {
    #[error("no runsc found: kiln needs runsc {MIN_VERSION} or newer. {hint}")]
    NotFound { hint: String },
    #[error("{path} is runsc {version}, older than the {MIN_VERSION} kiln needs. {hint}")]
    TooOld {
        path: String,
        version: RunscVersion,
        hint: String,
    },
    #[error("{path}: sha256 {actual} does not match {expected} recorded in its manifest; remove {dir} and run `kiln runtime ensure`")]
    Tampered {
        path: String,
        dir: String,
        expected: String,
        actual: String,
    },
    #[error("{path} --version: {msg}")]
    Version { path: String, msg: String },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("could not download runsc from {SUITE}: `{command}` failed:\n{output}\n{hint}")]
    Download {
        command: String,
        output: String,
        hint: String,
    },
    #[error("the .deb {path}: {msg}")]
    BadPackage { path: String, msg: String },
    #[error("no Debian mirror to download runsc from: {0}")]
    NoMirror(String),
}

pub type Result<T, E = RunscError> = std::result::Result<T, E>;

pub(crate) fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> RunscError {
    let what = what.into();
    move |source| RunscError::Io { what, source }
}

/// What to do when no suitable runsc is installed (offline hosts included).
pub fn install_hint() -> String {
    format!(
        "Run `kiln runtime ensure` (as root, with access to your Debian mirror) to download runsc from {SUITE} into kiln's cache; \
         on an offline host copy a runsc .deb from {SUITE} here and run `kiln runtime ensure --deb FILE`, \
         or pass `--runsc PATH` / set {RUNSC_ENV}"
    )
}

/// Directory holding the runsc builds kiln installed.
pub fn runsc_dir() -> PathBuf {
    crate::paths::cache_dir().join("runsc")
}

/// Runs `path --version` and parses it.
pub fn probe_version(path: &Path) -> Result<(RunscVersion, String)> {
    let out = Command::new(path)
        .arg("--version")
        .output()
        .map_err(|e| RunscError::Version {
            path: path.display().to_string(),
            msg: e.to_string(),
        })?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().next().unwrap_or("").trim().to_string();
    match RunscVersion::parse(&line) {
        Some(v) if out.status.success() => Ok((v, line)),
        _ => Err(RunscError::Version {
            path: path.display().to_string(),
            msg: format!(
                "unexpected output {line:?} ({}){}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ),
        }),
    }
}

/// sha256 (hex) of a file.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path).map_err(io_err(format!("opening {}", path.display())))?;
    let mut h = Sha256::new();
    std::io::copy(&mut f, &mut h).map_err(io_err(format!("reading {}", path.display())))?;
    Ok(hex::encode(h.finalize()))
}

/// Reads the manifest of one install dir.
pub fn read_manifest(dir: &Path) -> Option<Manifest> {
    let text = std::fs::read_to_string(dir.join(MANIFEST)).ok()?;
    serde_json::from_str(&text).ok()
}

/// Verifies the binary in `dir` against its manifest.
pub fn verify_install(dir: &Path, m: &Manifest) -> Result<Runsc> {
    let path = dir.join("runsc");
    let actual = sha256_file(&path)?;
    if actual != m.sha256 {
        return Err(RunscError::Tampered {
            path: path.display().to_string(),
            dir: dir.display().to_string(),
            expected: m.sha256.clone(),
            actual,
        });
    }
    let (version, version_line) = probe_version(&path)?;
    Ok(Runsc {
        path,
        version,
        version_line,
        origin: Origin::Kiln,
    })
}

/// The newest runsc kiln installed under `root`, verified. `None` when there is none.
pub fn installed_in(root: &Path) -> Option<Result<Runsc>> {
    let mut found: Vec<(RunscVersion, PathBuf, Manifest)> = std::fs::read_dir(root)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter_map(|d| read_manifest(&d).map(|m| (m.version, d, m)))
        .collect();
    found.sort_by_key(|f| std::cmp::Reverse(f.0));
    let (_, dir, m) = found.into_iter().next()?;
    Some(verify_install(&dir, &m))
}

fn explicit(path: &Path, origin: Origin) -> Result<Runsc> {
    let (version, version_line) = probe_version(path)?;
    Ok(Runsc {
        path: path.to_path_buf(),
        version,
        version_line,
        origin,
    })
}

/// Finds the runsc kiln should run, without downloading anything (see the module docs).
pub fn resolve(flag: Option<&Path>) -> Result<Runsc> {
    if let Some(p) = flag {
        return explicit(p, Origin::Flag);
    }
    if let Some(p) = std::env::var_os(RUNSC_ENV).filter(|v| !v.is_empty()) {
        return explicit(Path::new(&p), Origin::Env);
    }
    if let Some(r) = installed_in(&runsc_dir()) {
        return r;
    }
    let Some(host) = crate::prereq::which("runsc") else {
        return Err(RunscError::NotFound {
            hint: install_hint(),
        });
    };
    let (version, version_line) = probe_version(&host)?;
    if !version.is_supported() {
        return Err(RunscError::TooOld {
            path: host.display().to_string(),
            version,
            hint: install_hint(),
        });
    }
    Ok(Runsc {
        path: host,
        version,
        version_line,
        origin: Origin::Host,
    })
}

/// Like [`resolve`], but downloads and installs runsc from [`SUITE`] when none (or only an older
/// host one) is available.
pub fn ensure(flag: Option<&Path>) -> Result<Runsc> {
    match resolve(flag) {
        Err(RunscError::NotFound { .. }) | Err(RunscError::TooOld { .. }) => {
            fetch::download_and_install(None)
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_debian_and_upstream_versions() {
        let d = RunscVersion::parse("runsc version 0.0~20240729.0").unwrap();
        assert_eq!(
            d,
            RunscVersion {
                date: 20240729,
                build: 0
            }
        );
        let u = RunscVersion::parse("runsc version release-20250105.1").unwrap();
        assert_eq!((u.date, u.build), (20250105, 1));
        assert_eq!(
            RunscVersion::parse("runsc version 0.0~20221219.0")
                .unwrap()
                .date,
            20221219
        );
        assert!(RunscVersion::parse("spec: 1.0.2-dev").is_none());
        assert_eq!(d.to_string(), "0.0~20240729.0");
    }

    #[test]
    fn minimum_is_the_2024_backport() {
        assert_eq!(MIN_VERSION.to_string(), "0.0~20240729.0");
        assert!(RunscVersion::parse("0.0~20240729.0")
            .unwrap()
            .is_supported());
        assert!(RunscVersion::parse("release-20250105.0")
            .unwrap()
            .is_supported());
        assert!(!RunscVersion::parse("0.0~20221219.0")
            .unwrap()
            .is_supported());
    }

    #[test]
    fn tampered_install_is_refused() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("0.0~20240729.0-1");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("runsc"),
            "#!/bin/sh\necho runsc version 0.0~20240729.0\n",
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir.join("runsc"), std::fs::Permissions::from_mode(0o755))
            .unwrap();
        let m = Manifest {
            package_version: "0.0~20240729.0-1".into(),
            version: MIN_VERSION,
            sha256: sha256_file(&dir.join("runsc")).unwrap(),
            source: "test".into(),
        };
        std::fs::write(dir.join(MANIFEST), serde_json::to_string(&m).unwrap()).unwrap();
        let r = installed_in(root.path()).unwrap().unwrap();
        assert_eq!(r.version, MIN_VERSION);
        assert_eq!(r.origin, Origin::Kiln);
        std::fs::write(
            dir.join("runsc"),
            "#!/bin/sh\necho runsc version 0.0~20240729.0 # x\n",
        )
        .unwrap();
        let e = installed_in(root.path()).unwrap().unwrap_err();
        assert!(matches!(e, RunscError::Tampered { .. }), "{e}");
    }
}
