//! The one provision pipeline every create passes: a template's sandbox (booted cold, or taken
//! from its warm pool) and a sandbox continuing from a snapshot (a create from a snapshot, a
//! fork's child). Each takes the same steps — the record, the spec (disk, volumes, syscall
//! auditing, network), the boot its origin needs, running in the store and the registry, the
//! `created` event — so the origins cannot drift apart.

use std::time::Instant;

use tokio::sync::SemaphorePermit;

use super::{CreateParams, Manager};
use crate::driver::SandboxSpec;
use crate::error::Result;
use crate::store::{now_ms, SandboxRecord, SandboxState, SnapshotRecord};
use crate::templates::TemplateInfo;

/// The metadata key that turns on syscall-level auditing for a sandbox (`"true"`).
pub const SYSCALL_AUDIT_KEY: &str = "kiln.audit.syscalls";

/// Where a new sandbox's processes and files come from.
pub(super) enum Origin<'a> {
    /// A template's sandbox: `pooled` names a warm-pool sandbox already booted; else `permit`
    /// is the boot slot, held until the agent is initialised.
    Template {
        pooled: Option<String>,
        permit: Option<SemaphorePermit<'a>>,
    },
    /// A sandbox continuing from a snapshot: its processes and files as they were, with its
    /// own id and access token; `alias` is the name it was created by.
    Snapshot { snap: SnapshotRecord, alias: String },
}

impl Manager {
    /// Whether `p` asks for syscall-level auditing and this server records it.
    pub(super) fn wants_syscall_audit(&self, p: &CreateParams) -> bool {
        self.audit().enabled()
            && p.metadata.get(SYSCALL_AUDIT_KEY).map(String::as_str) == Some("true")
    }

    /// Provisions a sandbox of template `tpl` from `origin` for request `p` (a create that
    /// began at `started`); its record once it is running. A failure after the record is
    /// written ends the sandbox (`boot_failed`).
    pub(super) async fn provision(
        &self,
        p: &CreateParams,
        tpl: &TemplateInfo,
        origin: Origin<'_>,
        timeout: u64,
        started: Instant,
    ) -> Result<SandboxRecord> {
        let pooled = match &origin {
            Origin::Template { pooled, .. } => pooled.clone(),
            Origin::Snapshot { .. } => None,
        };
        let id = pooled.clone().unwrap_or_else(super::new_sandbox_id);
        if let Origin::Snapshot { snap, .. } = &origin {
            // The new sandbox's audit chain continues from its parent's.
            self.audit()
                .link(
                    &id,
                    &snap.sandbox_id,
                    serde_json::json!({ "snapshot": snap.id }),
                )
                .await;
        }
        let mut record = self.new_record(&id, p, tpl, &origin, timeout);
        if let Err(e) = self.store.insert_sandbox(&record).await {
            if pooled.is_some() {
                let _ = self.driver.stop(&id).await;
            }
            return Err(e.into());
        }
        let spec = match self.spec_of(&id, p, tpl, &origin).await {
            Ok(s) => s,
            Err(e) => return Err(self.boot_failed(&id, e).await),
        };
        let label = match &origin {
            Origin::Template { .. } => format!("template {}", tpl.name),
            Origin::Snapshot { snap, .. } => format!("from snapshot {}", snap.id),
        };
        let before_boot = started.elapsed().as_millis();
        let booted = match origin {
            Origin::Template { pooled, permit } => {
                // A pooled sandbox is already booted: giving it its identity is not CPU-bound
                // work and holds no boot slot; a cold boot holds its slot until the agent is
                // initialised.
                let r = self
                    .boot(&spec, &record, tpl, pooled.is_some(), p.network.as_ref())
                    .await;
                drop(permit);
                r
            }
            Origin::Snapshot { snap, .. } => match self.admission.boot_permit().await {
                Ok(_permit) => self.restore_and_init(&snap, &spec, &record).await,
                Err(e) => Err(e),
            },
        };
        let phases = match booted {
            Ok(w) => w,
            Err(e) => return Err(self.boot_failed(&id, e).await),
        };
        record.state = SandboxState::Running;
        // The clock starts when the sandbox is usable.
        record.end_at_ms = now_ms() + (timeout as i64) * 1000;
        self.store
            .set_running(&id, record.end_at_ms, &tpl.name)
            .await?;
        self.registry.insert(record.clone());
        let ms = started.elapsed().as_millis();
        let detail = format!(
            "{label} in {ms} ms (records and spec {before_boot} ms, {phases}), timeout {timeout}s"
        );
        self.event(&id, "created", detail).await;
        Ok(record)
    }

    /// The record a new sandbox starts with (state `starting`).
    fn new_record(
        &self,
        id: &str,
        p: &CreateParams,
        tpl: &TemplateInfo,
        origin: &Origin<'_>,
        timeout: u64,
    ) -> SandboxRecord {
        let (template_id, alias, mut env_vars) = match origin {
            Origin::Template { .. } => (tpl.name.clone(), tpl.name.clone(), Default::default()),
            Origin::Snapshot { snap, alias } => (
                snap.template_id.clone(),
                alias.clone(),
                snap.env_vars.clone(),
            ),
        };
        env_vars.extend(p.env_vars.clone());
        let now = now_ms();
        SandboxRecord {
            id: id.to_string(),
            template_id,
            alias: Some(alias),
            client_id: "kiln".into(),
            state: SandboxState::Starting,
            metadata: p.metadata.clone(),
            env_vars,
            cpu_count: self.cfg.default_cpu_count,
            memory_mb: tpl.memory_mb.unwrap_or(self.cfg.default_memory_mb),
            disk_size_mb: tpl.disk_mb.unwrap_or(self.cfg.default_disk_mb),
            envd_token: p.secure.then(|| crate::auth::random_hex(16)),
            started_at_ms: now,
            end_at_ms: now + (timeout as i64) * 1000,
            ended_at_ms: None,
            end_reason: None,
            auto_pause: p.auto_pause,
            driver: self.driver.name().to_string(),
            pause_mode: None,
            auto_resume: p.auto_resume,
            auto_pause_memory: !p.auto_pause_filesystem_only,
            team: p.team().to_string(),
            ingress: p.ingress.clone(),
        }
    }

    /// What the driver is asked to run: the template's spec with syscall auditing, volume
    /// mounts (the request's; a snapshot's are its source's, which its memory holds) and, for a
    /// restore, the egress policy (its processes run at once, so the policy must be in force
    /// before; a booted sandbox gets it between create and start).
    async fn spec_of(
        &self,
        id: &str,
        p: &CreateParams,
        tpl: &TemplateInfo,
        origin: &Origin<'_>,
    ) -> Result<SandboxSpec> {
        let mut spec = self.spec_for(id, tpl);
        spec.syscall_audit = self.wants_syscall_audit(p);
        let mounts = match origin {
            Origin::Template { .. } => p.volume_mounts.clone(),
            Origin::Snapshot { snap, .. } => self.mounts_of(&snap.sandbox_id).await?,
        };
        spec.volumes = self.record_mounts(id, &mounts).await?;
        if matches!(origin, Origin::Snapshot { .. }) && self.driver.has_network() {
            if let Some(t) = p.network.as_ref().and_then(|n| n.transforms.as_ref()) {
                if let Some(tokens) = &t.tokens {
                    tokens.bind(id);
                }
            }
            spec.network = p.network.clone();
        }
        Ok(spec)
    }
}
