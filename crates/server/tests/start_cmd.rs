//! A template's start command: started in the background through the agent once the sandbox is
//! up (as the template's user, in its workdir, with the template's env), its output shown by
//! `GET /sandboxes/{id}/logs`; and killing the sandbox leaves nothing behind.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use http::Request;
use http_body_util::BodyExt;
use kiln_server::api::{self, ApiConfig, AppState};
use kiln_server::driver::gvisor::{GvisorConfig, GvisorDriver};
use kiln_server::store::Store;
use kiln_server::templates::{from_dir, FixedTemplates, TemplateInfo};
use kiln_server::{auth, LifecycleConfig, Manager};
use serde_json::Value;
use tower::ServiceExt;

struct Cleanup {
    driver: Arc<GvisorDriver>,
    ids: std::sync::Mutex<Vec<String>>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for id in self.ids.lock().unwrap().iter() {
            let _ = self.driver.stop_blocking(id);
        }
    }
}

async fn call(app: &axum::Router, key: &str, method: &str, path: &str, body: &str) -> (u16, Value) {
    let req = Request::builder()
        .method(method)
        .uri(path)
        .header("X-API-Key", key)
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let v = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    (status, v)
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
    common::require_runsc_root();
    let tpl = tempfile::tempdir().unwrap();
    common::build_rootfs(tpl.path());
    let state = tempfile::tempdir().unwrap();
    let driver = Arc::new(GvisorDriver::new(GvisorConfig::new(state.path())).unwrap());
    let cleanup = Cleanup {
        driver: driver.clone(),
        ids: Default::default(),
    };
    let store = Arc::new(Store::open(&state.path().join("kiln.db")).unwrap());
    let key = auth::create_key(&store, "test").unwrap().secret;
    let template = TemplateInfo {
        env: BTreeMap::from([("KILN_TPL_ENV".into(), "from-template".into())]),
        start_cmd: Some(
            "echo \"start pwd=$(pwd) user=$(id -un) env=$KILN_TPL_ENV\"; echo to-stderr >&2; \
             sleep 0.3; echo done; exit 3"
                .into(),
        ),
        ..from_dir("t", tpl.path())
    };
    let manager = Manager::new(
        LifecycleConfig {
            default_memory_mb: 256,
            ..LifecycleConfig::default()
        },
        store,
        driver.clone(),
        Arc::new(FixedTemplates(vec![template])),
    );
    let app = api::router(Arc::new(AppState {
        manager: manager.clone(),
        cfg: ApiConfig {
            domain: "kiln.test".into(),
        },
    }));

    let (status, created) = call(&app, &key, "POST", "/sandboxes", r#"{"templateID":"t"}"#).await;
    assert_eq!(status, 201, "create: {created}");
    let id = created["sandboxID"].as_str().unwrap().to_string();
    cleanup.ids.lock().unwrap().push(id.clone());

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
    cleanup.ids.lock().unwrap().clear();
    assert!(common::mounts_under(state.path()).is_empty());
    assert!(!state.path().join(format!("gvisor/sandboxes/{id}")).exists());
    assert!(common::processes_mentioning(&id).is_empty());
    // The log of a killed sandbox still has the start command's output.
    let (_, logs) = call(&app, &key, "GET", &format!("/sandboxes/{id}/logs"), "").await;
    assert!(log_lines(&logs)
        .iter()
        .any(|l| l.contains("start_cmd: stdout: done")));
}
