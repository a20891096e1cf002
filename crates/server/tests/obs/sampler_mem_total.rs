//! `memTotal` is the sandbox's recorded size even when its host cgroup's limit is not what
//! this server would set (a sandbox started, and adopted, from an older server whose headroom
//! formula differed): the limit is rewritten here to a value the current formula cannot map
//! back to a size, as an old server's would be.

use crate::common;

use kiln_server::LifecycleConfig;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mem_total_is_the_recorded_size_whatever_the_host_limit() {
    if !common::sandboxes_run() {
        return;
    }
    let rig = common::Rig::new(LifecycleConfig {
        default_memory_mb: 256,
        default_disk_mb: 0,
        ..LifecycleConfig::default()
    });
    let m = rig.manager.clone();
    let rec = m.create(common::params(300)).await.expect("create");
    rig.cleanup.add(&rec.id);
    // A first-generation sandbox's container id is its id.
    let limit = [
        format!(
            "/sys/fs/cgroup/memory/kiln/{}/memory.limit_in_bytes",
            rec.id
        ),
        format!("/sys/fs/cgroup/kiln/{}/memory.max", rec.id),
        format!("/sys/fs/cgroup/unified/kiln/{}/memory.max", rec.id),
    ]
    .into_iter()
    .find(|p| std::path::Path::new(p).exists())
    .expect("the sandbox's memory cgroup");
    // 2 GiB: above the current host limit of a 256 MiB sandbox, and no size's limit.
    std::fs::write(&limit, format!("{}", 2u64 << 30)).unwrap();
    assert_eq!(
        rig.driver.stats(&rec.id).await.unwrap().mem_limit_bytes,
        2 << 30,
        "the driver reports the odd limit as is"
    );
    m.sample_all().await;
    let latest = m.latest_metrics(std::slice::from_ref(&rec.id)).await;
    let s = latest.get(&rec.id).expect("a sample");
    assert_eq!(s.mem_total, 256 << 20, "{s:?}");
    assert!(m.kill(&rec.id, "test done").await.unwrap());
}
