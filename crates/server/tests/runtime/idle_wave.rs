//! The idle tick during a standby wave, with real gVisor sandboxes: sandboxes that go quiet
//! together are hinted idle at once, and a tick that has spent its budget on standbys leaves
//! the rest to the next tick instead of holding up its hints.

use crate::common;

use std::time::{Duration, Instant};

use kiln_server::manager::CreateParams;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_wave_leaves_room_for_hints() {
    if !common::sandboxes_run() {
        return;
    }
    let mut cfg = common::template_config();
    cfg.idle_hint_after = Some(Duration::from_millis(300));
    cfg.standby_after = Some(Duration::from_millis(300));
    // One standby per tick: the wave spans ticks.
    cfg.standby_tick_budget = Some(Duration::ZERO);
    let rig = common::Rig::new(cfg);
    let m = rig.manager.clone();
    let mut ids = Vec::new();
    for _ in 0..3 {
        let r = m
            .create(CreateParams {
                template_id: "t".into(),
                timeout_secs: Some(600),
                ..Default::default()
            })
            .await
            .expect("create");
        rig.cleanup.add(&r.id);
        ids.push(r.id);
    }
    // Ticks by hand (no background tick runs in this rig) until every sandbox is in standby.
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut hinted = std::collections::BTreeSet::new();
    let mut ticks_with_standby = 0;
    while m.standby_count() < ids.len() {
        assert!(
            Instant::now() < deadline,
            "only {} of {} in standby",
            m.standby_count(),
            ids.len()
        );
        let report = m.idle_tick().await;
        assert!(
            report.standby.len() <= 1,
            "a tick with no budget left entered {} standbys",
            report.standby.len()
        );
        hinted.extend(report.hinted);
        for id in &report.standby {
            // Hinted at the latest in the tick that put it in standby (the two periods are
            // equal: it was due for both at once).
            assert!(hinted.contains(id), "{id} entered standby unhinted");
        }
        ticks_with_standby += usize::from(!report.standby.is_empty());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(ticks_with_standby, ids.len(), "one standby per tick");
    for id in &ids {
        assert!(m.standby_since(id).is_some(), "{id} is not in standby");
        assert!(m.kill(id, "test done").await.unwrap());
    }
}
