//! Creating a sandbox: validate, look the template up, let the driver create and start it,
//! wait for its agent, initialise it (`/init`), start the template's start command.

use std::time::{Duration, Instant};

use super::provision::Origin;
use super::{CreateParams, Manager};
use crate::driver::SandboxSpec;
use crate::error::{Error, Result};
use crate::store::{SandboxRecord, TemplateRecord};
use crate::templates::{self, TemplateInfo};

/// The `/init` that gives a freshly booted agent the sandbox's identity: environment (the
/// template's, then the request's), access token, default user and working directory, clock,
/// and the extra CAs it trusts (`cas`, installed by the agent before it answers).
pub(super) fn init_request(
    record: &SandboxRecord,
    tpl: &TemplateInfo,
    cas: &[String],
) -> kiln_proto::envd::InitRequest {
    let mut env: std::collections::HashMap<String, String> = tpl.env.clone().into_iter().collect();
    env.extend(record.env_vars.clone());
    kiln_proto::envd::InitRequest {
        env_vars: Some(env),
        access_token: record.envd_token.clone(),
        default_user: Some(tpl.user.clone()),
        default_workdir: Some(tpl.workdir.clone()),
        timestamp: Some(chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true)),
        extra_cas: super::network::extra_cas_field(cas),
        ..Default::default()
    }
}

impl Manager {
    /// Creates and starts a sandbox, returning its record once its agent is initialised.
    pub async fn create(&self, p: CreateParams) -> Result<SandboxRecord> {
        let started = Instant::now();
        let timeout = self.check_timeout(
            p.timeout_secs
                .unwrap_or(self.cfg.default_timeout_secs as i64),
        )?;
        self.check_network(p.network.as_ref())?;
        if p.template_id.trim().is_empty() {
            return Err(Error::bad_request("templateID must not be empty"));
        }
        for k in p.env_vars.keys() {
            if k.is_empty() || k.contains('=') || k.contains('\0') {
                return Err(Error::bad_request(format!(
                    "invalid environment variable name {k:?}"
                )));
            }
        }
        let team = p.team().to_string();
        // A template build's sandbox is outside the team's quota (builds have a bound of their
        // own) and is admitted apart from the team's creates; the server's cap still counts it.
        let build = super::is_build_sandbox(&p.metadata);
        let quota = if build {
            crate::tenancy::TeamQuota::default()
        } else {
            self.team_quota(&team).await?
        };
        let admit_as = if build {
            format!("{team} (template builds)")
        } else {
            team.clone()
        };
        if let Some(max) = quota.max_timeout_secs.filter(|m| timeout > *m) {
            return Err(Error::bad_request(format!(
                "timeout {timeout}s is above team \"{team}\"'s maximum of {max}s"
            )));
        }
        let name = p
            .template_id
            .split_once(':')
            .map(|(n, _)| n)
            .unwrap_or(&p.template_id)
            .to_string();
        // Refused up front when the server, the team's quota or the host is full (warm-pool
        // sandboxes are booted ahead: a create that takes one needs no more room on the host).
        let pooled_ready = self.pool_ready(&name) > 0;
        let _ticket =
            self.admission
                .admit(&admit_as, &quota, pooled_ready, self.live_for(&admit_as))?;
        if let Some(snap) = self.find_snapshot(&p.template_id, &team).await? {
            return self.create_from_snapshot(&p, snap, timeout).await;
        }
        let tpl = self.lookup_template(&name).await?;
        // Recorded once per template version this server creates from (not on every create).
        let version = (tpl.name.clone(), tpl.key.clone());
        let recorded = || {
            self.recorded_templates
                .lock()
                .unwrap_or_else(|p| p.into_inner())
        };
        if !recorded().contains(&version) {
            let upserted = self
                .store
                .upsert_template(&TemplateRecord {
                    name: tpl.name.clone(),
                    key: tpl.key.clone(),
                    built_at_ms: tpl.built_at_unix as i64 * 1000,
                    size_bytes: tpl.size_bytes,
                    spawn_count: 0,
                    last_spawned_ms: None,
                    image: tpl.image.as_ref().map(|p| p.display().to_string()),
                })
                .await;
            if upserted.is_ok() {
                recorded().insert(version);
            }
        }

        // Syscall auditing and volumes start with the sandbox: never from a warm pool. A warm
        // pool's sandbox of this template, booted ahead of time, when there is one; else a
        // boot slot (waiting in the create queue for whichever comes first).
        self.note_demand(&tpl.name);
        let poolable = !self.wants_syscall_audit(&p) && p.volume_mounts.is_empty();
        let origin = match self.claim(&tpl.name, poolable).await? {
            super::pool::Claim::Pooled(id) => Origin::Template {
                pooled: Some(id),
                permit: None,
            },
            super::pool::Claim::Cold(permit) => Origin::Template {
                pooled: None,
                permit: Some(permit),
            },
        };
        self.provision(&p, &tpl, origin, timeout, started).await
    }

    /// Gives a freshly booted agent the sandbox's identity and starts the template's start
    /// command.
    async fn init_booted(&self, record: &SandboxRecord, tpl: &TemplateInfo) -> Result<()> {
        // The first /init of a fresh agent: no token is set yet, so none is sent. (A second
        // /init, e.g. on resume, must send the current token.)
        self.agent(&record.id, None)
            .init(&init_request(record, tpl, self.extra_cas()))
            .await
            .map_err(|e| Error::create("initialising the agent")(e.into()))?;
        if let Some(cmd) = &tpl.start_cmd {
            self.start_cmd(record, tpl, cmd)
                .await
                .map_err(Error::create("starting the template's start command"))?;
            if let Some(ready) = &tpl.ready_cmd {
                self.wait_start_ready(record, tpl, ready)
                    .await
                    .map_err(Error::create("waiting for the template's start command"))?;
            }
        }
        Ok(())
    }

    /// The template `name`, or 400 (bad name) / 404 (not built).
    pub(super) async fn lookup_template(&self, name: &str) -> Result<TemplateInfo> {
        templates::check_name(name)?;
        let t = self.templates.clone();
        let n = name.to_string();
        tokio::task::spawn_blocking(move || t.lookup(&n))
            .await
            .map_err(|e| Error::internal(format!("template lookup task: {e}")))??
            .ok_or_else(|| {
                Error::NotFound(format!(
                    "template \"{name}\" not found; build it with `kiln template build {name}`"
                ))
            })
    }

    /// Creates, starts and initialises the sandbox (a `pooled` one is already running: it is
    /// only initialised); returns how long each phase took.
    pub(super) async fn boot(
        &self,
        spec: &SandboxSpec,
        record: &SandboxRecord,
        tpl: &TemplateInfo,
        pooled: bool,
        network: Option<&kiln_net::EgressPolicy>,
    ) -> Result<String> {
        if pooled {
            let t = Instant::now();
            if let Some(policy) = network {
                self.apply_network(&spec.id, policy).await?;
            }
            self.init_booted(record, tpl).await?;
            return Ok(format!(
                "from the warm pool, init {} ms",
                t.elapsed().as_millis()
            ));
        }
        let t = Instant::now();
        self.driver
            .create(spec)
            .await
            .map_err(|e| Error::create("preparing the sandbox")(e.into()))?;
        if let Some(policy) = network {
            self.apply_network(&spec.id, policy).await?;
        }
        let t_create = t.elapsed();
        self.driver
            .start(&spec.id)
            .await
            .map_err(|e| Error::create("starting the sandbox")(e.into()))?;
        let t_start = t.elapsed();
        let agent = self.agent(&spec.id, None);
        if let Err(e) = agent.wait_ready(self.cfg.agent_ready_timeout).await {
            let log = self
                .driver
                .console_log(&spec.id, 2000)
                .await
                .unwrap_or_default();
            return Err(Error::create("waiting for the sandbox agent")(
                Error::internal(format!(
                    "the agent did not answer within {:?} ({e}). Sandbox output:\n{log}",
                    self.cfg.agent_ready_timeout
                )),
            ));
        }
        let t_ready = t.elapsed();
        self.init_booted(record, tpl).await?;
        let t_init = t.elapsed();
        let ms = |d: Duration| d.as_millis();
        Ok(format!(
            "prepare {} ms, start {} ms, agent ready {} ms, init {} ms",
            ms(t_create),
            ms(t_start - t_create),
            ms(t_ready - t_start),
            ms(t_init - t_ready)
        ))
    }
}
