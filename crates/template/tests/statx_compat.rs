//! Does a template still need the statx compat preload library? Builds a real template without
//! it and runs `ls`/`stat` in a real gVisor sandbox under the runsc kiln uses (at least
//! `kiln_host::runsc::MIN_VERSION`, systrap): they must work. Then, where the host still has an
//! older runsc (Debian bookworm's 2022 build), shows that it fails there without the library and
//! works with it (`KILN_STATX_COMPAT=1`), which is the only case the library is kept for.
//!
//! One test function: it sets `KILN_STATX_COMPAT` for part of its run, so nothing else in this
//! binary may build templates concurrently.

use std::path::{Path, PathBuf};
use std::process::Command;

use kiln_host::runsc;
use kiln_template::build::{statx_compat_wanted, COMPAT_PATH_IN_ROOTFS, STATX_COMPAT_ENV};
use kiln_template::{build, BuildOptions, Recipe, Store};

mod common;

/// Whether this test runs here (root, mmdebstrap), under the skip policy of [`kiln_testkit`].
fn runs_here() -> bool {
    kiln_testkit::needs()
        .root("template builds and runsc sandboxes")
        .tool("mmdebstrap")
        .ok()
}

/// The `ls`/`stat` run inside the sandbox (coreutils' `ls -l` and `stat` use
/// `statx(AT_NO_AUTOMOUNT)`).
const PROBE: &str = "ls -la / >/dev/null && ls -l /etc/hostname && stat -c 'stat:%n:%F' /etc";

/// Runs [`PROBE`] in a sandbox on `rootfs` (read-only) with `runsc_bin` on `platform`.
fn run_probe(runsc_bin: &Path, platform: &str, rootfs: &Path) -> (bool, String) {
    let t = tempfile::tempdir().unwrap();
    let bundle = t.path().join("bundle");
    std::fs::create_dir_all(&bundle).unwrap();
    let spec = serde_json::json!({
        "ociVersion": "1.0.2",
        "process": {
            "user": {"uid": 0, "gid": 0},
            "args": ["/bin/sh", "-c", PROBE],
            "env": ["PATH=/usr/bin:/bin:/usr/sbin:/sbin"],
            "cwd": "/"
        },
        "root": {"path": rootfs, "readonly": true},
        "hostname": "statx",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs"}
        ],
        "linux": {"namespaces": [
            {"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}, {"type": "network"}
        ]}
    });
    std::fs::write(bundle.join("config.json"), spec.to_string()).unwrap();
    let id = format!("statx-{}-{platform}", std::process::id());
    let out = Command::new(runsc_bin)
        .arg(format!("--root={}", t.path().join("state").display()))
        .arg(format!("--platform={platform}"))
        .args(["--network=none", "--ignore-cgroups", "run"])
        .arg(format!("--bundle={}", bundle.display()))
        .arg(&id)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let mut text = String::from_utf8_lossy(&out.stdout).to_string();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

fn build_template(store: &Store, agent: PathBuf) -> PathBuf {
    let r = Recipe::parse(
        "name = \"statx\"\n[from]\ndebian = \"bookworm\"\nvariant = \"essential\"\npackages = []\n",
        "test",
    )
    .unwrap();
    let opts = BuildOptions {
        agent: Some(agent),
        force: false,
        quiet: true,
        mirror: None,
    };
    build(store, &r, &opts).unwrap().template.rootfs
}

#[test]
fn new_runsc_runs_ls_and_stat_without_the_compat_library() {
    if !runs_here() {
        return;
    }
    let kiln_runsc = runsc::resolve(None).unwrap_or_else(|e| {
        panic!("no runsc for kiln ({e}); scripts/test.sh runs `kiln runtime ensure`")
    });
    assert!(
        kiln_runsc.version.is_supported(),
        "{} is runsc {}, older than {}",
        kiln_runsc.path.display(),
        kiln_runsc.version,
        runsc::MIN_VERSION
    );
    std::env::remove_var(STATX_COMPAT_ENV);
    assert!(!statx_compat_wanted());
    let t = tempfile::tempdir().unwrap();
    let store = Store::open(t.path().join("store")).unwrap();
    let agent = common::fake_static_agent(t.path(), 0);

    // Default build: no compat library, nothing preloaded.
    let plain = build_template(&store, agent.clone());
    assert!(!plain.join(COMPAT_PATH_IN_ROOTFS).exists());
    assert!(!std::fs::read_to_string(plain.join("etc/ld.so.preload"))
        .unwrap_or_default()
        .contains("kiln"));

    // ls/stat work in a real sandbox under kiln's runsc without it.
    let (ok, out) = run_probe(&kiln_runsc.path, "systrap", &plain);
    assert!(
        ok,
        "ls/stat under {} (systrap) without the compat library:\n{out}",
        kiln_runsc.version
    );
    assert!(out.contains("stat:/etc:directory"), "{out}");
    assert!(out.contains("/etc/hostname"), "{out}");

    // The compat build is still available (for older runsc) and differs in key and content.
    std::env::set_var(STATX_COMPAT_ENV, "1");
    let compat = build_template(&store, agent);
    std::env::remove_var(STATX_COMPAT_ENV);
    assert_ne!(compat, plain);
    assert!(compat.join(COMPAT_PATH_IN_ROOTFS).is_file());
    assert_eq!(
        std::fs::read_to_string(compat.join("etc/ld.so.preload")).unwrap(),
        format!("/{COMPAT_PATH_IN_ROOTFS}\n")
    );
    // With the library preloaded, the template still works under the new runsc…
    let (ok, out) = run_probe(&kiln_runsc.path, "systrap", &compat);
    assert!(ok, "compat template under the new runsc:\n{out}");

    // …and on a host that still has an older runsc, that one shows why the library existed.
    let old = Path::new("/usr/bin/runsc");
    match runsc::probe_version(old) {
        Ok((v, _)) if !v.is_supported() => {
            let (ok, out) = run_probe(old, "ptrace", &plain);
            assert!(
                !ok && out.contains("Invalid argument"),
                "runsc {v} was expected to reject statx(AT_NO_AUTOMOUNT):\n{out}"
            );
            let (ok, out) = run_probe(old, "ptrace", &compat);
            assert!(
                ok && out.contains("stat:/etc:directory"),
                "runsc {v} with the compat library:\n{out}"
            );
        }
        _ => eprintln!(
            "note: no pre-{} runsc at {}: the old-runsc half of this test has nothing to compare",
            runsc::MIN_VERSION,
            old.display()
        ),
    }
}
