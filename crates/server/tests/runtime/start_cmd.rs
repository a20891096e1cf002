//! A template's start command: started in the background through the agent once the sandbox is
//! up (as the template's user, in its workdir, with the template's env), its output shown by
//! `GET /sandboxes/{id}/logs`; and killing the sandbox leaves nothing behind.

use crate::common;

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
    if !common::sandboxes_run() {
        return;
    }
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
    let (app, key) = common::app(manager.clone(), state.path()).await;

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
    // A kill answers before its teardown, which finishes in the background.
    assert!(
        manager
            .teardowns_done(std::time::Duration::from_secs(60))
            .await
    );
    assert!(common::mounts_under(state.path()).is_empty());
    assert!(!state.path().join(format!("gvisor/sandboxes/{id}")).exists());
    assert!(common::processes_mentioning(&id).is_empty());
    // The log of a killed sandbox still has the start command's output.
    let (_, logs) = call(&app, &key, "GET", &format!("/sandboxes/{id}/logs"), "").await;
    assert!(log_lines(&logs)
        .iter()
        .any(|l| l.contains("start_cmd: stdout: done")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_returns_once_the_ready_command_succeeds_and_fails_when_it_never_does() {
    if !common::sandboxes_run() {
        return;
    }
    let g = common::Ground::new();
    let (state, tpl, driver, cleanup) = (&g.state, &g.tpl, g.driver.clone(), &g.cleanup);
    // The service comes up a second after the start command begins.
    let slow = TemplateInfo {
        start_cmd: Some("sleep 1; touch /tmp/service-up; exec sleep 600".into()),
        ready_cmd: Some("[ -e /tmp/service-up ]".into()),
        ..from_dir("slow", tpl.path())
    };
    let never = TemplateInfo {
        start_cmd: Some("exec sleep 600".into()),
        ready_cmd: Some("echo not yet; exit 7".into()),
        ..from_dir("never", tpl.path())
    };
    let manager = common::manager(
        state.path(),
        driver.clone(),
        Arc::new(FixedTemplates(vec![slow, never])),
        LifecycleConfig {
            default_memory_mb: 256,
            start_ready_timeout: Duration::from_secs(2),
            ..LifecycleConfig::default()
        },
    );
    let (app, key) = common::app(manager.clone(), state.path()).await;

    let t = Instant::now();
    let (status, created) =
        call(&app, &key, "POST", "/sandboxes", r#"{"templateID":"slow"}"#).await;
    assert_eq!(status, 201, "create: {created}");
    let id = created["sandboxID"].as_str().unwrap().to_string();
    cleanup.add(&id);
    assert!(t.elapsed() >= Duration::from_secs(1), "{:?}", t.elapsed());
    // The first call after the create finds the service up.
    let (code, _) = common::run_in(&manager, &id, "[ -e /tmp/service-up ]").await;
    assert_eq!(
        code, 0,
        "the create returned before the ready command succeeded"
    );

    // A template that never gets ready: the create fails within the bound, naming the
    // command and its last answer, and leaves no sandbox behind.
    let t = Instant::now();
    let (status, err) = call(
        &app,
        &key,
        "POST",
        "/sandboxes",
        r#"{"templateID":"never"}"#,
    )
    .await;
    assert_eq!(status, 500, "{err}");
    let msg = err["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains("ready command `echo not yet; exit 7`")
            && msg.contains("exit code 7")
            && msg.contains("not yet"),
        "{msg}"
    );
    assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
    let (_, list) = call(&app, &key, "GET", "/sandboxes", "").await;
    let running: Vec<_> = list
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| s["templateID"].as_str())
        .collect();
    assert_eq!(running, vec!["slow"], "{list}");
    let (status, _) = call(&app, &key, "DELETE", &format!("/sandboxes/{id}"), "").await;
    assert_eq!(status, 204);
}
