//! Shared helpers of the server's integration tests: the sandbox guard, test servers (`Ground`,
//! `Rig`), drivers, requests through the router; host-level helpers come from `kiln-testkit`.

#![allow(dead_code, unused_imports)] // each test binary uses its own part

pub mod requests;

use std::path::{Path, PathBuf};

/// Whether this test can run real gVisor sandboxes (root, runsc), under the skip policy of
/// [`kiln_testkit`]: false after a printed skip (`KILN_ALLOW_SKIPS=1`), a failure otherwise.
pub fn sandboxes_run() -> bool {
    kiln_testkit::needs()
        .root("real gVisor sandboxes")
        .runsc()
        .ok()
}

/// Fails the test unless it can run real sandboxes (for setup that cannot return early; tests
/// call [`sandboxes_run`] first).
pub fn require_runsc_root() {
    kiln_testkit::needs()
        .root("real gVisor sandboxes")
        .runsc()
        .require();
}

/// A minimal template rootfs: kiln-agent at /usr/bin/kiln-agent, bash and a few coreutils,
/// users root and user (uid 1000), /home/user.
pub use kiln_testkit::rootfs::build as build_rootfs;

pub use kiln_testkit::host::processes_mentioning;

/// What is mounted at or under `dir`, except the gVisor driver's pool of ready disks
/// (`gvisor/disk-pool`, mounted while the driver runs; emptied at its shutdown).
pub fn mounts_under(dir: &Path) -> Vec<String> {
    let pool = dir.join("gvisor/disk-pool").to_string_lossy().to_string();
    kiln_testkit::host::mounts_under(dir)
        .into_iter()
        .filter(|mp| !mp.starts_with(&pool))
        .collect()
}

// ---------- servers, drivers and cleanup ----------

use std::sync::{Arc, Mutex};

use axum::body::Body;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::BodyExt;
use kiln_server::api::{ApiConfig, AppState};
use kiln_server::driver::Driver;
use kiln_server::store::{SqliteStore, StateStore};
use kiln_server::templates::Templates;
use kiln_server::{LifecycleConfig, Manager};
use serde_json::Value;
use tower::ServiceExt;

/// A fresh state directory with a short path (agent socket paths under it must fit in 108
/// bytes).
pub fn state_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("kt")
        .tempdir_in("/tmp")
        .unwrap()
}

/// The driver configuration tests use: the gVisor driver's settings (the server never names
/// a driver; the tests build one as the binary does).
#[derive(Debug, Clone, Default)]
pub struct DriverConfig {
    pub gvisor: kiln_gvisor::GvisorSettings,
}

/// The gVisor driver, with `KILN_RUNSC` and `KILN_PLATFORM` when set (scripts/test.sh sets them
/// to the runtime kiln installs).
pub fn driver_config() -> DriverConfig {
    let mut cfg = DriverConfig::default();
    cfg.gvisor.runsc = std::env::var_os("KILN_RUNSC").map(PathBuf::from);
    cfg.gvisor.platform = std::env::var("KILN_PLATFORM").ok();
    cfg
}

/// The driver `cfg` describes, its state under `state`.
pub fn build_driver(cfg: &DriverConfig, state: &Path) -> Arc<dyn Driver> {
    kiln_gvisor::build(&cfg.gvisor, state).expect("building the driver")
}

/// The driver of a test server whose state lives in `state`.
pub fn driver(state: &Path) -> Arc<dyn Driver> {
    build_driver(&driver_config(), state)
}

pub fn store(state: &Path) -> Arc<dyn StateStore> {
    Arc::new(SqliteStore::open(&state.join("kiln.db")).unwrap())
}

/// Stops the sandboxes it lists when dropped (also when a test panics), so no test leaves
/// runsc processes, mounts or directories behind.
pub struct Cleanup {
    driver: Arc<dyn Driver>,
    ids: Mutex<Vec<String>>,
}

impl Cleanup {
    pub fn new(driver: Arc<dyn Driver>) -> Self {
        Self {
            driver,
            ids: Mutex::new(Vec::new()),
        }
    }
    pub fn add(&self, id: &str) {
        self.ids.lock().unwrap().push(id.to_string());
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let ids = std::mem::take(&mut *self.ids.lock().unwrap());
        if ids.is_empty() {
            return;
        }
        let driver = self.driver.clone();
        // A runtime of its own on another thread: Drop may run inside the test's runtime.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                for id in ids {
                    let _ = driver.stop(&id).await;
                }
            });
        })
        .join();
    }
}

/// A manager over a real store and driver in `state`.
pub fn manager(
    state: &Path,
    driver: Arc<dyn Driver>,
    templates: Arc<dyn Templates>,
    cfg: LifecycleConfig,
) -> Arc<Manager> {
    Manager::new(cfg, store(state), driver, templates)
}

/// A manager with one template, `t`, made of the rootfs `tpl`: 256 MiB sandboxes, reaped every
/// 50 ms (the lifecycle tests' setting).
pub fn template_manager(state: &Path, tpl: &Path, driver: Arc<dyn Driver>) -> Arc<Manager> {
    let cfg = template_config();
    manager(
        state,
        driver,
        Arc::new(kiln_server::templates::FixedTemplates(vec![
            kiln_server::templates::from_dir("t", tpl),
        ])),
        cfg,
    )
}

/// A driver-level spec of sandbox `id` on `rootfs`: 1 CPU, 256 MiB, 512 processes, no disk
/// image, no environment.
pub fn driver_spec(id: &str, rootfs: &Path) -> kiln_server::driver::SandboxSpec {
    kiln_server::driver::SandboxSpec {
        id: id.into(),
        template_name: "test".into(),
        rootfs: rootfs.to_path_buf(),
        image: None,
        env: std::collections::BTreeMap::new(),
        cpu_count: 1,
        memory_mb: 256,
        pids_limit: 512,
        syscall_audit: false,
        disk_mb: 0,
        volumes: vec![],
        network: None,
        background: false,
    }
}

/// The lifecycle tests' settings: 256 MiB sandboxes, reaped every 50 ms.
pub fn template_config() -> LifecycleConfig {
    LifecycleConfig {
        reap_interval: std::time::Duration::from_millis(50),
        default_memory_mb: 256,
        ..LifecycleConfig::default()
    }
}

/// The API router over a default manager with no templates, in state dir `state`, with a
/// fresh API key (the API, edge and TLS tests that need no sandbox).
pub async fn empty_app(state: &Path) -> (axum::Router, String) {
    let manager = manager(
        state,
        driver(state),
        Arc::new(kiln_server::templates::FixedTemplates::default()),
        kiln_server::LifecycleConfig::default(),
    );
    app(manager, state).await
}

/// The API router over `manager`, with a fresh API key.
pub async fn app(manager: Arc<Manager>, state: &Path) -> (axum::Router, String) {
    let key = kiln_server::auth::create_key(store(state).as_ref(), "test")
        .await
        .unwrap()
        .secret;
    let app = kiln_server::front::router(Arc::new(AppState::new(
        manager,
        ApiConfig {
            domain: "kiln.test".into(),
            metrics_token: None,
        },
    )));
    (app, key)
}

/// One request through the router: its status, headers and JSON body (a string when not JSON,
/// null when empty).
pub async fn request(
    app: &axum::Router,
    key: Option<&str>,
    method: &str,
    path: &str,
    body: Option<&str>,
    headers: &[(&str, &str)],
) -> (StatusCode, HeaderMap, Value) {
    let mut b = Request::builder().method(method).uri(path);
    if let Some(k) = key {
        b = b.header("X-API-Key", k);
    }
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    if body.is_some() {
        b = b.header("content-type", "application/json");
    }
    let req = b.body(Body::from(body.unwrap_or("").to_string())).unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    let (status, headers) = (resp.status(), resp.headers().clone());
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let v = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into()))
    };
    (status, headers, v)
}

/// [`request`] without the headers.
pub async fn call(
    app: &axum::Router,
    key: Option<&str>,
    method: &str,
    path: &str,
    body: Option<&str>,
    headers: &[(&str, &str)],
) -> (StatusCode, Value) {
    let (status, _, v) = request(app, key, method, path, body, headers).await;
    (status, v)
}

/// What every gVisor test stands on: template `t` (the minimal rootfs of [`build_rootfs`]),
/// a fresh state dir, the real driver over it and a [`Cleanup`]. Fields drop in order:
/// sandboxes stop before their directories go.
pub struct Ground {
    pub cleanup: Cleanup,
    pub driver: Arc<dyn Driver>,
    pub state: tempfile::TempDir,
    pub tpl: tempfile::TempDir,
}

impl Ground {
    pub fn new() -> Self {
        require_runsc_root();
        let tpl = tempfile::tempdir().unwrap();
        build_rootfs(tpl.path());
        let state = state_dir();
        let driver = driver(state.path());
        Self {
            cleanup: Cleanup::new(driver.clone()),
            driver,
            state,
            tpl,
        }
    }

    pub fn path(&self) -> &Path {
        self.state.path()
    }

    /// The store in the state dir (another connection to its SQLite file).
    pub fn store(&self) -> Arc<dyn StateStore> {
        store(self.path())
    }

    /// The templates: `t`, its rootfs.
    pub fn templates(&self) -> Arc<dyn Templates> {
        Arc::new(kiln_server::templates::FixedTemplates(vec![
            kiln_server::templates::from_dir("t", self.tpl.path()),
        ]))
    }

    /// A manager over this ground with `cfg`.
    pub fn manager(&self, cfg: LifecycleConfig) -> Arc<Manager> {
        manager(self.path(), self.driver.clone(), self.templates(), cfg)
    }
}

/// A gVisor test server without the HTTP listener: a [`Ground`] and a manager with the given
/// configuration (admission measures the disk of the state dir unless told otherwise). The
/// ground's fields are the rig's (`rig.cleanup`, `rig.driver`, …).
pub struct Rig {
    pub manager: Arc<Manager>,
    ground: Ground,
    cfg: LifecycleConfig,
}

impl std::ops::Deref for Rig {
    type Target = Ground;
    fn deref(&self) -> &Ground {
        &self.ground
    }
}

impl Rig {
    pub fn new(mut cfg: LifecycleConfig) -> Self {
        let ground = Ground::new();
        if cfg.admission.state_dir.is_none() {
            cfg.admission.state_dir = Some(ground.path().to_path_buf());
        }
        Self {
            manager: ground.manager(cfg.clone()),
            ground,
            cfg,
        }
    }

    /// The server restarts: the rig's manager is replaced by a new one over the same state,
    /// templates, driver and configuration (drop every other handle on the old one first).
    pub fn restart(&mut self) -> Arc<Manager> {
        self.manager = self.ground.manager(self.cfg.clone());
        self.manager.clone()
    }

    /// The API router over this rig's manager, with a fresh API key.
    pub async fn app(&self) -> (axum::Router, String) {
        app(self.manager.clone(), self.path()).await
    }
}

/// Asserts an error answer: the status, and E2B's JSON error shape with a message.
pub fn assert_error(status: StatusCode, v: &Value, want: u16) {
    assert_eq!(status.as_u16(), want, "body: {v}");
    assert_eq!(v["code"].as_u64(), Some(u64::from(want)), "body: {v}");
    assert!(
        v["message"].as_str().is_some_and(|m| !m.is_empty()),
        "body: {v}"
    );
}

// ---------- sandboxes ----------

/// Creating a sandbox of template `t` with a timeout of `timeout_secs`, secured by a token.
pub fn params(timeout_secs: i64) -> kiln_server::manager::CreateParams {
    kiln_server::manager::CreateParams {
        template_id: "t".into(),
        timeout_secs: Some(timeout_secs),
        secure: true,
        ..Default::default()
    }
}

/// Runs `cmd` in sandbox `id` through its agent (30 s at most): exit code and trimmed stdout.
pub async fn run_in(m: &Manager, id: &str, cmd: &str) -> (i32, String) {
    let token = m.get(id).unwrap().envd_token;
    let out = m
        .agent(id, token)
        .run(
            cmd,
            kiln_envd::RunOptions {
                timeout: Some(std::time::Duration::from_secs(30)),
                ..Default::default()
            },
        )
        .await
        .unwrap_or_else(|e| panic!("running {cmd:?} in {id}: {e}"));
    (
        out.exit_code,
        String::from_utf8_lossy(&out.stdout).trim().to_string(),
    )
}

/// [`run_in`], which must exit 0: the trimmed stdout.
pub async fn sh(m: &Manager, id: &str, cmd: &str) -> String {
    let (code, out) = run_in(m, id, cmd).await;
    assert_eq!(code, 0, "{cmd:?} in {id} exited {code}: {out}");
    out
}

/// The tenancy tests' lifecycle: small sandboxes, no host-capacity check, `admission`'s quotas.
pub fn team_config(admission: kiln_server::manager::AdmissionConfig) -> LifecycleConfig {
    LifecycleConfig {
        default_memory_mb: 256,
        admission: kiln_server::manager::AdmissionConfig {
            skip_host_check: true,
            ..admission
        },
        ..Default::default()
    }
}

/// A new API key of team `team` (the team is created with it), in the state at `state`.
pub async fn team_key(state: &Path, team: &str) -> String {
    kiln_server::auth::create_team_key(store(state).as_ref(), team, team)
        .await
        .unwrap()
        .secret
}

/// The kinds of sandbox `id`'s first 100 events, oldest first; only `kinds` when not empty.
pub async fn event_kinds(store: &dyn StateStore, id: &str, kinds: &[&str]) -> Vec<String> {
    store
        .events_page(&kiln_server::store::EventQuery {
            sandbox_id: Some(id.to_string()),
            kinds: kinds.iter().map(|k| k.to_string()).collect(),
            limit: 100,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.event.kind)
        .collect()
}
