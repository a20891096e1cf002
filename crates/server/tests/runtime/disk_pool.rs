//! The gVisor driver's pool of ready disks (`driver/gvisor/disk_pool.rs`) with real sandboxes:
//! a create with a disk quota gets a disk the pool already mounted, moved into place (the same
//! mount, not a new one), the sandbox writes onto it within its size, and a server that goes
//! away without cleaning up leaves no stray mount once the next one has started and shut down
//! (compared in /proc/self/mountinfo).

use crate::common;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kiln_server::templates::{from_dir, FixedTemplates, Templates};
use kiln_server::{LifecycleConfig, Manager};

const DISK_MB: u32 = 64;

/// (mount id, mount point) of everything mounted at or under `dir`, the pool included.
fn mounts(dir: &Path) -> Vec<(u64, String)> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let d = dir.to_string_lossy().to_string();
    info.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            Some((f.first()?.parse().ok()?, f.get(4)?.to_string()))
        })
        .filter(|(_, mp)| mp.starts_with(&d))
        .collect()
}

async fn create(m: &Manager) -> String {
    m.create(common::params(600)).await.expect("create").id
}

/// Waits until the pool holds `n` mounted disks (besides its own mount, `mnt`); their mount
/// ids.
async fn pooled(pool: &Path, n: usize) -> Vec<u64> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let disks: Vec<u64> = mounts(pool)
            .into_iter()
            .filter(|(_, mp)| Path::new(mp) != pool.join("mnt"))
            .map(|(id, _)| id)
            .collect();
        if disks.len() >= n {
            return disks;
        }
        assert!(
            Instant::now() < deadline,
            "the pool did not fill: {disks:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creates_take_mounted_disks_and_a_restart_leaves_no_stray_mount() {
    if !common::sandboxes_run() {
        return;
    }
    let tpl = tempfile::tempdir().unwrap();
    common::build_rootfs(tpl.path());
    let state = common::state_dir();
    let before = mounts(state.path());
    assert!(before.is_empty(), "{before:?}");
    let pool = state.path().join("gvisor/disk-pool");
    let cfg = || LifecycleConfig {
        default_memory_mb: 256,
        default_disk_mb: DISK_MB,
        ..LifecycleConfig::default()
    };
    let templates: Arc<dyn Templates> = Arc::new(FixedTemplates(vec![from_dir("t", tpl.path())]));
    let driver = common::driver(state.path());
    let cleanup = common::Cleanup::new(driver.clone());

    // The first create finds the pool empty (a new size) and fills it behind itself.
    let m1 = common::manager(state.path(), driver.clone(), templates.clone(), cfg());
    let a = create(&m1).await;
    cleanup.add(&a);
    let ready = pooled(&pool, 2).await;

    // The next create takes one of those mounts: the same mount (its id), moved.
    let b = create(&m1).await;
    cleanup.add(&b);
    let disk_b = state.path().join(format!("gvisor/sandboxes/{b}/disk"));
    let (mount_b, _) = mounts(&disk_b)
        .into_iter()
        .next()
        .unwrap_or_else(|| panic!("no disk mounted for {b}"));
    assert!(
        ready.contains(&mount_b),
        "{b}'s disk (mount {mount_b}) is not one of the pooled mounts {ready:?}"
    );
    // What the sandbox writes lands on that disk, and the disk bounds it.
    common::sh(&m1, &b, "echo moved > /home/user/x").await;
    assert_eq!(
        std::fs::read_to_string(disk_b.join("upper/home/user/x")).unwrap(),
        "moved\n"
    );
    let (code, out) = common::run_in(
        &m1,
        &b,
        &format!(
            "head -c {} /dev/zero 2>&1 > /home/user/big",
            (DISK_MB + 16) << 20
        ),
    )
    .await;
    assert_ne!(code, 0, "wrote past the quota: {out}");
    assert!(out.contains("No space left"), "{out}");
    assert_eq!(
        common::sh(&m1, &b, "rm /home/user/big && echo ok").await,
        "ok"
    );
    pooled(&pool, 2).await;

    // The server goes away without shutting down: its pooled disks stay mounted.
    drop(m1);
    assert!(mounts(&pool).len() > 1);

    // The next one unmounts them as it starts, and adopts the sandboxes with their disks.
    let driver2 = common::driver(state.path());
    assert!(
        mounts(&pool).is_empty(),
        "the old pool's mounts: {:?}",
        mounts(&pool)
    );
    let m2 = common::manager(state.path(), driver2.clone(), templates, cfg());
    let report = m2.recover().await.expect("recover");
    assert_eq!(report.adopted.len(), 2, "{report:?}");
    assert_eq!(common::sh(&m2, &b, "cat /home/user/x").await, "moved");
    let c = create(&m2).await;
    cleanup.add(&c);
    common::sh(&m2, &c, "echo new > /home/user/y").await;
    let disk_c = state
        .path()
        .join(format!("gvisor/sandboxes/{c}/disk/upper/home/user/y"));
    assert_eq!(
        std::fs::read_to_string(disk_c).unwrap(),
        "new
"
    );
    pooled(&pool, 2).await;

    for id in [&a, &b, &c] {
        assert!(m2.kill(id, "test done").await.unwrap());
    }
    m2.shutdown_driver().await;
    assert_eq!(mounts(state.path()), before, "mounts left behind");
    assert!(!pool.exists());
    drop(driver);
}
