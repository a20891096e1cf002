//! Snapshot and pause options with real gVisor sandboxes: a filesystem-only snapshot (E2B's
//! `mode: "filesystem"`) keeps the disk and boots fresh; `requireHealthyGuest` refuses to pause
//! a sandbox whose agent does not answer; a pause leaves no container behind once settled; a
//! disk snapshot that ends its source (a template build's last layer) keeps what it wrote.

use crate::common;

use std::time::Duration;

use kiln_server::manager::CreateParams;
use kiln_server::store::SandboxState;
use kiln_server::Error;

use common::run_in as sh;

fn params(template: &str) -> CreateParams {
    CreateParams {
        template_id: template.into(),
        timeout_secs: Some(600),
        secure: true,
        ..Default::default()
    }
}

/// Exits 0 when a `sleep` process runs in the sandbox (its tools have no pgrep).
const SLEEP_RUNS: &str = "bash -c 'for f in /proc/[0-9]*/comm; do read c < $f; \
                          [ \"$c\" = sleep ] && exit 0; done; exit 1'";

/// Whether the agent of sandbox `id` answers `GET /health` within 300 ms.
async fn answers_health(
    driver: &std::sync::Arc<dyn kiln_server::driver::Driver>,
    id: &str,
) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut s) = driver.connect(id, kiln_proto::envd::ENVD_PORT).await else {
        return false;
    };
    let asked = s
        .write_all(b"GET /health HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\r\n")
        .await;
    let mut head = [0u8; 12];
    let read = tokio::time::timeout(Duration::from_millis(300), s.read(&mut head)).await;
    asked.is_ok() && matches!(read, Ok(Ok(n)) if n > 0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_filesystem_snapshot_keeps_the_disk_and_boots_fresh() {
    if !common::sandboxes_run() {
        return;
    }
    let rig = common::Rig::new(common::template_config());
    let m = rig.manager.clone();

    let src = m.create(params("t")).await.expect("create");
    rig.cleanup.add(&src.id);
    assert_eq!(sh(&m, &src.id, "echo kept > /home/user/file").await.0, 0);
    // A process that only a memory snapshot would carry over.
    assert_eq!(sh(&m, &src.id, "sleep 1000 >/dev/null 2>&1 &").await.0, 0);
    let snap = m
        .snapshot_with(&src.id, "default", Some("disk-only".into()), false)
        .await
        .expect("filesystem snapshot");
    let snap_dir = rig.path().join("gvisor/snapshots").join(&snap.id);
    assert!(
        !snap_dir.join("checkpoint/checkpoint.img").exists(),
        "a filesystem snapshot keeps no memory image"
    );
    // The source continues with its processes.
    assert_eq!(sh(&m, &src.id, SLEEP_RUNS).await.0, 0);

    let child = m.create(params("disk-only")).await.expect("create from it");
    rig.cleanup.add(&child.id);
    assert_eq!(sh(&m, &child.id, "cat /home/user/file").await.1, "kept");
    assert_ne!(
        sh(&m, &child.id, SLEEP_RUNS).await.0,
        0,
        "a fresh boot has none of the source's processes"
    );
    // The capture moved aside for the source's own restore is gone once it continued.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let src_dir = rig.path().join("gvisor/sandboxes").join(&src.id);
    assert!(!src_dir.join("capture").exists());
    for id in [&src.id, &child.id] {
        assert!(m.kill(id, "test done").await.unwrap());
    }
    m.delete_snapshot(&snap.id, "default")
        .await
        .expect("delete");
    assert!(common::mounts_under(rig.path()).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_healthy_guest_refuses_a_silent_agent_and_pause_settles() {
    if !common::sandboxes_run() {
        return;
    }
    let rig = common::Rig::new(common::template_config());
    let driver = rig.driver.clone();
    let m = rig.manager.clone();
    let runsc = kiln_testkit::host::runsc().unwrap_or_else(|e| panic!("{e}"));
    let root = rig.path().join("gvisor/runsc");

    let sb = m.create(params("t")).await.expect("create");
    rig.cleanup.add(&sb.id);
    // A healthy guest pauses with the check, and resumes.
    m.pause_checked(&sb.id, true, true)
        .await
        .expect("pause of a healthy guest");
    assert_eq!(m.get(&sb.id).unwrap().state, SandboxState::Paused);
    assert!(m.resume(&sb.id, true, 600).await.expect("resume"));
    let dir = rig.path().join("gvisor/sandboxes").join(&sb.id);
    assert_eq!(sh(&m, &sb.id, "echo back").await.1, "back");
    // The resumed sandbox runs under its next container id; the paused container was
    // deleted in the background (not before the resume).
    let cid = format!("g1-{}", sb.id);
    let runsc_state = |c: &str| {
        std::process::Command::new(&runsc)
            .arg(format!("--root={}", root.display()))
            .args(["state", c])
            .output()
            .unwrap()
    };
    let now = runsc_state(&cid);
    assert!(now.status.success(), "{now:?}");
    assert!(String::from_utf8_lossy(&now.stdout).contains("\"running\""));
    let mut old_gone = false;
    for _ in 0..2000 {
        // (Exactly that id: runsc's `state` also takes a prefix, and matches the new one.)
        let list = std::process::Command::new(&runsc)
            .arg(format!("--root={}", root.display()))
            .args(["list", "--quiet"])
            .output()
            .unwrap();
        old_gone = !String::from_utf8_lossy(&list.stdout)
            .lines()
            .any(|l| l == sb.id)
            && !dir.join("retiring").join(&sb.id).exists();
        if old_gone {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        old_gone,
        "the paused container was not deleted: {:?}, retiring: {:?}",
        runsc_state(&cid),
        std::fs::read_dir(dir.join("retiring")).map(|d| d.count())
    );

    // The agent stops answering: it is stopped (SIGSTOP from the host; a detach asked from
    // inside is refused while the directory at /run/kiln is sealed).
    let status = std::process::Command::new(&runsc)
        .arg(format!("--root={}", root.display()))
        .args(["kill", &cid, "STOP"])
        .status()
        .unwrap();
    assert!(status.success());
    let mut silent = false;
    for _ in 0..50 {
        if !answers_health(&driver, &sb.id).await {
            silent = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(silent, "the agent did not detach");
    let refused = m.pause_checked(&sb.id, true, true).await;
    match refused {
        Err(Error::Conflict(msg)) => {
            assert!(msg.contains("requireHealthyGuest"), "{msg}");
            assert!(!msg.contains(rig.path().to_str().unwrap()), "{msg}");
        }
        other => panic!("expected 409, got {other:?}"),
    }
    assert_eq!(
        m.get(&sb.id).unwrap().state,
        SandboxState::Running,
        "nothing was saved"
    );
    assert!(driver.is_running(&sb.id).await.unwrap());
    assert!(m.kill(&sb.id, "test done").await.unwrap());
    assert!(common::mounts_under(rig.path()).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_that_ends_its_source_keeps_its_writes() {
    if !common::sandboxes_run() {
        return;
    }
    let rig = common::Rig::new(common::template_config());
    let driver = rig.driver.clone();
    let m = rig.manager.clone();
    let sums = "md5sum /home/user/big /home/user/more 2>/dev/null; cat /home/user/file";
    let mut from = "t".to_string();
    let mut expected = String::new();
    let mut snaps = Vec::new();
    // Two generations: the second ends a sandbox that itself started from an ended one.
    for (gen, write) in [
        "echo kept > /home/user/file; head -c 4194304 /dev/urandom > /home/user/big",
        "head -c 1048576 /dev/urandom > /home/user/more; echo again >> /home/user/file",
    ]
    .iter()
    .enumerate()
    {
        let src = m.create(params(&from)).await.expect("create");
        rig.cleanup.add(&src.id);
        if !expected.is_empty() {
            assert_eq!(sh(&m, &src.id, sums).await.1, expected, "generation {gen}");
        }
        assert_eq!(sh(&m, &src.id, write).await.0, 0);
        expected = sh(&m, &src.id, sums).await.1;
        let snap = m
            .snapshot_ending(&src.id, "default", "test: its layer is saved")
            .await
            .expect("a snapshot that ends its source");
        let snap_dir = rig.path().join("gvisor/snapshots").join(&snap.id);
        assert!(snap_dir.join("snapshot.json").exists());
        assert!(
            !snap_dir.join("checkpoint/checkpoint.img").exists(),
            "no memory image"
        );
        // The source is gone: not running, not listed as running, its files removed.
        assert!(!driver.is_running(&src.id).await.unwrap_or(false));
        assert!(!m
            .get(&src.id)
            .is_ok_and(|r| r.state == SandboxState::Running));
        let src_dir = rig.path().join("gvisor/sandboxes").join(&src.id);
        for _ in 0..1000 {
            if !src_dir.exists() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(!src_dir.exists(), "the ended source's files stay");
        from = snap.id.clone();
        snaps.push(snap.id);
    }
    let child = m.create(params(&from)).await.expect("create from it");
    rig.cleanup.add(&child.id);
    let seen = sh(&m, &child.id, sums).await.1;
    assert_eq!(seen, expected);
    assert!(seen.ends_with("kept\nagain"), "{seen}");
    assert!(m.kill(&child.id, "test done").await.unwrap());
    // The saved layers are mounted while a snapshot holds them, and no longer once both
    // are deleted (the newer first: it stacks on the older).
    for id in snaps.iter().rev() {
        m.delete_snapshot(id, "default")
            .await
            .expect("delete a snapshot");
    }
    assert_eq!(common::mounts_under(rig.path()), Vec::<String>::new());
}
