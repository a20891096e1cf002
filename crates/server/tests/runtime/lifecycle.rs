//! Pause and resume with real gVisor sandboxes: a running process, files and environment
//! survive a pause with memory, a server restart in between, and an expired timeout while
//! paused; a filesystem-only pause keeps the files and boots again; autoPause pauses at
//! timeout instead of killing.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use kiln_envd::RunOptions;
use kiln_server::manager::CreateParams;
use kiln_server::store::{now_ms, PauseMode, SandboxState};
use kiln_server::{Error, LifecycleConfig, Manager};

use common::sh;

/// The counter's value (read again when caught mid-write).
pub(crate) async fn count(m: &Manager, id: &str) -> u64 {
    for _ in 0..10 {
        if let Ok(n) = sh(m, id, "cat /home/user/count").await.parse() {
            return n;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the counter file never held a number");
}

/// A process counting tenths of seconds into /home/user/count.
pub(crate) const COUNTER: &str =
    "i=0; while :; do i=$((i+1)); echo $i > /home/user/count; sleep 0.1; done";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_and_resume_keep_state_across_a_restart() {
    if !common::sandboxes_run() {
        return;
    }
    let mut rig = common::Rig::new(common::template_config());
    let driver = rig.driver.clone();
    let store = rig.store();

    let m1 = rig.manager.clone();
    let mut params = common::params(600);
    params
        .env_vars
        .insert("KEPT".into(), "across-pauses".into());
    let sbx = m1.create(params).await.expect("create");
    let id = sbx.id.clone();
    rig.cleanup.add(&id);
    sh(&m1, &id, &format!("bash -c '{COUNTER}' >/dev/null 2>&1 &")).await;
    sh(&m1, &id, "echo kept > /home/user/file").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = count(&m1, &id).await;
    assert!(before > 0);

    // Pause with memory: nothing runs on the host, the sandbox is listed as paused.
    m1.pause(&id, true).await.expect("pause");
    let rec = m1.get(&id).unwrap();
    assert_eq!(rec.state, SandboxState::Paused);
    assert_eq!(rec.pause_mode, Some(PauseMode::Full));
    assert!(m1.route(&id).is_none(), "a paused sandbox is not routable");
    assert!(!driver.is_running(&id).await.unwrap());
    assert!(driver.is_paused(&id).await.unwrap());
    assert!(
        matches!(m1.pause(&id, true).await, Err(Error::Conflict(_))),
        "pausing twice is a conflict"
    );
    let stored = store.get_sandbox(&id).await.unwrap().unwrap();
    assert_eq!(stored.state, SandboxState::Paused);

    // The server goes away; a new one keeps the sandbox paused.
    drop(m1);
    let m2 = rig.restart();
    let report = m2.recover().await.expect("recover");
    assert_eq!(report.paused, vec![id.clone()]);
    assert!(report.cleaned.is_empty() && report.orphans_removed.is_empty());
    assert_eq!(m2.get(&id).unwrap().state, SandboxState::Paused);

    // Its timeout runs out while paused: it is not killed.
    store.set_end_at(&id, now_ms() - 1000).await.unwrap();
    assert!(m2.reap_expired().await.is_empty());
    assert_eq!(m2.get(&id).unwrap().state, SandboxState::Paused);

    // Connect resumes it: the counter continues from where it was, files and env are there.
    let (rec, resumed) = m2.connect(&id, 600, true).await.expect("connect");
    assert!(resumed);
    assert_eq!(rec.state, SandboxState::Running);
    assert!(
        rec.end_at_ms > now_ms() + 500_000,
        "the new timeout counts from now"
    );
    let after = count(&m2, &id).await;
    assert!(
        after >= before && after < before + 30,
        "the counter restarted or jumped: {before} -> {after}"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(count(&m2, &id).await > after, "the counter process stopped");
    assert_eq!(sh(&m2, &id, "cat /home/user/file").await, "kept");
    assert_eq!(sh(&m2, &id, "echo $KEPT").await, "across-pauses");
    let (_, resumed) = m2.connect(&id, 600, true).await.expect("connect again");
    assert!(!resumed, "connecting to a running sandbox only extends it");

    // Filesystem-only pause: files stay, processes do not, the identity is set again.
    sh(&m2, &id, "echo second > /home/user/file2").await;
    m2.pause(&id, false).await.expect("filesystem pause");
    assert_eq!(m2.get(&id).unwrap().pause_mode, Some(PauseMode::Filesystem));
    let (_, resumed) = m2
        .connect(&id, 600, true)
        .await
        .expect("connect after fs pause");
    assert!(resumed);
    assert_eq!(
        sh(&m2, &id, "cat /home/user/file /home/user/file2").await,
        "kept\nsecond"
    );
    assert_eq!(sh(&m2, &id, "echo $KEPT").await, "across-pauses");
    // The counter file stays as the pause kept it (a half-written count, possibly, since the
    // counter truncates before it writes): nothing changes it any more.
    let kept = sh(&m2, &id, "cat /home/user/count").await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(
        sh(&m2, &id, "cat /home/user/count").await,
        kept,
        "a rebooted sandbox has no old processes"
    );

    // Killing a paused sandbox removes everything.
    m2.pause(&id, true).await.expect("pause again");
    assert!(m2.kill(&id, "test done").await.unwrap());
    assert!(common::mounts_under(rig.path()).is_empty());
    assert!(driver.list_on_host().await.unwrap().is_empty());
    assert!(common::processes_mentioning(&id).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_pause_at_timeout_then_connect() {
    if !common::sandboxes_run() {
        return;
    }
    let rig = common::Rig::new(common::template_config());
    let m = rig.manager.clone();
    let reaper = m.spawn_reaper();
    let sbx = m
        .create(CreateParams {
            template_id: "t".into(),
            timeout_secs: Some(2),
            secure: true,
            auto_pause: true,
            auto_resume: true,
            ..Default::default()
        })
        .await
        .expect("create");
    rig.cleanup.add(&sbx.id);
    sh(&m, &sbx.id, "echo before > /tmp/mark").await;
    let t = std::time::Instant::now();
    while m.get(&sbx.id).unwrap().state != SandboxState::Paused {
        assert!(t.elapsed() < Duration::from_secs(20), "never auto-paused");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Still paused a while later (not killed by the reaper), memory kept.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(m.get(&sbx.id).unwrap().state, SandboxState::Paused);
    assert_eq!(m.get(&sbx.id).unwrap().pause_mode, Some(PauseMode::Full));
    // Traffic through the proxy's route resumes it.
    let (route, _in_use) = m
        .route_resuming(&sbx.id, "a test")
        .await
        .expect("auto-resumed");
    assert_eq!(route.envd_token, sbx.envd_token);
    assert_eq!(sh(&m, &sbx.id, "cat /tmp/mark").await, "before");
    reaper.abort();
    assert!(m.kill(&sbx.id, "test done").await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_outlive_their_source_and_start_sandboxes() {
    if !common::sandboxes_run() {
        return;
    }
    let rig = common::Rig::new(common::template_config());
    let driver = rig.driver.clone();
    let m = rig.manager.clone();
    let params = |template: &str| {
        let mut p = CreateParams {
            template_id: template.into(),
            timeout_secs: Some(600),
            secure: true,
            ..Default::default()
        };
        p.env_vars.insert("KEPT".into(), "in-snapshot".into());
        p
    };
    let src = m.create(params("t")).await.expect("create");
    rig.cleanup.add(&src.id);
    sh(
        &m,
        &src.id,
        &format!("bash -c '{COUNTER}' >/dev/null 2>&1 &"),
    )
    .await;
    sh(&m, &src.id, "echo kept > /home/user/file").await;
    tokio::time::sleep(Duration::from_millis(400)).await;

    let snap = m
        .snapshot(&src.id, "default", Some("snap-a".into()))
        .await
        .expect("snapshot");
    assert!(kiln_server::manager::is_snapshot_id(&snap.id));
    assert!(snap.size_bytes > 0, "disk used is reported");
    let snap_dir = rig.path().join("gvisor/snapshots").join(&snap.id);
    assert!(snap_dir.is_dir());
    // The source keeps running, its counter too.
    let c = count(&m, &src.id).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(count(&m, &src.id).await > c, "the source stopped counting");
    assert!(matches!(
        m.snapshot(&src.id, "default", Some("snap-a".into())).await,
        Err(Error::Conflict(_))
    ));
    assert!(matches!(
        m.snapshot(&src.id, "default", Some("../x".into())).await,
        Err(Error::BadRequest(_))
    ));
    // The snapshot outlives its source.
    assert!(m.kill(&src.id, "source done").await.unwrap());

    let by_id = m
        .create(params(&kiln_server::manager::tagged(&snap.id)))
        .await
        .expect("create from snapshot id");
    rig.cleanup.add(&by_id.id);
    let by_name = m.create(params("snap-a")).await.expect("create from name");
    rig.cleanup.add(&by_name.id);
    for s in [&by_id, &by_name] {
        assert_ne!(
            s.envd_token, src.envd_token,
            "a restored sandbox has its own token"
        );
        assert_eq!(sh(&m, &s.id, "cat /home/user/file").await, "kept");
        assert_eq!(sh(&m, &s.id, "echo $KEPT").await, "in-snapshot");
        let c = count(&m, &s.id).await;
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert!(
            count(&m, &s.id).await > c,
            "the snapshot's process does not run"
        );
    }
    // The old token no longer opens the restored agent.
    assert!(m
        .agent(&by_id.id, src.envd_token.clone())
        .run("true", RunOptions::default())
        .await
        .is_err());
    // Each continues on its own layer.
    sh(&m, &by_id.id, "echo mine > /home/user/file").await;
    assert_eq!(sh(&m, &by_name.id, "cat /home/user/file").await, "kept");

    assert_eq!(m.snapshots("default", None, None).await.unwrap().len(), 1);
    assert_eq!(
        m.snapshots("default", Some(&src.id), Some("snap-a"))
            .await
            .unwrap()[0]
            .id,
        snap.id
    );
    assert!(matches!(
        m.delete_snapshot("../../etc/passwd", "default").await,
        Err(Error::BadRequest(_))
    ));
    m.delete_snapshot(&kiln_server::manager::tagged(&snap.id), "default")
        .await
        .expect("delete");
    assert!(!snap_dir.exists(), "deleting a snapshot frees its disk");
    assert!(m.snapshots("default", None, None).await.unwrap().is_empty());
    assert!(matches!(
        m.delete_snapshot(&snap.id, "default").await,
        Err(Error::NotFound(_))
    ));
    // Sandboxes restored from it keep working: its frozen layer stays while they use it.
    assert_eq!(sh(&m, &by_name.id, "cat /home/user/file").await, "kept");
    let layers = rig.path().join("gvisor/layers");
    assert_eq!(layer_count(&layers), 1);
    for s in [&by_id, &by_name] {
        assert!(m.kill(&s.id, "test done").await.unwrap());
    }
    assert!(common::mounts_under(rig.path()).is_empty());
    assert_eq!(layer_count(&layers), 0, "unused layers are removed");
    assert!(driver.list_on_host().await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fork_children_continue_from_the_parent_and_diverge() {
    if !common::sandboxes_run() {
        return;
    }
    let rig = common::Rig::new(common::template_config());
    let m = rig.manager.clone();
    let mut params = common::params(600);
    params.env_vars.insert("KEPT".into(), "forked".into());
    let parent = m.create(params).await.expect("create");
    rig.cleanup.add(&parent.id);
    sh(
        &m,
        &parent.id,
        &format!("bash -c '{COUNTER}' >/dev/null 2>&1 &"),
    )
    .await;
    sh(&m, &parent.id, "echo parent > /home/user/file").await;
    // 8 MB the parent wrote: children share it, they do not copy it.
    sh(
        &m,
        &parent.id,
        "head -c 8000000 /dev/zero > /home/user/big && echo ok",
    )
    .await;
    tokio::time::sleep(Duration::from_millis(400)).await;

    assert!(matches!(
        m.fork(&parent.id, 0, None).await,
        Err(Error::BadRequest(_))
    ));
    assert!(matches!(
        m.fork(&parent.id, 21, None).await,
        Err(Error::BadRequest(_))
    ));
    let children = m.fork(&parent.id, 3, Some(300)).await.expect("fork");
    assert_eq!(children.len(), 3);
    let children: Vec<_> = children.into_iter().map(|c| c.expect("child")).collect();
    for c in &children {
        rig.cleanup.add(&c.id);
    }
    let mut ids: Vec<&str> = children.iter().map(|c| c.id.as_str()).collect();
    ids.push(&parent.id);
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 4, "every child has its own id");
    // Parent still runs; children see its state and run its process.
    let c = count(&m, &parent.id).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(count(&m, &parent.id).await > c);
    for (i, child) in children.iter().enumerate() {
        assert_ne!(child.envd_token, parent.envd_token);
        assert_eq!(sh(&m, &child.id, "cat /home/user/file").await, "parent");
        assert_eq!(sh(&m, &child.id, "echo $KEPT").await, "forked");
        let c = count(&m, &child.id).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            count(&m, &child.id).await > c,
            "child {i} does not run the counter"
        );
        sh(&m, &child.id, &format!("echo child{i} > /home/user/file")).await;
    }
    // A child's own layer holds what it wrote, not the parent's 8 MB; the parent's layer
    // is frozen once, shared by all.
    let du = |p: std::path::PathBuf| -> u64 {
        // (A frozen layer's disk image beside it is the sparse file of a whole disk.)
        let out = std::process::Command::new("du")
            .args(["-sb", "--exclude=*.img", p.to_str().unwrap()])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    let sandboxes = rig.path().join("gvisor/sandboxes");
    for c in children.iter().map(|c| &c.id).chain([&parent.id]) {
        // The writable layer is on the sandbox's own disk (the quota) when it has one.
        let dir = sandboxes.join(c);
        let own = du(if dir.join("disk.img").exists() {
            dir.join("disk/upper")
        } else {
            dir.join("upper")
        });
        assert!(own < 1_000_000, "{c}'s own layer is {own} bytes");
    }
    let layers = du(rig.path().join("gvisor/layers"));
    assert!(
        (8_000_000..12_000_000).contains(&layers),
        "the frozen layers hold {layers} bytes"
    );
    // They diverge independently.
    for (i, child) in children.iter().enumerate() {
        assert_eq!(
            sh(&m, &child.id, "cat /home/user/file").await,
            format!("child{i}")
        );
    }
    assert_eq!(sh(&m, &parent.id, "cat /home/user/file").await, "parent");
    // The capture a fork makes is not left behind.
    assert!(m.snapshots("default", None, None).await.unwrap().is_empty());
    let snaps = rig.path().join("gvisor/snapshots");
    assert_eq!(std::fs::read_dir(&snaps).map(|d| d.count()).unwrap_or(0), 0);
    for id in children.iter().map(|c| &c.id).chain([&parent.id]) {
        assert!(m.kill(id, "test done").await.unwrap());
    }
    assert!(common::mounts_under(rig.path()).is_empty());
    // Once nothing stacks on the frozen layer, it is removed.
    let layers = rig.path().join("gvisor/layers");
    assert_eq!(
        std::fs::read_dir(&layers).map(|d| d.count()).unwrap_or(0),
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_pool_sandboxes_get_the_request_identity_and_are_refilled() {
    if !common::sandboxes_run() {
        return;
    }
    let mut rig = common::Rig::new(LifecycleConfig {
        default_memory_mb: 256,
        pools: vec![("t".into(), 2)],
        ..LifecycleConfig::default()
    });
    let driver = rig.driver.clone();
    let m = rig.manager.clone();
    let filler = m.spawn_pools().expect("a pool is configured");
    let wait_full = |m: Arc<Manager>| async move {
        let t = std::time::Instant::now();
        while m.pool_ready("t") < 2 {
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "the pool never filled"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    wait_full(m.clone()).await;
    for h in driver.list_on_host().await.unwrap() {
        rig.cleanup.add(&h.id);
    }

    let mut params = common::params(600);
    params
        .env_vars
        .insert("FROM_REQUEST".into(), "pooled".into());
    let t = std::time::Instant::now();
    let sbx = m.create(params).await.expect("create from the pool");
    let took = t.elapsed();
    rig.cleanup.add(&sbx.id);
    let logs = m.logs(&sbx.id, "default").await.unwrap();
    assert!(
        logs.events.iter().any(|e| e.detail.contains("warm pool")),
        "not taken from the pool: {:?}",
        logs.events
    );
    assert_eq!(m.pool_ready("t"), 1);
    // Indistinguishable: the request's environment and token apply.
    assert_eq!(sh(&m, &sbx.id, "echo $FROM_REQUEST").await, "pooled");
    assert!(m
        .agent(&sbx.id, None)
        .run("true", RunOptions::default())
        .await
        .is_err());
    assert!(
        took < Duration::from_secs(5),
        "a pooled create took {took:?}"
    );
    // Refilled in the background.
    wait_full(m.clone()).await;
    filler.abort();
    for h in driver.list_on_host().await.unwrap() {
        rig.cleanup.add(&h.id);
    }
    assert!(m.kill(&sbx.id, "test done").await.unwrap());
    // After a restart the pooled sandboxes are leftovers, removed by recovery.
    drop(m);
    let m2 = rig.restart();
    let report = m2.recover().await.unwrap();
    assert_eq!(report.orphans_removed.len(), 2, "{report:?}");
    assert!(driver.list_on_host().await.unwrap().is_empty());
    assert!(common::mounts_under(rig.path()).is_empty());
}

/// The server dies between the driver's pause and the store's update (`kill -9` mid-pause):
/// the sandbox is found paused, not lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_cut_short_by_a_crash_is_recovered_as_paused() {
    if !common::sandboxes_run() {
        return;
    }
    let mut rig = common::Rig::new(common::template_config());
    let driver = rig.driver.clone();
    let store = rig.store();
    let m1 = rig.manager.clone();
    let sbx = m1.create(common::params(600)).await.expect("create");
    rig.cleanup.add(&sbx.id);
    sh(&m1, &sbx.id, "echo before-crash > /home/user/f").await;
    driver.pause(&sbx.id, true).await.expect("driver pause");
    drop(m1);
    assert_eq!(
        store.get_sandbox(&sbx.id).await.unwrap().unwrap().state,
        SandboxState::Running,
        "the store never heard of the pause"
    );
    let m2 = rig.restart();
    let report = m2.recover().await.expect("recover");
    assert_eq!(report.paused, vec![sbx.id.clone()]);
    assert_eq!(
        store.get_sandbox(&sbx.id).await.unwrap().unwrap().state,
        SandboxState::Paused
    );
    let (_, resumed) = m2.connect(&sbx.id, 600, true).await.expect("connect");
    assert!(resumed);
    assert_eq!(sh(&m2, &sbx.id, "cat /home/user/f").await, "before-crash");
    assert!(m2.kill(&sbx.id, "test done").await.unwrap());
}

/// Frozen layers in `layers` (not counting the disk images of layers frozen with a quota).
fn layer_count(layers: &std::path::Path) -> usize {
    std::fs::read_dir(layers)
        .unwrap()
        .flatten()
        .filter(|e| !e.file_name().to_string_lossy().ends_with(".img"))
        .count()
}
