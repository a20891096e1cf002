//! Templates built through E2B's Template API: per team, named templates whose builds run
//! their steps in a build sandbox ([`runner`], [`steps`]) and end as a snapshot that
//! `Sandbox.create("name[:tag]")` starts from; uploaded COPY archives ([`files`]); the state
//! in the database (`store::BuildsDb`).
//!
//! A build is requested (`waiting`), started once with its steps (`building`), and ends
//! `ready` or `error`. At most [`MAX_CONCURRENT`] builds run at once, the others queue; a team
//! has at most [`DEFAULT_PER_TEAM`] (`KILN_TEMPLATE_BUILDS_PER_TEAM`) started and unfinished,
//! more are refused (429). A build that was running when the server stopped ends as `error`
//! when it starts again, and its build sandbox is removed once recovery is over. Build
//! sandboxes are the builds' own: hidden from the team's sandbox lists and outside its
//! sandbox quota. A sandbox of a template's last step's parent layer stands for its next
//! build ([`standing`]). Template versions and cache entries nothing names are collected
//! ([`gc`]).

pub mod files;
pub mod gc;
mod image;
mod runner;
pub mod standing;
mod start;
mod steps;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;

use crate::error::{Error, Result};
use crate::manager::SandboxService;
use crate::store::{now_ms, BuildRow, BuildsDb, TplRow};

/// Builds running at once (each boots one build sandbox).
pub const MAX_CONCURRENT: usize = 2;
/// Builds one team may have started and not finished (`KILN_TEMPLATE_BUILDS_PER_TEAM`).
pub const DEFAULT_PER_TEAM: usize = 4;
/// Default cap of one uploaded COPY archive (`KILN_TEMPLATE_UPLOAD_MAX_MB` changes it).
pub const DEFAULT_UPLOAD_MAX: u64 = 512 << 20;
pub use crate::manager::{is_build_sandbox, BUILD_META};

/// Why a build that was running when the server stopped failed.
pub const RESTART_REASON: &str =
    "the kiln server restarted while this build was running; start the build again";

/// One step of a build, as the SDK sends it.
#[derive(Debug, Clone, Deserialize, serde::Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Step {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub force: Option<bool>,
    #[serde(default)]
    pub files_hash: Option<String>,
    #[serde(default)]
    pub force_upload: Option<bool>,
}

/// A build's start request (`TemplateBuildStartV2`).
#[derive(Debug, Clone, Default, Deserialize, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StartSpec {
    #[serde(default)]
    pub from_image: Option<String>,
    #[serde(default)]
    pub from_template: Option<String>,
    #[serde(default)]
    pub from_image_registry: Option<serde_json::Value>,
    #[serde(default)]
    pub force: Option<bool>,
    #[serde(default)]
    pub steps: Vec<Step>,
    #[serde(default)]
    pub start_cmd: Option<String>,
    #[serde(default)]
    pub ready_cmd: Option<String>,
}

/// What a ready build's sandboxes start from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved {
    /// A snapshot id or a kiln template name: what `POST /sandboxes` takes as `templateID`.
    pub template_id: String,
    pub user: Option<String>,
    pub workdir: Option<String>,
}

/// How the build service is set up (`kiln serve` flags).
#[derive(Debug, Clone)]
pub struct BuildsConfig {
    /// Where `fromImage` images are pulled from instead of their registries.
    pub registry_mirrors: kiln_template::oci::Mirrors,
    /// Period of the automatic collection ([`gc`]); `None`: only on request.
    pub gc_interval: Option<std::time::Duration>,
    /// Uploaded COPY archives younger than this are never collected.
    pub files_grace: std::time::Duration,
    /// The template store's part of the automatic collection (`kiln serve` installs it).
    pub store_gc: Option<gc::StoreGc>,
    /// How long a sandbox of a template's last step's parent layer stands for its next
    /// build ([`standing`]); `None`: never.
    pub standing: Option<std::time::Duration>,
}

impl Default for BuildsConfig {
    fn default() -> Self {
        Self {
            registry_mirrors: Default::default(),
            gc_interval: Some(gc::DEFAULT_INTERVAL),
            files_grace: gc::DEFAULT_FILES_GRACE,
            store_gc: None,
            standing: Some(standing::DEFAULT_STANDING),
        }
    }
}

/// The template-build service.
pub struct Builds {
    config: BuildsConfig,
    image_locks: image::ImageLocks,
    /// Held shared while an image becomes a template, exclusively while the template store
    /// is collected (which would take a half-made template's image layers for unused).
    store_lock: tokio::sync::RwLock<()>,
    db: BuildsDb,
    manager: Arc<dyn SandboxService>,
    /// Sandbox and snapshot records (a step's cached layer is a snapshot).
    sandboxes: Arc<dyn crate::store::SandboxStore>,
    files_dir: PathBuf,
    tokens: files::Tokens,
    queue: tokio::sync::Semaphore,
    upload_max: u64,
    /// Builds the previous server left running.
    interrupted: std::collections::HashSet<String>,
    /// Started and unfinished builds per team, and how many a team may have.
    per_team: Arc<std::sync::Mutex<std::collections::HashMap<String, usize>>>,
    per_team_max: usize,
    standing: standing::Standing,
    /// When this server's build service opened (standing sandboxes older are leftovers).
    opened_at_ms: i64,
}

/// A team's place among the builds it has started; given back when dropped (the build ended).
pub struct BuildSlot {
    counts: Arc<std::sync::Mutex<std::collections::HashMap<String, usize>>>,
    team: String,
}

impl Drop for BuildSlot {
    fn drop(&mut self) {
        let mut m = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = m.get_mut(&self.team) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                m.remove(&self.team);
            }
        }
    }
}

/// A team already has its most builds running (429).
#[derive(Debug, thiserror::Error)]
#[error(
    "team {team:?} already has {max} template builds running or queued, its limit \
     (KILN_TEMPLATE_BUILDS_PER_TEAM); start this build again once one has finished"
)]
pub struct TooManyBuilds {
    pub team: String,
    pub max: usize,
}

/// Template names: 1-64 lowercase letters, digits, `-`, `_` or `.`, starting with a letter or
/// digit (a `:tag` is split off before).
pub fn check_template_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        && name.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'-' | b'_' | b'.')
        })
        && !name.contains("..");
    if ok {
        Ok(())
    } else {
        Err(Error::bad_request(format!(
            "invalid template name {name:?}: use 1-64 lowercase letters, digits, '-', '_' or '.'"
        )))
    }
}

/// Tags: 1-64 letters, digits, `-`, `_` or `.`.
pub fn check_tag(tag: &str) -> Result<()> {
    let ok = !tag.is_empty()
        && tag.len() <= 64
        && tag
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(Error::bad_request(format!(
            "invalid tag {tag:?}: use 1-64 letters, digits, '-', '_' or '.'"
        )))
    }
}

/// `name[:tag]` split.
pub fn split_tag(s: &str) -> (&str, Option<&str>) {
    match s.split_once(':') {
        Some((n, t)) => (n, Some(t)),
        None => (s, None),
    }
}

impl Builds {
    /// The service over the build tables `db`, its files under `state_dir`; builds the previous
    /// server left running end as `error`.
    pub async fn open(
        state_dir: &Path,
        db: BuildsDb,
        manager: Arc<dyn SandboxService>,
        sandboxes: Arc<dyn crate::store::SandboxStore>,
        config: BuildsConfig,
    ) -> std::result::Result<Arc<Self>, crate::store::StoreError> {
        let interrupted = db.fail_unfinished(RESTART_REASON, now_ms()).await?;
        for id in &interrupted {
            let _ = db
                .add_log(
                    id,
                    "error",
                    Some("finalize".into()),
                    RESTART_REASON.into(),
                    now_ms(),
                )
                .await;
        }
        let upload_max = std::env::var("KILN_TEMPLATE_UPLOAD_MAX_MB")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .map(|mb| mb << 20)
            .unwrap_or(DEFAULT_UPLOAD_MAX);
        let b = Arc::new(Self {
            config,
            image_locks: Default::default(),
            store_lock: Default::default(),
            db,
            manager,
            sandboxes,
            files_dir: state_dir.join("template-files"),
            tokens: files::Tokens::default(),
            queue: tokio::sync::Semaphore::new(MAX_CONCURRENT),
            upload_max,
            interrupted: interrupted.into_iter().collect(),
            per_team: Default::default(),
            per_team_max: std::env::var("KILN_TEMPLATE_BUILDS_PER_TEAM")
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
                .filter(|n| *n > 0)
                .unwrap_or(DEFAULT_PER_TEAM),
            standing: Default::default(),
            opened_at_ms: now_ms(),
        });
        Ok(b)
    }

    /// Removes build sandboxes a previous server left (their builds ended with it, and the
    /// sandboxes it kept standing); called once recovery has adopted them.
    pub async fn remove_leftover_sandboxes(&self) {
        for s in self.manager.list() {
            let left = s.metadata.get(BUILD_META).is_some_and(|b| {
                self.interrupted.contains(b)
                    || (b == standing::STANDING && s.started_at_ms < self.opened_at_ms)
            });
            if left {
                let _ = self
                    .manager
                    .kill(&s.id, "its template build ended with the previous server")
                    .await;
            }
        }
    }

    pub fn db(&self) -> &BuildsDb {
        &self.db
    }

    pub fn tokens(&self) -> &files::Tokens {
        &self.tokens
    }

    pub fn upload_max(&self) -> u64 {
        self.upload_max
    }

    pub fn files_dir(&self) -> &Path {
        &self.files_dir
    }

    /// The template of `team` whose id or name is `key` (404 otherwise, also when it belongs
    /// to another team).
    pub async fn template_of(&self, team: &str, key: &str) -> Result<TplRow> {
        let (name, _) = split_tag(key);
        self.db
            .templates_named(name)
            .await?
            .into_iter()
            .find(|t| t.team == team)
            .ok_or_else(|| Error::NotFound(format!("template {name:?} not found")))
    }

    /// Template `key` of `team` (as [`Self::template_of`] finds it) and its newest builds,
    /// newest first.
    pub async fn recent_builds(
        &self,
        team: &str,
        key: &str,
    ) -> Result<(TplRow, Vec<crate::store::BuildSummary>)> {
        let t = self.template_of(team, key).await?;
        let list = self.db.recent_builds(&t.id).await?;
        Ok((t, list))
    }

    /// The build tag `tag` of template `t` names, if it has that tag.
    pub async fn tagged_build(&self, t: &TplRow, tag: &str) -> Result<Option<String>> {
        Ok(self
            .db
            .tags(&t.id)
            .await?
            .into_iter()
            .find(|r| r.tag == tag)
            .map(|r| r.build_id))
    }

    /// `POST /v3/templates`: the template `name` of `team` (made when new) and a new build of
    /// it that will get `tags`.
    pub async fn request(
        &self,
        team: &str,
        name: &str,
        mut tags: Vec<String>,
        cpu_count: Option<i64>,
        memory_mb: Option<i64>,
    ) -> Result<(TplRow, BuildRow)> {
        let (base, tag) = split_tag(name);
        check_template_name(base)?;
        if let Some(t) = tag {
            tags.push(t.to_string());
        }
        for t in &tags {
            check_tag(t)?;
        }
        if tags.is_empty() {
            tags.push("default".into());
        }
        tags.dedup();
        if let Some(m) = memory_mb.filter(|m| !(128..=65536).contains(m)) {
            return Err(Error::bad_request(format!(
                "memoryMB must be 128-65536, got {m}"
            )));
        }
        let now = now_ms();
        let t = self
            .db
            .ensure_template(
                team,
                base,
                &crate::manager::new_sandbox_id(),
                cpu_count,
                memory_mb,
                now,
            )
            .await?;
        let b = BuildRow {
            id: uuid::Uuid::new_v4().to_string(),
            template_id: t.id.clone(),
            status: "waiting".into(),
            tags,
            created_at_ms: now,
            ..Default::default()
        };
        self.db.insert_build(&b).await?;
        Ok((t, b))
    }

    /// A place for one more build of `team`, or [`TooManyBuilds`] when it has its most.
    pub fn reserve(&self, team: &str) -> std::result::Result<BuildSlot, TooManyBuilds> {
        let mut m = self.per_team.lock().unwrap_or_else(|p| p.into_inner());
        let n = m.entry(team.to_string()).or_default();
        if *n >= self.per_team_max {
            return Err(TooManyBuilds {
                team: team.to_string(),
                max: self.per_team_max,
            });
        }
        *n += 1;
        Ok(BuildSlot {
            counts: self.per_team.clone(),
            team: team.to_string(),
        })
    }

    /// `POST /v2/templates/{id}/builds/{buildID}`: checks the request and starts the build in
    /// the background, holding `slot` until it ends (409 when it was started before).
    pub async fn start(
        self: &Arc<Self>,
        team: &str,
        template_key: &str,
        build_id: &str,
        spec: StartSpec,
        slot: BuildSlot,
    ) -> Result<()> {
        let tpl = self.template_of(team, template_key).await?;
        let build = self
            .db
            .get_build(build_id)
            .await?
            .filter(|b| b.template_id == tpl.id)
            .ok_or_else(|| {
                Error::NotFound(format!(
                    "build {build_id:?} of template {template_key:?} not found"
                ))
            })?;
        steps::validate(&spec)?;
        let json = serde_json::to_string(&spec)
            .map_err(|e| Error::internal(format!("encoding the build request: {e}")))?;
        if !self.db.start_build(&build.id, &json).await? {
            return Err(Error::Conflict(format!(
                "build {build_id} was started before (it is {}); request a new build",
                build.status
            )));
        }
        let me = self.clone();
        let team = team.to_string();
        tokio::spawn(async move {
            let _slot = slot;
            let _permit = me.queue.acquire().await;
            runner::run(me.clone(), team, tpl, build, spec).await;
        });
        Ok(())
    }

    /// What `Sandbox.create(key)` starts from when `key` (`name[:tag]` or a template id)
    /// names a template `team` built; `None` when it names none.
    pub async fn resolve(&self, team: &str, key: &str) -> Result<Option<Resolved>> {
        let (name, tag) = split_tag(key);
        if check_template_name(name).is_err() {
            return Ok(None);
        }
        let t = match self.template_of(team, name).await {
            Ok(t) => t,
            Err(Error::NotFound(_)) => return Ok(None),
            Err(e) => return Err(e),
        };
        let build_id =
            match tag {
                Some(tag) => Some(self.tagged_build(&t, tag).await?.ok_or_else(|| {
                    Error::NotFound(format!("template {name:?} has no tag {tag:?}"))
                })?),
                None => self.tagged_build(&t, "default").await?,
            };
        let build = match build_id {
            Some(id) => self.db.get_build(&id).await?,
            None => self.db.latest_ready(&t.id).await?,
        };
        let Some(b) = build.filter(|b| b.status == "ready") else {
            return Err(Error::NotFound(format!(
                "template {key:?} has no finished build yet"
            )));
        };
        Ok(b.target
            .as_deref()
            .and_then(target_template_id)
            .map(|id| Resolved {
                template_id: id,
                user: b.user,
                workdir: b.workdir,
            }))
    }

    /// Deletes the template `key` of `team`, then collects what it alone used.
    pub async fn delete(&self, team: &str, key: &str) -> Result<gc::Collected> {
        let t = self.template_of(team, key).await?;
        self.db.delete_template(&t.id).await?;
        self.drop_standing(&t.id).await;
        self.collect(team).await
    }

    /// Appends a line to a build's log.
    pub(crate) async fn log(&self, build: &str, level: &str, step: Option<&str>, msg: String) {
        let ts = now_ms();
        if let Err(e) = self
            .db
            .add_log(build, level, step.map(str::to_string), msg, ts)
            .await
        {
            tracing::warn!(build, error = %e, "recording a build log line");
        }
    }
}

/// `snap:<id>` / `tpl:<name>` → the `templateID` a create takes.
fn target_template_id(target: &str) -> Option<String> {
    target
        .strip_prefix("snap:")
        .or_else(|| target.strip_prefix("tpl:"))
        .map(str::to_string)
}

/// The environment a build's steps see so far.
pub(crate) type Env = BTreeMap<String, String>;
