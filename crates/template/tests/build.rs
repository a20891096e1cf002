//! The real builder: mmdebstrap from the host's Debian sources, as root. Where that cannot run
//! (not root, no mmdebstrap), the tests fail unless `KILN_ALLOW_SKIPS=1` asks for printed skips.

use std::path::{Path, PathBuf};
use std::process::Command;

use common::fake_static_agent;
use kiln_template::{build, BuildOptions, Error, Recipe, Store};

mod common;

/// Whether the real builder runs here (root, mmdebstrap), under the skip policy of
/// [`kiln_testkit`].
fn runs_here() -> bool {
    kiln_testkit::needs()
        .root("mmdebstrap builds")
        .tool("mmdebstrap")
        .ok()
}

fn opts(agent: PathBuf) -> BuildOptions {
    BuildOptions {
        agent: Some(agent),
        force: false,
        quiet: true,
        mirror: None,
    }
}

fn recipe(name: &str, packages: &str, steps: &str) -> Recipe {
    Recipe::parse(
        &format!(
            "name = \"{name}\"\n[from]\ndebian = \"bookworm\"\nvariant = \"essential\"\npackages = [{packages}]\n{steps}"
        ),
        "test",
    )
    .unwrap()
}

fn assert_nothing_cached(store: &Store, name: &str) {
    assert!(matches!(store.lookup(name), Err(Error::NotBuilt(_))));
    let leftovers: Vec<_> = std::fs::read_dir(store.root().join(".tmp"))
        .unwrap()
        .collect();
    assert!(
        leftovers.is_empty(),
        "partial build left in .tmp: {leftovers:?}"
    );
    let bases: Vec<_> = std::fs::read_dir(store.root().join(".base"))
        .unwrap()
        .collect();
    assert!(
        bases.is_empty(),
        "failed base stage landed in the cache: {bases:?}"
    );
}

#[test]
fn fake_agent_is_a_static_executable() {
    let t = tempfile::tempdir().unwrap();
    let a = fake_static_agent(t.path(), 3);
    assert!(kiln_template::build::is_static_elf(&a).unwrap());
    let status = Command::new(&a).status().unwrap();
    assert_eq!(status.code(), Some(3));
}

#[test]
fn unknown_package_fails_and_caches_nothing() {
    if !runs_here() {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let store = Store::open(t.path().join("store")).unwrap();
    let r = recipe("badpkg", "\"kiln-no-such-package-xyz\"", "");
    let e = build(&store, &r, &opts(fake_static_agent(t.path(), 0))).unwrap_err();
    match &e {
        Error::BuildFailed { step, log, tail } => {
            assert!(step.contains("mmdebstrap"), "{step}");
            assert!(tail.contains("kiln-no-such-package-xyz"), "{tail}");
            assert!(Path::new(log).is_file());
        }
        other => panic!("expected BuildFailed, got {other}"),
    }
    assert_nothing_cached(&store, "badpkg");
}

#[test]
fn failing_run_step_is_named_with_log_tail() {
    if !runs_here() {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let store = Store::open(t.path().join("store")).unwrap();
    let r = recipe(
        "badstep",
        "",
        "[[steps]]\nrun = \"echo first > /first\"\n[[steps]]\nrun = \"echo about-to-fail; exit 7\"\n",
    );
    let e = build(&store, &r, &opts(fake_static_agent(t.path(), 0))).unwrap_err();
    let msg = e.to_string();
    match &e {
        Error::BuildFailed { step, tail, .. } => {
            assert!(step.starts_with("step 2/2"), "{step}");
            assert!(tail.contains("about-to-fail"), "{tail}");
        }
        other => panic!("expected BuildFailed, got {other}"),
    }
    assert!(msg.contains("Last lines of the log"), "{msg}");
    assert_nothing_cached(&store, "badstep");
}

fn debugfs_cat(image: &Path, path: &str) -> String {
    let out = Command::new("debugfs")
        .arg("-R")
        .arg(format!("cat {path}"))
        .arg(image)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).to_string()
}

#[test]
fn builds_then_is_cached_then_rebuilds_on_change() {
    if !runs_here() {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let store = Store::open(t.path().join("store")).unwrap();
    let agent = fake_static_agent(t.path(), 0);
    let steps = "[[steps]]\nrun = \"echo hello-$GREETING > /hello\"\n[[steps]]\nenv = { GREETING = \"x\" }\n[[steps]]\nrun = \"pwd > /where; echo $GREETING > /greeting\"\n[[steps]]\nfile = { path = \"/etc/kiln-test/conf\", content = \"a=1\\n\", mode = \"0600\" }\n[[steps]]\nworkdir = \"/srv/app\"\n[[steps]]\nrun = \"pwd > /where2\"\n";
    let r = recipe("good", "", steps);

    let first = build(&store, &r, &opts(agent.clone())).unwrap();
    assert!(!first.cached && !first.base_cached);
    let tpl = &first.template;
    let root = &tpl.rootfs;
    assert_eq!(
        std::fs::read_to_string(root.join("hello")).unwrap(),
        "hello-\n"
    );
    assert_eq!(
        std::fs::read_to_string(root.join("greeting")).unwrap(),
        "x\n"
    );
    assert_eq!(std::fs::read_to_string(root.join("where")).unwrap(), "/\n");
    assert_eq!(
        std::fs::read_to_string(root.join("where2")).unwrap(),
        "/srv/app\n"
    );
    use std::os::unix::fs::PermissionsExt;
    let conf = root.join("etc/kiln-test/conf");
    assert_eq!(std::fs::read_to_string(&conf).unwrap(), "a=1\n");
    assert_eq!(
        conf.metadata().unwrap().permissions().mode() & 0o7777,
        0o600
    );
    assert!(
        !root.join(".kiln-build").exists(),
        "build scratch left in rootfs"
    );
    assert_eq!(
        std::fs::read(root.join("usr/bin/kiln-agent")).unwrap(),
        std::fs::read(&agent).unwrap()
    );
    // No statx compat library unless KILN_STATX_COMPAT=1 (tests/statx_compat.rs covers both).
    assert!(!root
        .join(kiln_template::build::COMPAT_PATH_IN_ROOTFS)
        .exists());
    assert!(!std::fs::read_to_string(root.join("etc/ld.so.preload"))
        .unwrap_or_default()
        .contains("kiln"));
    assert_eq!(tpl.workdir, "/srv/app");
    assert_eq!(tpl.user, "root");
    assert_eq!(tpl.env.get("GREETING").map(String::as_str), Some("x"));
    // The ext4 image holds the same files.
    assert_eq!(debugfs_cat(&tpl.ext4, "/hello"), "hello-\n");
    assert_eq!(store.lookup("good").unwrap().key, tpl.key);

    // Nothing changed: cached, fast.
    let second = build(&store, &r, &opts(agent.clone())).unwrap();
    assert!(second.cached);
    assert_eq!(second.template.key, tpl.key);
    assert!(second.elapsed.as_secs_f64() < 1.0, "{:?}", second.elapsed);

    // A new agent: new key, but the mmdebstrap stage is reused.
    let agent2 = fake_static_agent(t.path(), 1);
    let third = build(&store, &r, &opts(agent2)).unwrap();
    assert!(!third.cached && third.base_cached);
    assert_ne!(third.template.key, tpl.key);
    assert_eq!(store.lookup("good").unwrap().key, third.template.key);

    // A recipe change rebuilds everything.
    let changed = recipe("good", "", &steps.replace("hello-", "bonjour-"));
    let fourth = build(&store, &changed, &opts(agent.clone())).unwrap();
    assert!(!fourth.cached && !fourth.base_cached);
    assert_eq!(
        std::fs::read_to_string(fourth.template.rootfs.join("hello")).unwrap(),
        "bonjour-\n"
    );
    assert_eq!(store.lookup("good").unwrap().key, fourth.template.key);

    // Going back to the first recipe and agent is a cache hit that makes it current again.
    let back = build(&store, &r, &opts(agent)).unwrap();
    assert!(back.cached);
    assert_eq!(back.template.key, tpl.key);
    assert_eq!(store.lookup("good").unwrap().key, tpl.key);
}
