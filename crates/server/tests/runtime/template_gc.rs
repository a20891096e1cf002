//! `kiln template gc` with real gVisor sandboxes: a template version that a paused sandbox or
//! a running one stacks on stays until nothing uses it, even when it is neither current nor
//! among the newest; the paused sandbox resumes on it.

use crate::common;

use std::path::Path;
use std::sync::Arc;

use kiln_gvisor::in_use;
use kiln_template::{Store, Template};

/// Publishes version `key` of template `t` in the store at `root` by hand (the minimal rootfs
/// of the tests, no mmdebstrap), built at time `at`.
fn version(root: &Path, key: &str, at: u64) {
    let dir = root.join("t").join(key);
    common::build_rootfs(&dir.join("rootfs"));
    let meta = Template {
        name: "t".into(),
        key: key.into(),
        recipe_hash: format!("r-{key}"),
        base_stage: None,
        agent_sha256: "a".into(),
        dir: Default::default(),
        rootfs: Default::default(),
        ext4: Default::default(),
        user: "user".into(),
        workdir: "/home/user".into(),
        env: Default::default(),
        start_cmd: None,
        ready_cmd: None,
        memory_mb: None,
        disk_mb: None,
        built_at_unix: at,
        size_bytes: 0,
        build_secs: 0.0,
    };
    std::fs::write(
        dir.join("template.json"),
        serde_json::to_vec(&meta).unwrap(),
    )
    .unwrap();
}

fn make_current(root: &Path, key: &str) {
    let link = root.join("t/current");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(key, &link).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_keeps_the_versions_sandboxes_stack_on() {
    if !common::sandboxes_run() {
        return;
    }
    let g = common::Ground::new();
    let cache = tempfile::tempdir().unwrap();
    let store = Store::open(cache.path()).unwrap();
    version(cache.path(), "k1", 1);
    make_current(cache.path(), "k1");
    let m = common::manager(
        g.path(),
        g.driver.clone(),
        Arc::new(store.clone()),
        common::template_config(),
    );
    let paused = m.create(common::params(600)).await.expect("create");
    g.cleanup.add(&paused.id);
    let running = m.create(common::params(600)).await.expect("create");
    g.cleanup.add(&running.id);
    common::sh(&m, &paused.id, "echo kept > /home/user/f").await;
    m.pause(&paused.id, true).await.expect("pause");

    // A rebuild: k2 is current and the newest; k1 is neither.
    version(cache.path(), "k2", 2);
    make_current(cache.path(), "k2");
    let gc = || {
        let refs = in_use::references(&g.path().join("gvisor"));
        store
            .gc(0, |d| in_use::is_referenced(&refs, d))
            .expect("gc")
    };
    let v1 = cache.path().join("t/k1");
    assert!(gc().is_empty(), "removed a version in use");
    assert!(v1.join("rootfs").is_dir());

    // The paused sandbox resumes on its own version.
    let (_, resumed) = m.connect(&paused.id, 600, true).await.expect("connect");
    assert!(resumed);
    assert_eq!(common::sh(&m, &paused.id, "cat /home/user/f").await, "kept");
    assert!(m.kill(&paused.id, "test done").await.unwrap());
    // The running one still stacks on k1.
    assert!(
        gc().is_empty(),
        "removed the version a running sandbox uses"
    );
    assert_eq!(common::sh(&m, &running.id, "echo alive").await, "alive");
    assert!(m.kill(&running.id, "test done").await.unwrap());

    // Nothing uses k1 any more: it goes, with its base; k2 (current) stays.
    let removed = gc();
    assert!(removed.contains(&v1), "{removed:?}");
    assert!(!v1.exists());
    assert_eq!(store.lookup("t").unwrap().key, "k2");
}
