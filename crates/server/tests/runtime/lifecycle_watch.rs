//! The dead-runtime watcher and the metrics sampler never take a sandbox that pauses, resumes
//! and forks for a dead one: both run in tight loops (every few ms, instead of every second)
//! while a real gVisor sandbox goes through pause → resume → fork rounds, each round checked
//! right after the resume (the moment a fork once found its parent gone).

use crate::common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kiln_server::store::SandboxState;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watcher_and_sampler_never_judge_a_sandbox_mid_lifecycle_dead() {
    if !common::sandboxes_run() {
        return;
    }
    let rig = common::Rig::new(common::template_config());
    let (state, cleanup, m) = (&rig.state, &rig.cleanup, &rig.manager);
    let sbx = m.create(common::params(600)).await.expect("create");
    cleanup.add(&sbx.id);
    common::sh(m, &sbx.id, "echo kept > /home/user/f").await;
    eprintln!("parent {}", sbx.id);

    let stop = Arc::new(AtomicBool::new(false));
    let watch = |sampler: bool| {
        let (m, stop) = (m.clone(), stop.clone());
        tokio::spawn(async move {
            let mut died = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                match sampler {
                    true => m.sample_all().await,
                    false => died.extend(m.reap_dead().await),
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            died
        })
    };
    let (watcher, sampler) = (watch(false), watch(true));

    for round in 0..4 {
        m.pause(&sbx.id, true).await.expect("pause");
        let (_, resumed) = m.connect(&sbx.id, 600, true).await.expect("connect");
        assert!(resumed, "round {round}");
        // Right after the resume: still registered, running, and forkable.
        let rec = m
            .get(&sbx.id)
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        assert_eq!(rec.state, SandboxState::Running, "round {round}");
        let children = m.fork(&sbx.id, 1, Some(600)).await.expect("fork");
        for c in children {
            let c = c.expect("child");
            cleanup.add(&c.id);
            assert_eq!(common::sh(m, &c.id, "cat /home/user/f").await, "kept");
            assert!(m.kill(&c.id, "test").await.unwrap());
        }
        assert_eq!(common::sh(m, &sbx.id, "cat /home/user/f").await, "kept");
    }

    stop.store(true, Ordering::SeqCst);
    let died = watcher.await.unwrap();
    sampler.await.unwrap();
    assert!(died.is_empty(), "judged dead: {died:?}");
    let rec = m.get(&sbx.id).expect("the sandbox is still registered");
    assert_eq!(rec.state, SandboxState::Running);
    // Every container the rounds retired is gone: runsc knows only the current one.
    let root = state.path().join("gvisor/runsc");
    let runsc = kiln_testkit::host::runsc().unwrap_or_else(|e| panic!("{e}"));
    let mut left = Vec::new();
    for _ in 0..200 {
        let out = std::process::Command::new(&runsc)
            .arg(format!("--root={}", root.display()))
            .args(["list", "--quiet"])
            .output()
            .unwrap();
        left = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_string)
            .filter(|l| *l == sbx.id || l.ends_with(&format!("-{}", sbx.id)))
            .collect();
        if left.len() == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(left.len(), 1, "containers of the sandbox: {left:?}");
    assert!(m.kill(&sbx.id, "test done").await.unwrap());
}
