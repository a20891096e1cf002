//! The metrics sampler reads a running gVisor sandbox's numbers from its host cgroup and
//! spawns no runsc process for them (it used to run `runsc events --stats` per sandbox per
//! sample): runsc is a wrapper here that logs every invocation before running the real one.

use crate::common;

use std::os::unix::fs::PermissionsExt;
use std::sync::Arc;

use kiln_server::templates::{from_dir, FixedTemplates};
use kiln_server::LifecycleConfig;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampling_spawns_no_runsc() {
    if !common::sandboxes_run() {
        return;
    }
    let real = kiln_testkit::host::runsc().unwrap_or_else(|e| panic!("{e}"));
    let tpl = tempfile::tempdir().unwrap();
    common::build_rootfs(tpl.path());
    let state = common::state_dir();
    let log = state.path().join("runsc-calls.log");
    let wrapper = state.path().join("runsc-wrapper");
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\necho \"$*\" >> {}\nexec {} \"$@\"\n",
            log.display(),
            real.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut cfg = common::driver_config();
    cfg.gvisor.runsc = Some(wrapper);
    let driver = common::build_driver(&cfg, state.path());
    let cleanup = common::Cleanup::new(driver.clone());
    let m = common::manager(
        state.path(),
        driver.clone(),
        Arc::new(FixedTemplates(vec![from_dir("t", tpl.path())])),
        LifecycleConfig {
            default_memory_mb: 256,
            default_disk_mb: 0,
            ..LifecycleConfig::default()
        },
    );
    let rec = m.create(common::params(300)).await.expect("create");
    cleanup.add(&rec.id);
    let calls = || std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        calls().contains("run"),
        "the wrapper was not used: {}",
        calls()
    );
    let before = calls().lines().count();

    for _ in 0..3 {
        m.sample_all().await;
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    let latest = m.latest_metrics(std::slice::from_ref(&rec.id)).await;
    let s = latest.get(&rec.id).expect("a sample");
    assert!(s.mem_used > 0 && s.mem_total == 256 << 20, "{s:?}");
    let after: Vec<String> = calls().lines().skip(before).map(String::from).collect();
    assert!(
        after.is_empty(),
        "sampling ran runsc: {after:?} (all calls: {})",
        calls()
    );

    assert!(m.kill(&rec.id, "test done").await.unwrap());
}
