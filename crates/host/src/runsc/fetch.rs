//! Downloading runsc from Debian's bookworm-backports with apt's own machinery, without touching
//! the host's apt configuration: a private sources list (the host's Debian mirror, suite
//! [`SUITE`]), private state and cache dirs, and `apt-get download` (no install, no dpkg
//! database change). The package is unpacked with `dpkg-deb -x` and its binary kept under
//! [`runsc_dir`]`/<package version>/runsc` with a [`Manifest`].

use std::path::{Path, PathBuf};
use std::process::Command;

use super::{
    install_hint, io_err, probe_version, runsc_dir, sha256_file, Manifest, Origin, Result, Runsc,
    RunscError, MANIFEST, SUITE,
};
use crate::apt_sources;

/// Keyring of the Debian archive (package `debian-archive-keyring`), used when present.
const DEBIAN_KEYRING: &str = "/usr/share/keyrings/debian-archive-keyring.gpg";

/// A scratch directory removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(parent: &Path, prefix: &str) -> Result<Self> {
        std::fs::create_dir_all(parent)
            .map_err(io_err(format!("creating {}", parent.display())))?;
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let p = parent.join(format!(".{prefix}-{}-{nanos}", std::process::id()));
        std::fs::create_dir(&p).map_err(io_err(format!("creating {}", p.display())))?;
        Ok(Self(p))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The `deb` line of the private sources list.
pub fn sources_line(mirror: &str) -> String {
    let signed = if Path::new(DEBIAN_KEYRING).is_file() {
        format!("[signed-by={DEBIAN_KEYRING}] ")
    } else {
        String::new()
    };
    format!(
        "deb {signed}{} {SUITE} main\n",
        mirror.trim_end_matches('/')
    )
}

/// apt options that point every piece of apt state at `dir` (sources, lists, archives, pins).
pub fn private_apt_options(dir: &Path) -> Vec<String> {
    let d = dir.display();
    let mut o = vec![
        format!("Dir::Etc::SourceList={d}/sources.list"),
        format!("Dir::Etc::SourceParts={d}/sources.list.d"),
        format!("Dir::Etc::Preferences={d}/preferences"),
        format!("Dir::Etc::PreferencesParts={d}/preferences.d"),
        format!("Dir::State={d}/state"),
        format!("Dir::Cache={d}/cache"),
    ];
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        // The private dirs are root's: apt's download sandbox user could not write into them.
        o.push("APT::Sandbox::User=root".into());
    }
    o.into_iter().flat_map(|x| ["-o".to_string(), x]).collect()
}

fn run(cmd: &mut Command, shown: &str) -> Result<()> {
    let out = cmd
        .env("DEBIAN_FRONTEND", "noninteractive")
        .output()
        .map_err(io_err(format!("running `{shown}`")))?;
    if out.status.success() {
        return Ok(());
    }
    let mut text = String::from_utf8_lossy(&out.stdout).to_string();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    let tail: Vec<&str> = text.lines().rev().take(12).collect();
    Err(RunscError::Download {
        command: shown.to_string(),
        output: tail.into_iter().rev().collect::<Vec<_>>().join("\n"),
        hint: install_hint(),
    })
}

/// Downloads runsc from [`SUITE`] on `mirror` (default: `KILN_DEBIAN_MIRROR`, else the host's
/// Debian mirror) and installs it into kiln's cache.
pub fn download_and_install(mirror: Option<String>) -> Result<Runsc> {
    let mirror = mirror
        .or_else(apt_sources::debian_mirror_uri)
        .ok_or_else(|| RunscError::NoMirror(apt_sources::how_to_set_mirror()))?;
    let scratch = Scratch::new(&runsc_dir(), "fetch")?;
    let dir = &scratch.0;
    for sub in [
        "sources.list.d",
        "preferences.d",
        "state/lists/partial",
        "cache/archives/partial",
        "download",
    ] {
        std::fs::create_dir_all(dir.join(sub)).map_err(io_err(format!("creating {sub}")))?;
    }
    std::fs::write(dir.join("sources.list"), sources_line(&mirror))
        .map_err(io_err("writing the private sources list"))?;
    let opts = private_apt_options(dir);
    eprintln!("kiln: downloading runsc from {SUITE} ({mirror})");
    run(
        // apt-get update only warns when the mirror is unreachable: make that an error.
        Command::new("apt-get")
            .args(&opts)
            .args(["-q", "--error-on=any", "update"]),
        &format!("apt-get {} -q --error-on=any update", opts.join(" ")),
    )?;
    let pkg = format!("runsc/{SUITE}");
    run(
        Command::new("apt-get")
            .args(&opts)
            .args(["-q", "download", &pkg])
            .current_dir(dir.join("download")),
        &format!("apt-get {} -q download {pkg}", opts.join(" ")),
    )?;
    let deb = std::fs::read_dir(dir.join("download"))
        .map_err(io_err("listing the download dir"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .ok_or_else(|| RunscError::BadPackage {
            path: dir.join("download").display().to_string(),
            msg: "apt-get download left no .deb".into(),
        })?;
    install_deb(&deb, &format!("{mirror} {SUITE}"))
}

fn deb_field(deb: &Path, field: &str) -> Result<String> {
    let out = Command::new("dpkg-deb")
        .arg("-f")
        .arg(deb)
        .arg(field)
        .output()
        .map_err(io_err("running dpkg-deb"))?;
    let v = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if !out.status.success() || v.is_empty() {
        return Err(RunscError::BadPackage {
            path: deb.display().to_string(),
            msg: format!(
                "no {field} field: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        });
    }
    Ok(v)
}

/// Unpacks a runsc .deb (`dpkg-deb -x`), checks its version and installs its binary into
/// `<runsc_dir>/<package version>/` with a manifest. Replaces an earlier install of the same
/// version atomically.
pub fn install_deb(deb: &Path, source: &str) -> Result<Runsc> {
    let bad = |msg: String| RunscError::BadPackage {
        path: deb.display().to_string(),
        msg,
    };
    let package = deb_field(deb, "Package")?;
    if package != "runsc" {
        return Err(bad(format!("package {package:?}, expected runsc")));
    }
    let package_version = deb_field(deb, "Version")?;
    if package_version.contains('/') || package_version.starts_with('.') {
        return Err(bad(format!("odd version {package_version:?}")));
    }
    let root = runsc_dir();
    let scratch = Scratch::new(&root, "unpack")?;
    let x = scratch.0.join("x");
    let out = Command::new("dpkg-deb")
        .arg("-x")
        .arg(deb)
        .arg(&x)
        .output()
        .map_err(io_err("running dpkg-deb -x"))?;
    if !out.status.success() {
        return Err(bad(format!(
            "dpkg-deb -x failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    let bin = x.join("usr/bin/runsc");
    if !bin.is_file() {
        return Err(bad("no usr/bin/runsc inside".into()));
    }
    let (version, _) = probe_version(&bin)?;
    if !version.is_supported() {
        return Err(RunscError::TooOld {
            path: deb.display().to_string(),
            version,
            hint: format!("use a runsc package from {SUITE} or newer"),
        });
    }
    let staged = scratch.0.join("install");
    std::fs::create_dir(&staged).map_err(io_err("creating the install dir"))?;
    std::fs::rename(&bin, staged.join("runsc")).map_err(io_err("moving runsc into place"))?;
    let m = Manifest {
        package_version: package_version.clone(),
        version,
        sha256: sha256_file(&staged.join("runsc"))?,
        source: source.to_string(),
    };
    let text = serde_json::to_string_pretty(&m).expect("manifest serializes");
    std::fs::write(staged.join(MANIFEST), text).map_err(io_err("writing the manifest"))?;
    let dest = root.join(&package_version);
    if dest.exists() {
        std::fs::rename(&dest, scratch.0.join("old")).map_err(io_err(format!(
            "moving the previous {} aside",
            dest.display()
        )))?;
    }
    std::fs::rename(&staged, &dest).map_err(io_err(format!("installing {}", dest.display())))?;
    let r = super::verify_install(&dest, &m)?;
    eprintln!(
        "kiln: installed runsc {} ({package_version}) at {}",
        r.version,
        r.path.display()
    );
    debug_assert_eq!(r.origin, Origin::Kiln);
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn apt_state_is_private() {
        let o = private_apt_options(Path::new("/p"));
        let joined = o.join(" ");
        for k in [
            "Dir::Etc::SourceList=/p/sources.list",
            "Dir::Etc::SourceParts=/p/sources.list.d",
            "Dir::State=/p/state",
            "Dir::Cache=/p/cache",
        ] {
            assert!(joined.contains(k), "{joined}");
        }
        assert!(o.chunks(2).all(|c| c[0] == "-o"));
        assert!(sources_line("http://m.example/debian/")
            .ends_with("http://m.example/debian bookworm-backports main\n"));
    }
}
