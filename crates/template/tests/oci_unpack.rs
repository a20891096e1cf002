//! Layer application on its own: whiteouts, opaque directories, links, owners and modes,
//! compression, diff_id checks, and hostile layers refused with nothing written outside the
//! root. Needs root (owners are kept with chown).

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use common::oci::{gzip, sha, zstd, LayerTar};
use kiln_template::oci::unpack::apply_layer;

mod common;

fn apply(
    root: &Path,
    blob: &[u8],
    diff_id: Option<&str>,
) -> Result<kiln_template::oci::unpack::LayerStats, String> {
    let f = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(f.path(), blob).unwrap();
    apply_layer(root, f.path(), diff_id, "sha256:test").map_err(|e| e.to_string())
}

/// Whether this test runs here (root, to keep owners), under the skip policy of
/// [`kiln_testkit`].
fn is_root() -> bool {
    kiln_testkit::needs()
        .root("layer tests (they keep owners)")
        .ok()
}

#[test]
fn layers_stack_with_whiteouts_and_opaque_dirs() {
    if !is_root() {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let r = t.path();
    let lower = LayerTar::new()
        .dir("etc")
        .file("etc/keep", b"keep\n", 0o644)
        .file("etc/gone", b"gone\n", 0o644)
        .dir("etc/tree")
        .file("etc/tree/deep", b"deep\n", 0o644)
        .dir("opt/app/old")
        .file("opt/app/old/f", b"old\n", 0o644)
        .file("opt/app/top", b"top\n", 0o644)
        .owned_file("usr/bin/tool", b"#!/bin/sh\n", 0o4755, 1000, 1000)
        .hardlink("usr/bin/tool2", "usr/bin/tool")
        .symlink("bin", "usr/bin")
        .symlink("abs", "/etc")
        .device("dev/null")
        .finish();
    let st = apply(r, &gzip(&lower), Some(&sha(&lower))).unwrap();
    assert_eq!(st.compression, "gzip");
    assert_eq!(st.skipped_devices, 1);
    assert!(!r.join("dev/null").exists(), "device nodes are skipped");
    let tool = r.join("usr/bin/tool").metadata().unwrap();
    assert_eq!((tool.uid(), tool.gid()), (1000, 1000));
    assert_eq!(
        tool.permissions().mode() & 0o7777,
        0o4755,
        "setuid kept after chown"
    );
    assert_eq!(
        tool.ino(),
        r.join("usr/bin/tool2").metadata().unwrap().ino()
    );
    assert_eq!(
        std::fs::read_link(r.join("abs")).unwrap(),
        Path::new("/etc")
    );

    let upper = LayerTar::new()
        .file("etc/.wh.gone", b"", 0o644)
        .file("etc/.wh.tree", b"", 0o644)
        .file("opt/app/new", b"new\n", 0o644)
        .file("opt/app/.wh..wh..opq", b"", 0o644)
        // Through the `bin -> usr/bin` link, resolved inside the root.
        .file("bin/added", b"x", 0o755)
        // `abs -> /etc` is the image's /etc, never the host's.
        .file("abs/through-abs", b"inside\n", 0o644)
        .finish();
    let st = apply(r, &zstd(&upper), Some(&sha(&upper))).unwrap();
    assert_eq!(
        (st.compression, st.whiteouts, st.opaque_dirs),
        ("zstd", 2, 1)
    );
    assert!(r.join("etc/keep").is_file());
    assert!(!r.join("etc/gone").exists(), "whiteout not applied");
    assert!(
        !r.join("etc/tree").exists(),
        "a whiteout removes a whole tree"
    );
    assert!(
        !r.join("etc/.wh.gone").exists(),
        "markers are not extracted"
    );
    assert!(
        r.join("opt/app/new").is_file(),
        "this layer's entries survive its opaque marker"
    );
    assert!(
        !r.join("opt/app/old").exists() && !r.join("opt/app/top").exists(),
        "opaque dir kept lower content"
    );
    assert!(r.join("usr/bin/added").is_file());
    assert_eq!(
        std::fs::read_to_string(r.join("etc/through-abs")).unwrap(),
        "inside\n"
    );
    assert!(!Path::new("/etc/through-abs").exists());
}

#[test]
fn plain_tar_and_wrong_diff_id() {
    if !is_root() {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let tar = LayerTar::new().file("a", b"a", 0o644).finish();
    assert_eq!(
        apply(t.path(), &tar, Some(&sha(&tar))).unwrap().compression,
        "none"
    );
    let wrong = sha(b"other");
    let e = apply(t.path(), &gzip(&tar), Some(&wrong)).unwrap_err();
    assert!(
        e.contains("diff_id") && e.contains("digest mismatch"),
        "{e}"
    );
}

#[test]
fn hostile_layers_are_refused() {
    if !is_root() {
        return;
    }
    let outside = tempfile::tempdir().unwrap();
    let root = outside.path().join("root");
    std::fs::create_dir(&root).unwrap();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "dotdot",
            LayerTar::new().file("../escaped", b"x", 0o644).finish(),
        ),
        (
            "nested dotdot",
            LayerTar::new()
                .file("a/../../escaped", b"x", 0o644)
                .finish(),
        ),
        (
            "symlink out",
            LayerTar::new()
                .symlink("etc/evil", "../../escaped")
                .finish(),
        ),
        (
            "hardlink out",
            LayerTar::new().hardlink("evil", "../escaped").finish(),
        ),
    ];
    for (what, tar) in cases {
        let e = apply(&root, &tar, None).unwrap_err();
        assert!(e.contains("is refused"), "{what}: {e}");
        assert!(
            !outside.path().join("escaped").exists(),
            "{what} wrote outside the root"
        );
    }
    // An absolute path is read as relative to the root.
    let tar = LayerTar::new().file("/abs-file", b"x", 0o644).finish();
    apply(&root, &tar, None).unwrap();
    assert!(root.join("abs-file").is_file());
}
