//! The runsc this test run uses (`KILN_RUNSC`, else what `kiln runtime ensure` installed, else
//! the host's) is the one kiln pins: at least bookworm-backports' 0.0~20240729, with systrap.
//! scripts/test.sh exports KILN_RUNSC from `kiln runtime ensure`, so an older runsc fails here.

use kiln_host::runsc::{self, platform, Origin, RunscVersion};

#[test]
fn pinned_minimum_is_bookworm_backports_20240729() {
    assert_eq!(
        runsc::MIN_VERSION,
        RunscVersion {
            date: 20240729,
            build: 0
        }
    );
    assert_eq!(runsc::SUITE, "bookworm-backports");
}

#[test]
fn the_runsc_under_test_is_at_least_the_pinned_version() {
    let r = runsc::resolve(None).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        r.version >= runsc::MIN_VERSION,
        "{} is runsc {} ({:?}); kiln needs {} or newer",
        r.path.display(),
        r.version,
        r.origin,
        runsc::MIN_VERSION
    );
    if r.origin == Origin::Kiln {
        let dir = r.path.parent().unwrap();
        let m = runsc::read_manifest(dir).expect("manifest next to kiln's runsc");
        assert_eq!(m.version, r.version);
        assert_eq!(m.sha256, runsc::sha256_file(&r.path).unwrap());
    }
}

#[test]
fn the_runsc_under_test_has_a_working_systrap_platform() {
    if !kiln_testkit::needs().root("runsc sandboxes").ok() {
        return;
    }
    let r = runsc::resolve(None).unwrap_or_else(|e| panic!("{e}"));
    let p = platform::try_platform(&r.path, "systrap");
    assert!(p.ok, "{}", p.note);
    assert_eq!(
        platform::pick(&r.path, false).as_deref(),
        Ok("systrap"),
        "systrap is the fastest platform kiln tries without hardware-speed KVM"
    );
}
