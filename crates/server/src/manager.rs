//! Sandbox lifecycle: create from a template, timeouts, kill, recovery after a restart.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::sync::broadcast;

use crate::agent_http;
use crate::driver::{AgentEndpoint, Driver, SandboxSpec};
use crate::error::ApiError;
use crate::store::{now_ms, SandboxRecord, SandboxState, Store, TemplateRecord};
use crate::templates::{TemplateInfo, Templates};

/// Largest timeout the API accepts (E2B's timeout is an int32 of seconds).
pub const MAX_TIMEOUT_SECS: u64 = i32::MAX as u64;

/// Lifecycle settings.
#[derive(Debug, Clone)]
pub struct LifecycleConfig {
    /// Timeout when the create request names none (E2B: 300 s).
    pub default_timeout_secs: u64,
    /// Optional hard cap on any timeout.
    pub max_timeout_secs: Option<u64>,
    pub default_cpu_count: u32,
    pub default_memory_mb: u32,
    pub default_disk_mb: u32,
    pub pids_limit: u32,
    /// How long a new sandbox's agent may take to answer `/health`.
    pub agent_ready_timeout: Duration,
    /// How often expiry is checked.
    pub reap_interval: Duration,
}

impl Default for LifecycleConfig {
    fn default() -> Self {
        Self {
            default_timeout_secs: 300,
            max_timeout_secs: None,
            default_cpu_count: 2,
            default_memory_mb: 512,
            default_disk_mb: 2048,
            pids_limit: 4096,
            agent_ready_timeout: Duration::from_secs(30),
            reap_interval: Duration::from_millis(200),
        }
    }
}

/// A lifecycle event, as stored and as shown by `kiln serve`.
#[derive(Debug, Clone, Serialize)]
pub struct LifecycleEvent {
    pub ts_ms: i64,
    pub sandbox_id: String,
    pub kind: String,
    pub detail: String,
}

/// What a create request asks for (already parsed from JSON).
#[derive(Debug, Clone, Default)]
pub struct CreateParams {
    pub template_id: String,
    pub timeout_secs: Option<i64>,
    pub metadata: BTreeMap<String, String>,
    pub env_vars: BTreeMap<String, String>,
    pub secure: bool,
    pub auto_pause: bool,
    pub allow_internet_access: Option<bool>,
}

#[derive(Debug, Clone)]
struct Live {
    record: SandboxRecord,
    socket: PathBuf,
    last_cpu: Option<(Instant, u64)>,
}

/// What the envd proxy needs to reach a sandbox.
#[derive(Debug, Clone)]
pub struct Route {
    pub socket: PathBuf,
    pub envd_token: Option<String>,
}

pub struct Manager {
    cfg: LifecycleConfig,
    store: Arc<Store>,
    driver: Arc<dyn Driver>,
    templates: Arc<dyn Templates>,
    live: Mutex<HashMap<String, Live>>,
    events: broadcast::Sender<LifecycleEvent>,
    /// Bounds how many sandboxes boot at once: booting is CPU-bound, so running more boots
    /// than CPUs only makes every one of them slower.
    boots: tokio::sync::Semaphore,
}

fn record_event(
    store: &Store,
    events: &broadcast::Sender<LifecycleEvent>,
    id: &str,
    kind: &str,
    detail: String,
) {
    if let Err(e) = store.add_event(id, kind, &detail) {
        tracing::warn!(error = %e, "recording a lifecycle event");
    }
    tracing::info!(sandbox = id, event = kind, "{detail}");
    let _ = events.send(LifecycleEvent {
        ts_ms: now_ms(),
        sandbox_id: id.to_string(),
        kind: kind.to_string(),
        detail,
    });
}

/// Event kind of the template start command's output lines in the sandbox logs.
pub const START_CMD_EVENT: &str = "start_cmd";
/// At most this many output lines of a start command are recorded (the rest is counted).
const START_CMD_MAX_LINES: usize = 1000;
const START_CMD_MAX_LINE: usize = 4096;

/// Random lowercase alphanumeric id (E2B sandbox ids look like this).
pub fn new_sandbox_id() -> String {
    use rand::Rng;
    const ALPHA: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut r = rand::thread_rng();
    (0..20)
        .map(|_| ALPHA[r.gen_range(0..ALPHA.len())] as char)
        .collect()
}

impl Manager {
    pub fn new(
        cfg: LifecycleConfig,
        store: Arc<Store>,
        driver: Arc<dyn Driver>,
        templates: Arc<dyn Templates>,
    ) -> Arc<Self> {
        let (events, _) = broadcast::channel(1024);
        Arc::new(Self {
            cfg,
            store,
            driver,
            templates,
            live: Mutex::new(HashMap::new()),
            events,
            boots: tokio::sync::Semaphore::new(
                std::thread::available_parallelism()
                    .map(|n| n.get())
                    .unwrap_or(2)
                    .max(2),
            ),
        })
    }

    pub fn config(&self) -> &LifecycleConfig {
        &self.cfg
    }
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }
    pub fn driver(&self) -> &Arc<dyn Driver> {
        &self.driver
    }
    pub fn templates(&self) -> &Arc<dyn Templates> {
        &self.templates
    }

    /// Lifecycle events as they happen.
    pub fn subscribe(&self) -> broadcast::Receiver<LifecycleEvent> {
        self.events.subscribe()
    }

    fn live(&self) -> std::sync::MutexGuard<'_, HashMap<String, Live>> {
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn event(&self, id: &str, kind: &str, detail: impl Into<String>) {
        record_event(&self.store, &self.events, id, kind, detail.into());
    }

    /// Checks a requested timeout (seconds) against the limits.
    pub fn check_timeout(&self, secs: i64) -> Result<u64, ApiError> {
        if secs <= 0 {
            return Err(ApiError::bad_request(format!(
                "timeout must be a positive number of seconds, got {secs}"
            )));
        }
        let max = self
            .cfg
            .max_timeout_secs
            .unwrap_or(MAX_TIMEOUT_SECS)
            .min(MAX_TIMEOUT_SECS);
        if secs as u64 > max {
            return Err(ApiError::bad_request(format!(
                "timeout {secs}s is above the maximum of {max}s"
            )));
        }
        Ok(secs as u64)
    }

    fn socket_of(&self, id: &str) -> PathBuf {
        match self.driver.agent_endpoint(id) {
            AgentEndpoint::Unix(p) => p,
        }
    }

    /// Creates and starts a sandbox, returning its record once its agent is initialised.
    pub async fn create(&self, p: CreateParams) -> Result<SandboxRecord, ApiError> {
        let started = Instant::now();
        let timeout = self.check_timeout(
            p.timeout_secs
                .unwrap_or(self.cfg.default_timeout_secs as i64),
        )?;
        if p.template_id.trim().is_empty() {
            return Err(ApiError::bad_request("templateID must not be empty"));
        }
        for k in p.env_vars.keys() {
            if k.is_empty() || k.contains('=') || k.contains('\0') {
                return Err(ApiError::bad_request(format!(
                    "invalid environment variable name {k:?}"
                )));
            }
        }
        let name = p
            .template_id
            .split_once(':')
            .map(|(n, _)| n)
            .unwrap_or(&p.template_id)
            .to_string();
        let templates = self.templates.clone();
        let lookup_name = name.clone();
        let tpl: TemplateInfo = tokio::task::spawn_blocking(move || templates.lookup(&lookup_name))
            .await
            .map_err(|e| ApiError::internal(format!("template lookup task: {e}")))?
            .map_err(|e| ApiError::internal(format!("looking up template {name:?}: {e}")))?
            .ok_or_else(|| {
                ApiError::not_found(format!(
                    "template \"{name}\" not found; build it with `kiln template build {name}`"
                ))
            })?;
        let _ = self.store.upsert_template(&TemplateRecord {
            name: tpl.name.clone(),
            key: tpl.key.clone(),
            built_at_ms: tpl.built_at_unix as i64 * 1000,
            size_bytes: tpl.size_bytes,
            spawn_count: 0,
            last_spawned_ms: None,
        });

        let id = new_sandbox_id();
        let now = now_ms();
        let record = SandboxRecord {
            id: id.clone(),
            template_id: tpl.name.clone(),
            alias: Some(tpl.name.clone()),
            client_id: "kiln".into(),
            state: SandboxState::Starting,
            metadata: p.metadata.clone(),
            env_vars: p.env_vars.clone(),
            cpu_count: self.cfg.default_cpu_count,
            memory_mb: self.cfg.default_memory_mb,
            disk_size_mb: self.cfg.default_disk_mb,
            envd_token: p.secure.then(|| crate::auth::random_hex(16)),
            started_at_ms: now,
            end_at_ms: now + (timeout as i64) * 1000,
            ended_at_ms: None,
            end_reason: None,
            auto_pause: p.auto_pause,
            driver: self.driver.name().to_string(),
        };
        self.store.insert_sandbox(&record)?;
        let spec = SandboxSpec {
            id: id.clone(),
            template_name: tpl.name.clone(),
            rootfs: tpl.rootfs.clone(),
            env: tpl.env.clone(),
            cpu_count: record.cpu_count,
            memory_mb: record.memory_mb,
            pids_limit: self.cfg.pids_limit,
        };
        let booted = match self.boots.acquire().await {
            Ok(_permit) => self.boot(&spec, &record, &tpl).await,
            Err(_) => Err("the sandbox manager is shutting down".to_string()),
        };
        let phases = match booted {
            Ok(p) => p,
            Err(msg) => {
                let _ = self.driver.stop(&id).await;
                let _ = self.store.set_state(&id, SandboxState::Failed, Some(&msg));
                self.event(&id, "failed", msg.clone());
                return Err(ApiError::internal(format!(
                    "creating the sandbox failed: {msg}"
                )));
            }
        };
        let mut record = record;
        record.state = SandboxState::Running;
        // The clock starts when the sandbox is usable.
        record.end_at_ms = now_ms() + (timeout as i64) * 1000;
        self.store.set_end_at(&id, record.end_at_ms)?;
        self.store.set_state(&id, SandboxState::Running, None)?;
        let _ = self.store.template_spawned(&tpl.name);
        self.live().insert(
            id.clone(),
            Live {
                record: record.clone(),
                socket: self.socket_of(&id),
                last_cpu: None,
            },
        );
        self.event(
            &id,
            "created",
            format!(
                "template {} in {} ms ({phases}), timeout {}s",
                tpl.name,
                started.elapsed().as_millis(),
                timeout
            ),
        );
        Ok(record)
    }

    /// Creates, starts and initialises the sandbox; returns how long each phase took.
    async fn boot(
        &self,
        spec: &SandboxSpec,
        record: &SandboxRecord,
        tpl: &TemplateInfo,
    ) -> Result<String, String> {
        let t = Instant::now();
        self.driver.create(spec).await.map_err(|e| e.to_string())?;
        let t_create = t.elapsed();
        self.driver
            .start(&spec.id)
            .await
            .map_err(|e| e.to_string())?;
        let t_start = t.elapsed();
        let socket = self.socket_of(&spec.id);
        if !agent_http::wait_ready(&socket, self.cfg.agent_ready_timeout).await {
            let log = self
                .driver
                .console_log(&spec.id, 2000)
                .await
                .unwrap_or_default();
            return Err(format!(
                "the sandbox agent did not answer within {:?}. Sandbox output:\n{log}",
                self.cfg.agent_ready_timeout
            ));
        }
        let t_ready = t.elapsed();
        let mut env: std::collections::HashMap<String, String> =
            tpl.env.clone().into_iter().collect();
        env.extend(record.env_vars.clone());
        let init = kiln_proto::envd::InitRequest {
            env_vars: Some(env),
            access_token: record.envd_token.clone(),
            default_user: Some(tpl.user.clone()),
            default_workdir: Some(tpl.workdir.clone()),
            timestamp: Some(
                chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            ),
            ..Default::default()
        };
        // The first /init of a fresh agent: no token is set yet, so none is sent. (A second
        // /init, e.g. on resume, would have to send the current token.)
        agent_http::init(&socket, &init, None)
            .await
            .map_err(|e| format!("initialising the agent: {e}"))?;
        let t_init = t.elapsed();
        if let Some(cmd) = &tpl.start_cmd {
            self.start_cmd(&socket, record, tpl, cmd).await?;
        }
        let ms = |d: Duration| d.as_millis();
        Ok(format!(
            "layer {} ms, runsc {} ms, agent ready {} ms, init {} ms",
            ms(t_create),
            ms(t_start - t_create),
            ms(t_ready - t_start),
            ms(t_init - t_ready)
        ))
    }

    /// Starts the template's start command in the background through the agent (as the
    /// template's user, in its workdir) and records its output in the sandbox's events, which
    /// `GET /sandboxes/{id}/logs` shows.
    async fn start_cmd(
        &self,
        socket: &std::path::Path,
        record: &SandboxRecord,
        tpl: &TemplateInfo,
        cmd: &str,
    ) -> Result<(), String> {
        use kiln_proto::process::{self as pb, process_event};
        use prost::Message;
        let req = pb::StartRequest {
            process: Some(pb::ProcessConfig {
                cmd: "/bin/bash".into(),
                args: vec!["-l".into(), "-c".into(), cmd.into()],
                envs: Default::default(),
                cwd: Some(tpl.workdir.clone()),
            }),
            pty: None,
            tag: Some("kiln-start-cmd".into()),
            stdin: Some(false),
        };
        let agent = kiln_agent::AgentClient::unix(socket);
        let mut stream = agent
            .server_stream(
                "/process.Process/Start",
                &req,
                Some(&tpl.user),
                record.envd_token.as_deref(),
                None,
            )
            .await
            .map_err(|e| format!("starting the template's start command {cmd:?}: {e}"))?;
        let (store, events, id) = (self.store.clone(), self.events.clone(), record.id.clone());
        let ev = move |detail: String| record_event(&store, &events, &id, START_CMD_EVENT, detail);
        ev(format!("started: {cmd}"));
        tokio::spawn(async move {
            let mut lines = 0usize;
            let mut dropped = 0usize;
            let mut partial: [Vec<u8>; 2] = [Vec::new(), Vec::new()];
            let emit = |which: usize, line: &[u8], lines: &mut usize, dropped: &mut usize| {
                if *lines >= START_CMD_MAX_LINES {
                    *dropped += 1;
                    return;
                }
                *lines += 1;
                let text = String::from_utf8_lossy(&line[..line.len().min(START_CMD_MAX_LINE)]);
                let src = if which == 0 { "stdout" } else { "stderr" };
                ev(format!("{src}: {}", text.trim_end_matches(['\r', '\n'])));
            };
            loop {
                let msg = match stream.next_message().await {
                    Ok(Some(m)) => m,
                    Ok(None) => break,
                    Err(e) => {
                        // The sandbox went away (killed) or the agent closed the stream.
                        tracing::debug!(error = %e, "start command output stream ended");
                        return;
                    }
                };
                let Ok(resp) = pb::StartResponse::decode(msg) else {
                    break;
                };
                match resp.event.and_then(|e| e.event) {
                    Some(process_event::Event::Data(d)) => {
                        let (which, bytes) = match d.output {
                            Some(process_event::data_event::Output::Stdout(b)) => (0, b),
                            Some(process_event::data_event::Output::Stderr(b)) => (1, b),
                            Some(process_event::data_event::Output::Pty(b)) => (0, b),
                            None => continue,
                        };
                        partial[which].extend_from_slice(&bytes);
                        while let Some(nl) = partial[which].iter().position(|b| *b == b'\n') {
                            let line: Vec<u8> = partial[which].drain(..=nl).collect();
                            emit(which, &line, &mut lines, &mut dropped);
                        }
                        if partial[which].len() > START_CMD_MAX_LINE {
                            let line = std::mem::take(&mut partial[which]);
                            emit(which, &line, &mut lines, &mut dropped);
                        }
                    }
                    Some(process_event::Event::End(end)) => {
                        for (which, buf) in partial.iter_mut().enumerate() {
                            if !buf.is_empty() {
                                let line = std::mem::take(buf);
                                emit(which, &line, &mut lines, &mut dropped);
                            }
                        }
                        if dropped > 0 {
                            ev(format!("{dropped} more output lines not recorded"));
                        }
                        let status = if end.status.is_empty() {
                            format!("exit code {}", end.exit_code)
                        } else {
                            end.status
                        };
                        ev(format!("exited: {status}"));
                        return;
                    }
                    _ => {}
                }
            }
        });
        Ok(())
    }

    /// The live (running) sandbox `id`, or 404.
    pub fn get_live(&self, id: &str) -> Result<SandboxRecord, ApiError> {
        self.live()
            .get(id)
            .map(|l| l.record.clone())
            .ok_or_else(|| ApiError::sandbox_not_found(id))
    }

    /// Running sandboxes.
    pub fn list_live(&self) -> Vec<SandboxRecord> {
        let mut v: Vec<SandboxRecord> = self.live().values().map(|l| l.record.clone()).collect();
        v.sort_by(|a, b| (a.started_at_ms, &a.id).cmp(&(b.started_at_ms, &b.id)));
        v
    }

    /// Where the proxy sends traffic for `id`.
    pub fn route(&self, id: &str) -> Option<Route> {
        self.live().get(id).map(|l| Route {
            socket: l.socket.clone(),
            envd_token: l.record.envd_token.clone(),
        })
    }

    /// Kills `id`; false when it is not running.
    pub async fn kill(&self, id: &str, reason: &str) -> Result<bool, ApiError> {
        let removed = self.live().remove(id);
        if removed.is_none() {
            return Ok(false);
        }
        let r = self.driver.stop(id).await;
        self.store
            .set_state(id, SandboxState::Killed, Some(reason))?;
        match r {
            Ok(()) => self.event(id, "killed", reason),
            Err(e) => self.event(id, "killed", format!("{reason} (cleanup error: {e})")),
        }
        Ok(true)
    }

    fn set_end(&self, id: &str, f: impl FnOnce(i64) -> i64) -> Result<i64, ApiError> {
        let end = {
            let mut live = self.live();
            let l = live
                .get_mut(id)
                .ok_or_else(|| ApiError::sandbox_not_found(id))?;
            l.record.end_at_ms = f(l.record.end_at_ms);
            l.record.end_at_ms
        };
        self.store.set_end_at(id, end)?;
        Ok(end)
    }

    /// `POST /sandboxes/{id}/timeout`: the sandbox now ends `secs` from now.
    pub fn set_timeout(&self, id: &str, secs: i64) -> Result<i64, ApiError> {
        let secs = self.check_timeout(secs)?;
        let end = self.set_end(id, |_| now_ms() + secs as i64 * 1000)?;
        self.event(id, "timeout", format!("ends in {secs}s"));
        Ok(end)
    }

    /// Connect/refresh: the sandbox lives at least `secs` more.
    pub fn extend(&self, id: &str, secs: i64, why: &str) -> Result<SandboxRecord, ApiError> {
        let secs = self.check_timeout(secs)?;
        self.set_end(id, |cur| cur.max(now_ms() + secs as i64 * 1000))?;
        self.event(id, why, format!("lives at least {secs}s more"));
        self.get_live(id)
    }

    /// CPU percentage since the previous sample of this sandbox.
    pub fn cpu_pct(&self, id: &str, cpu_ns: u64, cpus: u32) -> f64 {
        let mut live = self.live();
        let Some(l) = live.get_mut(id) else {
            return 0.0;
        };
        let now = Instant::now();
        let pct = match l.last_cpu {
            Some((t, prev)) if cpu_ns >= prev => {
                let wall = now.duration_since(t).as_nanos() as f64;
                if wall > 0.0 {
                    ((cpu_ns - prev) as f64 / wall / f64::from(cpus.max(1)) * 100.0).min(100.0)
                } else {
                    0.0
                }
            }
            _ => 0.0,
        };
        l.last_cpu = Some((now, cpu_ns));
        pct
    }

    /// Kills sandboxes whose time is up. Returns the ids killed.
    pub async fn reap_expired(&self) -> Vec<String> {
        let now = now_ms();
        let due: Vec<String> = self
            .live()
            .values()
            .filter(|l| l.record.end_at_ms <= now)
            .map(|l| l.record.id.clone())
            .collect();
        let mut killed = Vec::new();
        for id in due {
            match self.kill(&id, "timeout expired").await {
                Ok(true) => killed.push(id),
                Ok(false) => {}
                Err(e) => tracing::warn!(sandbox = %id, error = %e, "killing an expired sandbox"),
            }
        }
        killed
    }

    /// Runs [`Self::reap_expired`] forever.
    pub fn spawn_reaper(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let me = Arc::clone(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(me.cfg.reap_interval).await;
                me.reap_expired().await;
            }
        })
    }

    /// After a (possibly unclean) restart: adopts sandboxes that still run and answer, cleans
    /// up and marks everything else, and removes host leftovers the database does not know.
    pub async fn recover(&self) -> Result<RecoveryReport, ApiError> {
        let mut report = RecoveryReport::default();
        let known = self.store.list_sandboxes(&[
            SandboxState::Starting,
            SandboxState::Running,
            SandboxState::Paused,
        ])?;
        let mut keep = std::collections::HashSet::new();
        for rec in known {
            let socket = self.socket_of(&rec.id);
            let alive = rec.state == SandboxState::Running
                && self.driver.is_running(&rec.id).await.unwrap_or(false)
                && agent_http::healthy(&socket).await;
            if alive {
                keep.insert(rec.id.clone());
                self.live().insert(
                    rec.id.clone(),
                    Live {
                        record: rec.clone(),
                        socket,
                        last_cpu: None,
                    },
                );
                self.event(&rec.id, "recovered", "still running after a server restart");
                report.adopted.push(rec.id);
            } else {
                let _ = self.driver.stop(&rec.id).await;
                self.store.set_state(
                    &rec.id,
                    SandboxState::Killed,
                    Some("gone after a server restart"),
                )?;
                self.event(
                    &rec.id,
                    "lost",
                    "not running after a server restart; cleaned up",
                );
                report.cleaned.push(rec.id);
            }
        }
        let on_host = self
            .driver
            .list_on_host()
            .await
            .map_err(|e| ApiError::internal(format!("listing sandboxes on the host: {e}")))?;
        for h in on_host {
            if !keep.contains(&h.id) {
                if let Err(e) = self.driver.stop(&h.id).await {
                    tracing::warn!(sandbox = %h.id, error = %e, "removing a leftover sandbox");
                }
                report.orphans_removed.push(h.id);
            }
        }
        Ok(report)
    }

    /// Stops every running sandbox (used by tests and an orderly shutdown if configured).
    pub async fn kill_all(&self, reason: &str) {
        let ids: Vec<String> = self.live().keys().cloned().collect();
        for id in ids {
            let _ = self.kill(&id, reason).await;
        }
    }
}

/// What [`Manager::recover`] did.
#[derive(Debug, Default, Clone)]
pub struct RecoveryReport {
    pub adopted: Vec<String>,
    pub cleaned: Vec<String>,
    pub orphans_removed: Vec<String>,
}
