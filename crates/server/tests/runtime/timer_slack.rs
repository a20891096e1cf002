//! `--sentry-timer-slack-ms`: the gVisor driver's upkeep sets the timer slack of every host
//! task of a running sandbox (the sentry's threads, the gofer, the platform's stubs), the
//! sandbox keeps working, and processes started inside afterwards (new stubs) inherit it.

use crate::common;

use std::time::Duration;

use kiln_envd::RunOptions;
use kiln_gvisor::slack::{host_tasks, slack_of};
use kiln_server::driver;

const SLACK: Duration = Duration::from_millis(7);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn housekeeping_sets_the_timer_slack_of_every_host_task() {
    if !common::sandboxes_run() {
        return;
    }
    let tpl = tempfile::tempdir().unwrap();
    common::build_rootfs(tpl.path());
    let state = common::state_dir();
    let mut cfg = common::driver_config();
    cfg.gvisor.timer_slack = Some(SLACK);
    let driver = common::build_driver(&cfg, state.path());
    let id = format!("slack{}", std::process::id());
    let guard = common::Cleanup::new(driver.clone());
    guard.add(&id);
    driver
        .create(&common::driver_spec(&id, tpl.path()))
        .await
        .expect("create");
    driver.start(&id).await.expect("start");
    let agent = driver::agent_client(&driver, &id);
    agent
        .wait_ready(Duration::from_secs(30))
        .await
        .expect("agent ready");

    let tasks = host_tasks(&id);
    assert!(tasks.len() > 3, "the sandbox's host cgroup lists {tasks:?}");
    let want = SLACK.as_nanos() as u64;
    assert!(
        tasks.iter().all(|t| slack_of(*t) != Some(want)),
        "slack set before any upkeep"
    );
    driver.housekeep(std::slice::from_ref(&id)).await;
    let off: Vec<(i32, Option<u64>)> = host_tasks(&id)
        .into_iter()
        .map(|t| (t, slack_of(t)))
        .filter(|(_, s)| s.is_some() && *s != Some(want))
        .collect();
    assert!(off.is_empty(), "tasks without the slack: {off:?}");

    // The sandbox works, and what it starts now (new host stubs and threads) inherits it.
    let out = agent
        .run(
            "sleep 0.01; (sleep 5 &) ; echo ok",
            RunOptions {
                user: Some("root".into()),
                ..Default::default()
            },
        )
        .await
        .expect("run");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "ok\n");
    let off: Vec<(i32, Option<u64>)> = host_tasks(&id)
        .into_iter()
        .map(|t| (t, slack_of(t)))
        .filter(|(_, s)| s.is_some() && *s != Some(want))
        .collect();
    assert!(
        off.is_empty(),
        "tasks created later without the slack: {off:?}"
    );
    driver.stop(&id).await.expect("stop");
}
