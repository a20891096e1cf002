//! A template's start command: started in the background through the agent once the sandbox is
//! up (as the template's user, in its workdir, with the template's env), its output shown by
//! `GET /sandboxes/{id}/logs`; and killing the sandbox leaves nothing behind.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kiln_server::templates::{from_dir, FixedTemplates, TemplateInfo};
use kiln_server::LifecycleConfig;
use serde_json::Value;

async fn call(app: &axum::Router, key: &str, method: &str, path: &str, body: &str) -> (u16, Value) {
    let (s, v) = common::call(app, Some(key), method, path, Some(body), &[]).await;
    (s.as_u16(), v)
}

fn log_lines(v: &Value) -> Vec<String> {
    v["logs"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|l| l["line"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_cmd_runs_as_template_user_and_its_output_is_in_the_logs() {
    let g = common::Ground::new();
    let (state, tpl, driver, cleanup) = (&g.state, &g.tpl, g.driver.clone(), &g.cleanup);
    let template = TemplateInfo {
        env: BTreeMap::from([("KILN_TPL_ENV".into(), "from-template".into())]),
        start_cmd: Some(
            "echo \"start pwd=$(pwd) user=$(id -un) env=$KILN_TPL_ENV\"; echo to-stderr >&2; \
             sleep 0.3; echo done; exit 3"
                .into(),
        ),
        ..from_dir("t", tpl.path())
    };
    let manager = common::manager(
        state.path(),
        driver.clone(),
        Arc::new(FixedTemplates(vec![template])),
        LifecycleConfig {
            default_memory_mb: 256,
            ..LifecycleConfig::default()
        },
    );
    let (app, key) = common::app(manager, state.path()).await;

    let (status, created) = call(&app, &key, "POST", "/sandboxes", r#"{"templateID":"t"}"#).await;
    assert_eq!(status, 201, "create: {created}");
    let id = created["sandboxID"].as_str().unwrap().to_string();
    cleanup.add(&id);

    // The command runs in the background: wait for its end in the logs.
    let t = Instant::now();
    let lines = loop {
        let (status, logs) = call(&app, &key, "GET", &format!("/sandboxes/{id}/logs"), "").await;
        assert_eq!(status, 200, "logs: {logs}");
        let lines = log_lines(&logs);
        if lines.iter().any(|l| l.contains("start_cmd: exited")) {
            break lines;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "start command did not finish; logs so far: {lines:#?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let has = |want: &str| lines.iter().any(|l| l.contains(want));
    assert!(
        has("start_cmd: stdout: start pwd=/home/user user=user env=from-template"),
        "{lines:#?}"
    );
    assert!(has("start_cmd: stderr: to-stderr"), "{lines:#?}");
    assert!(has("start_cmd: stdout: done"), "{lines:#?}");
    assert!(has("start_cmd: exited: exit status 3"), "{lines:#?}");
    // Output order is kept within a stream, and the start is logged before any output.
    let pos = |want: &str| lines.iter().position(|l| l.contains(want)).unwrap();
    assert!(pos("start_cmd: started") < pos("stdout: start pwd="));
    assert!(pos("stdout: start pwd=") < pos("stdout: done"));

    // The sandbox is still fine after its start command ended; kill it and check nothing is left.
    let (status, _) = call(&app, &key, "DELETE", &format!("/sandboxes/{id}"), "").await;
    assert_eq!(status, 204);
    assert!(common::mounts_under(state.path()).is_empty());
    assert!(!state.path().join(format!("gvisor/sandboxes/{id}")).exists());
    assert!(common::processes_mentioning(&id).is_empty());
    // The log of a killed sandbox still has the start command's output.
    let (_, logs) = call(&app, &key, "GET", &format!("/sandboxes/{id}/logs"), "").await;
    assert!(log_lines(&logs)
        .iter()
        .any(|l| l.contains("start_cmd: stdout: done")));
}
