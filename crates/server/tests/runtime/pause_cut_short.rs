//! A pause the server's end cut short, with real runsc: the next server finds the sandbox
//! paused with its memory when the checkpoint had been taken, and running (its agent
//! answering) when it had not, instead of cleaning either up as gone. (The window between the
//! driver's pause and the store's update is `lifecycle::a_pause_cut_short_by_a_crash_…`.)

use crate::common;
use crate::lifecycle::{count, COUNTER};

use std::time::Duration;

use common::sh;
use kiln_server::store::SandboxState;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_cut_short_inside_the_driver_is_settled_by_the_next_server() {
    if !common::sandboxes_run() {
        return;
    }
    let mut rig = common::Rig::new(common::template_config());
    let m1 = rig.manager.clone();
    let mut ids = Vec::new();
    let mut before = Vec::new();
    for _ in 0..2 {
        let id = m1.create(common::params(600)).await.expect("create").id;
        rig.cleanup.add(&id);
        sh(&m1, &id, &format!("bash -c '{COUNTER}' >/dev/null 2>&1 &")).await;
        sh(&m1, &id, "echo kept > /home/user/file").await;
        ids.push(id);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    for id in &ids {
        before.push(count(&m1, id).await);
    }
    // The server dies in the middle of two pauses: after the first's checkpoint (before its
    // paused.json), and after the second's detach (before its checkpoint).
    let gv = kiln_gvisor::GvisorDriver::new(kiln_gvisor::GvisorConfig::from_settings(
        &common::driver_config().gvisor,
        rig.path(),
    ))
    .expect("a second driver on the same state");
    gv.pause_cut_short(&ids[0], true)
        .await
        .expect("checkpointed");
    gv.pause_cut_short(&ids[1], false).await.expect("detached");
    drop(gv);
    drop(m1);

    let m2 = rig.restart();
    let report = m2.recover().await.expect("recover");
    assert_eq!(report.paused, vec![ids[0].clone()], "{report:?}");
    assert_eq!(report.adopted, vec![ids[1].clone()], "{report:?}");
    assert!(report.cleaned.is_empty(), "{report:?}");
    assert_eq!(m2.get(&ids[0]).unwrap().state, SandboxState::Paused);

    // The checkpointed one resumes from its memory: the counter goes on from where it was.
    let (_, resumed) = m2.connect(&ids[0], 600, true).await.expect("connect");
    assert!(resumed);
    let after = count(&m2, &ids[0]).await;
    assert!(
        after >= before[0] && after < before[0] + 100,
        "the counter restarted: {} -> {after}",
        before[0]
    );
    // The other never stopped: its agent answers again and its counter kept counting.
    assert!(count(&m2, &ids[1]).await > before[1]);
    for id in &ids {
        assert_eq!(sh(&m2, id, "cat /home/user/file").await, "kept");
        tokio::time::sleep(Duration::from_millis(300)).await;
        let n = count(&m2, id).await;
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert!(count(&m2, id).await > n, "the counter of {id} stopped");
        assert!(m2.kill(id, "test done").await.unwrap());
    }
    assert!(m2.teardowns_done(Duration::from_secs(60)).await);
    // The container the settled pause left retiring is deleted in the background.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let left = rig.driver.list_on_host().await.unwrap();
        if left.is_empty() {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "left: {left:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(common::mounts_under(rig.path()).is_empty());
}
