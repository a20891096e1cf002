//! Installing runsc from a .deb (the last step of `kiln runtime ensure`, and the offline path
//! `--deb FILE`): a package built here with `dpkg-deb -b` whose "runsc" reports a version.
//! An older one is refused; a recent one lands in `<cache>/runsc/<version>/` with a manifest,
//! and a later change to the binary is detected on use.

use std::path::{Path, PathBuf};
use std::process::Command;

use kiln_host::runsc::{self, fetch, Origin, RunscError};

fn fake_deb(dir: &Path, package_version: &str, reported: &str) -> PathBuf {
    let root = dir.join(format!("pkg-{package_version}"));
    std::fs::create_dir_all(root.join("DEBIAN")).unwrap();
    std::fs::create_dir_all(root.join("usr/bin")).unwrap();
    std::fs::write(
        root.join("DEBIAN/control"),
        format!(
            "Package: runsc\nVersion: {package_version}\nArchitecture: all\nMaintainer: kiln tests <t@localhost>\nDescription: test package\n"
        ),
    )
    .unwrap();
    let bin = root.join("usr/bin/runsc");
    std::fs::write(
        &bin,
        format!("#!/bin/sh\necho 'runsc version {reported}'\necho 'spec: 1.0.2-dev'\n"),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    let deb = dir.join(format!("runsc_{package_version}.deb"));
    let out = Command::new("dpkg-deb")
        .args(["--root-owner-group", "-b"])
        .arg(&root)
        .arg(&deb)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    deb
}

#[test]
fn installs_recent_debs_refuses_old_ones_and_detects_tampering() {
    let t = tempfile::tempdir().unwrap();
    // Only this test runs in this binary: the cache dir is ours.
    std::env::set_var("KILN_CACHE_DIR", t.path().join("cache"));
    std::env::remove_var(runsc::RUNSC_ENV);

    let old = fake_deb(t.path(), "0.0~20221219.0-2", "0.0~20221219.0");
    let e = fetch::install_deb(&old, "test").unwrap_err();
    assert!(matches!(e, RunscError::TooOld { .. }), "{e}");
    assert!(runsc::installed_in(&runsc::runsc_dir()).is_none());

    let new = fake_deb(t.path(), "0.0~20240729.0-4", "0.0~20240729.0");
    let r = fetch::install_deb(&new, "test").unwrap();
    assert_eq!(r.origin, Origin::Kiln);
    assert_eq!(r.version, runsc::MIN_VERSION);
    assert_eq!(
        r.path,
        runsc::runsc_dir().join("0.0~20240729.0-4").join("runsc")
    );
    let m = runsc::read_manifest(r.path.parent().unwrap()).unwrap();
    assert_eq!(m.package_version, "0.0~20240729.0-4");
    assert_eq!(m.sha256, runsc::sha256_file(&r.path).unwrap());

    // resolve() prefers kiln's own install over the host's runsc, and ensure() needs no network.
    let resolved = runsc::resolve(None).unwrap();
    assert_eq!(resolved.path, r.path);
    assert_eq!(runsc::ensure(None).unwrap().path, r.path);

    // A changed binary is refused on use.
    std::fs::write(&r.path, "#!/bin/sh\necho 'runsc version 0.0~20240729.0'\n").unwrap();
    let e = runsc::resolve(None).unwrap_err();
    assert!(matches!(e, RunscError::Tampered { .. }), "{e}");
    assert!(e.to_string().contains("kiln runtime ensure"), "{e}");

    // A package that is not runsc is refused.
    let root = t.path().join("other");
    std::fs::create_dir_all(root.join("DEBIAN")).unwrap();
    std::fs::write(
        root.join("DEBIAN/control"),
        "Package: not-runsc\nVersion: 1\nArchitecture: all\nMaintainer: t <t@localhost>\nDescription: x\n",
    )
    .unwrap();
    let other = t.path().join("other.deb");
    assert!(Command::new("dpkg-deb")
        .args(["--root-owner-group", "-b"])
        .arg(&root)
        .arg(&other)
        .output()
        .unwrap()
        .status
        .success());
    let e = fetch::install_deb(&other, "test").unwrap_err();
    assert!(matches!(e, RunscError::BadPackage { .. }), "{e}");
}
