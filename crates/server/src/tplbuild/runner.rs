//! Running one build: resolve its base (step `base`), walk its steps with a cache key
//! chained over (parent, step, inputs), reuse the snapshot a cached `RUN`/`COPY` produced or
//! run it in the build sandbox and snapshot the sandbox's filesystem as that step's layer,
//! then finish (step `finalize`): the last layer is what the template's sandboxes start from.
//!
//! With a start command, [`super::start`] then boots the last layer, runs it until the ready
//! command succeeds and snapshots the running sandbox, memory included.
//!
//! The build sandbox is an ordinary sandbox of the build's team (same driver and limits),
//! taken standing ([`super::standing`]) or created from the parent layer when a step must
//! run, and killed at the end. A failing step caches nothing and ends the build with its step
//! number and output tail.

use std::sync::Arc;
use std::time::Instant;

use sha2::{Digest, Sha256};

use super::image::E2B_BASE_IMAGE;
use super::steps::{absolute, sh_quote, StepFailure};
use super::{Builds, Env, StartSpec, Step, BUILD_META};
use crate::manager::CreateParams;
use crate::store::{now_ms, BuildRow, TplRow};

/// Seconds a build sandbox may live (the longest build).
pub(super) const BUILD_SANDBOX_SECS: u64 = 3600;

/// A build failure: the step it names (`base`, `"1"`…, `finalize`) and why.
struct Failed {
    step: String,
    message: String,
}

fn fail(step: impl Into<String>, message: impl Into<String>) -> Failed {
    Failed {
        step: step.into(),
        message: message.into(),
    }
}

/// Where a build is while it walks its steps.
struct Walk {
    /// What the next build sandbox starts from (`POST /sandboxes` `templateID`).
    parent: String,
    /// Whether `parent` is a snapshot (else a kiln template name).
    parent_is_snapshot: bool,
    key: String,
    user: String,
    workdir: String,
    /// A WORKDIR not yet made in a layer.
    workdir_pending: bool,
    /// The (workdir, user) the parent layer has the working directory made and owned for.
    workdir_made: Option<(String, String)>,
    env: Env,
    sandbox: Option<String>,
    /// The layer the last layer-making step reached so far started from (a snapshot).
    last_step_parent: Option<String>,
}

fn chain(key: &str, part: &str) -> String {
    let mut h = Sha256::new();
    h.update(key.as_bytes());
    h.update([0]);
    h.update(part.as_bytes());
    hex::encode(h.finalize())
}

/// Runs `build` of `tpl` to its end, recording its log and outcome.
pub(super) async fn run(
    b: Arc<Builds>,
    team: String,
    tpl: TplRow,
    build: BuildRow,
    spec: StartSpec,
) {
    let t = Instant::now();
    b.log(
        &build.id,
        "info",
        None,
        format!("Building template {} ({})", tpl.name, tpl.id),
    )
    .await;
    let mut walk = None;
    let outcome = walk_steps(&b, &team, &build.id, &spec, &mut walk)
        .await
        .and_then(|()| {
            walk.take()
                .ok_or_else(|| fail("finalize", "the build ended without a result"))
        });
    let ended = match &outcome {
        Ok(w) => Some(w),
        Err(_) => walk.as_ref(),
    };
    if let Some(sid) = ended.and_then(|w| w.sandbox.clone()) {
        let _ = b.manager.kill(&sid, "template build finished").await;
    }
    // The next build most likely changes the last step (also when it failed).
    if let Some(layer) = ended.and_then(|w| w.last_step_parent.clone()) {
        b.stand_by(&tpl.id, &team, &layer);
    }
    let mut row = build.clone();
    match outcome {
        Ok(w) => {
            row.status = "ready".into();
            row.target = Some(if w.parent_is_snapshot {
                format!("snap:{}", w.parent)
            } else {
                format!("tpl:{}", w.parent)
            });
            row.user = Some(w.user);
            row.workdir = Some(w.workdir);
        }
        Err(f) => {
            b.log(&build.id, "error", Some(&f.step), f.message.clone())
                .await;
            row.status = "error".into();
            row.reason = Some(f.message);
            row.reason_step = Some(f.step);
        }
    }
    if let Err(e) = b.db.finish_build(&row, now_ms()).await {
        tracing::warn!(build = build.id, error = %e, "recording a build's end");
        return;
    }
    if row.status == "ready" {
        if let Err(e) =
            b.db.assign_tags(&tpl.id, &row.tags, &row.id, now_ms())
                .await
        {
            tracing::warn!(build = build.id, error = %e, "tagging a build");
        }
        b.log(
            &build.id,
            "info",
            Some("finalize"),
            format!("Build finished in {:.1}s", t.elapsed().as_secs_f64()),
        )
        .await;
    }
}

/// The base of a build: what its first sandbox starts from, its cache key, user and workdir.
async fn base(b: &Builds, team: &str, build: &str, spec: &StartSpec) -> Result<Walk, Failed> {
    let name = match (&spec.from_template, &spec.from_image) {
        (Some(t), _) => {
            if let Some(r) = b
                .resolve(team, t)
                .await
                .map_err(|e| fail("base", e.to_string()))?
            {
                let is_snap = crate::manager::is_snapshot_id(&r.template_id);
                return Ok(Walk {
                    key: chain("base", &r.template_id),
                    parent_is_snapshot: is_snap,
                    parent: r.template_id,
                    user: r.user.unwrap_or_else(|| "user".into()),
                    workdir: r.workdir.unwrap_or_else(|| "/home/user".into()),
                    workdir_pending: false,
                    workdir_made: None,
                    env: Env::new(),
                    sandbox: None,
                    last_step_parent: None,
                });
            }
            let (n, _) = super::split_tag(t);
            n.to_string()
        }
        (None, Some(img)) => b
            .image_template(
                build,
                img,
                spec.from_image_registry.as_ref(),
                spec.force.unwrap_or(false),
            )
            .await
            .map_err(|m| fail("base", m))?,
        (None, None) => "base".to_string(),
    };
    let view = b.manager.template(&name).await.map_err(|e| {
        let what = match &spec.from_image {
            Some(img) if spec.from_template.is_none() => {
                format!("image {img:?}: its template {name:?}: {e}")
            }
            _ => format!("template {name:?}: {e}"),
        };
        fail("base", what)
    })?;
    Ok(Walk {
        key: chain("base", &format!("{}@{}", view.info.name, view.info.key)),
        parent: view.info.name.clone(),
        parent_is_snapshot: false,
        user: view.info.user.clone(),
        workdir: view.info.workdir.clone(),
        workdir_pending: false,
        workdir_made: None,
        env: Env::new(),
        sandbox: None,
        last_step_parent: None,
    })
}

async fn walk_steps(
    b: &Arc<Builds>,
    team: &str,
    build: &str,
    spec: &StartSpec,
    slot: &mut Option<Walk>,
) -> Result<(), Failed> {
    let w = slot.insert(base(b, team, build, spec).await?);
    if w.parent_is_snapshot {
        // The template built before that this one stacks on stays while this build is kept.
        b.db.add_build_layer(build, &w.parent)
            .await
            .map_err(|e| fail("base", e.to_string()))?;
    }
    b.log(
        build,
        "info",
        Some("base"),
        format!(
            "FROM {}",
            spec.from_template
                .as_deref()
                .or(spec.from_image.as_deref())
                .unwrap_or(E2B_BASE_IMAGE)
        ),
    )
    .await;
    let total = spec.steps.len();
    let mut forced = spec.force.unwrap_or(false);
    // The build sandbox ends with the last layer a step makes, unless a WORKDIR after it
    // needs a layer of its own.
    let last_layer = spec
        .steps
        .iter()
        .rposition(|s| matches!(s.kind.as_str(), "RUN" | "COPY"));
    let workdir_after = last_layer.is_some_and(|l| {
        spec.steps[l + 1..]
            .iter()
            .any(|s| s.kind.as_str() == "WORKDIR")
    });
    for (i, s) in spec.steps.iter().enumerate() {
        let label = (i + 1).to_string();
        forced |= s.force.unwrap_or(false);
        let ends = Some(i) == last_layer && !workdir_after;
        step(b, team, build, s, &label, total, forced, ends, w).await?;
    }
    if w.workdir_pending {
        // The last WORKDIR made no layer yet: a layer of its own.
        let mk = Step {
            kind: "RUN".into(),
            args: vec![format!("mkdir -p {}", sh_quote(&w.workdir)), "root".into()],
            force: None,
            files_hash: None,
            force_upload: None,
        };
        step(b, team, build, &mk, "finalize", total, forced, true, w).await?;
    }
    if let Some(start) = spec.start_cmd.as_deref().filter(|c| !c.trim().is_empty()) {
        let ready = spec
            .ready_cmd
            .as_deref()
            .filter(|c| !c.trim().is_empty())
            .unwrap_or(super::start::DEFAULT_READY);
        // A fresh boot of the last layer runs the start command.
        if let Some(sid) = w.sandbox.take() {
            let _ = b.manager.kill(&sid, "template build: finalizing").await;
        }
        let sid = ensure_sandbox(b, team, build, w)
            .await
            .map_err(|m| fail("finalize", m))?;
        let snap = super::start::capture_running(
            b, team, build, &sid, start, ready, &w.user, &w.workdir, &w.env,
        )
        .await
        .map_err(|m| fail("finalize", m))?;
        w.parent = snap;
        w.parent_is_snapshot = true;
    }
    Ok(())
}

/// One step: ENV/USER/WORKDIR change what later steps see; RUN and COPY make a layer (from
/// the cache unless `forced`); with `ends`, no later step runs in the build sandbox, which
/// ends with the layer's capture.
#[allow(clippy::too_many_arguments)]
async fn step(
    b: &Arc<Builds>,
    team: &str,
    build: &str,
    s: &Step,
    label: &str,
    total: usize,
    forced: bool,
    ends: bool,
    w: &mut Walk,
) -> Result<(), Failed> {
    let shown = format!("[{label}/{total}] {} {}", s.kind, s.args.join(" "));
    let inputs = serde_json::json!({
        "type": s.kind, "args": s.args, "filesHash": s.files_hash,
        "user": w.user, "workdir": w.workdir, "env": w.env,
    });
    w.key = chain(&w.key, &inputs.to_string());
    match s.kind.as_str() {
        "ENV" => {
            for kv in s.args.chunks(2) {
                w.env.insert(kv[0].clone(), kv[1].clone());
            }
            b.log(build, "info", Some(label), shown).await;
            return Ok(());
        }
        "USER" => {
            w.user = s.args[0].clone();
            b.log(build, "info", Some(label), shown).await;
            return Ok(());
        }
        "WORKDIR" => {
            w.workdir = absolute(&s.args[0], &w.workdir);
            w.workdir_pending = true;
            b.log(build, "info", Some(label), shown).await;
            return Ok(());
        }
        _ => {}
    }
    w.last_step_parent = w.parent_is_snapshot.then(|| w.parent.clone());
    if !forced {
        if let Some(snap) =
            b.db.use_layer(team, &w.key, build)
                .await
                .map_err(|e| fail(label, e.to_string()))?
        {
            let exists = b
                .sandboxes
                .get_snapshot(&snap)
                .await
                .ok()
                .flatten()
                .is_some();
            if exists {
                b.log(build, "info", Some(label), format!("CACHED {shown}"))
                    .await;
                if let Some(sid) = w.sandbox.take() {
                    let _ = b
                        .manager
                        .kill(&sid, "template build: a later step was cached")
                        .await;
                }
                w.parent = snap;
                w.parent_is_snapshot = true;
                w.workdir_pending = false;
                // The cached step ran in this workdir as this user (both are in its key).
                w.workdir_made = Some((w.workdir.clone(), w.user.clone()));
                return Ok(());
            }
        }
    }
    b.log(build, "info", Some(label), shown).await;
    let t = Instant::now();
    let sid = ensure_sandbox(b, team, build, w)
        .await
        .map_err(|m| fail(label, m))?;
    let booted = t.elapsed();
    let made = (w.workdir.clone(), w.user.clone());
    if w.workdir_made.as_ref() != Some(&made) {
        b.make_workdir(&sid, &w.workdir, &w.user)
            .await
            .map_err(|StepFailure(m)| {
                fail(
                    label,
                    format!("step {label}: making WORKDIR {}: {m}", w.workdir),
                )
            })?;
        w.workdir_made = Some(made);
    }
    let t_step = Instant::now();
    let ran = match s.kind.as_str() {
        "RUN" => {
            let user = s
                .args
                .get(1)
                .filter(|u| !u.is_empty())
                .unwrap_or(&w.user)
                .clone();
            b.run_in(build, &sid, label, &s.args[0], &user, &w.workdir, &w.env)
                .await
        }
        _ => {
            b.copy_in(build, &sid, label, team, s, &w.user, &w.workdir)
                .await
        }
    };
    if let Err(StepFailure(m)) = ran {
        return Err(fail(
            label,
            format!("step {label} ({} {}) failed: {m}", s.kind, s.args.join(" ")),
        ));
    }
    let (ran, t_save) = (t_step.elapsed(), Instant::now());
    let snap = if ends {
        w.sandbox = None;
        b.manager
            .snapshot_ending(&sid, team, "template build: its last layer is saved")
            .await
    } else {
        b.manager.snapshot_with(&sid, team, None, false).await
    }
    .map_err(|e| fail(label, format!("step {label}: saving its layer: {e}")))?;
    b.db.put_layer(
        team,
        &w.key,
        &snap.id,
        build,
        s.files_hash.as_deref(),
        now_ms(),
    )
    .await
    .map_err(|e| fail(label, e.to_string()))?;
    b.log(
        build,
        "debug",
        Some(label),
        format!(
            "layer {} in {:.2}s (build sandbox {:.2}s, step {:.2}s, saved in {:.2}s)",
            snap.id,
            t.elapsed().as_secs_f64(),
            booted.as_secs_f64(),
            ran.as_secs_f64(),
            t_save.elapsed().as_secs_f64()
        ),
    )
    .await;
    w.parent = snap.id;
    w.parent_is_snapshot = true;
    w.workdir_pending = false;
    Ok(())
}

/// The running build sandbox: the one the walk has, else the standing one of the current
/// parent layer, else one booted from the parent.
async fn ensure_sandbox(
    b: &Arc<Builds>,
    team: &str,
    build: &str,
    w: &mut Walk,
) -> Result<String, String> {
    if let Some(s) = &w.sandbox {
        return Ok(s.clone());
    }
    let standing = match w.parent_is_snapshot {
        true => b.take_standing(team, &w.parent).await,
        false => None,
    };
    let id = match standing {
        Some(id) => {
            b.log(
                build,
                "debug",
                None,
                format!("build sandbox {id}: standing on {}", w.parent),
            )
            .await;
            id
        }
        None => {
            b.boot_build_sandbox(team, &w.parent, build, BUILD_SANDBOX_SECS)
                .await?
        }
    };
    w.sandbox = Some(id.clone());
    Ok(id)
}

impl Builds {
    /// Boots a build sandbox of `team` from `parent` (a template or a layer), marked as
    /// `owner`'s (a build id, or [`super::standing::STANDING`]), living `timeout_secs`.
    pub(super) async fn boot_build_sandbox(
        &self,
        team: &str,
        parent: &str,
        owner: &str,
        timeout_secs: u64,
    ) -> Result<String, String> {
        let mut metadata = std::collections::BTreeMap::new();
        metadata.insert(BUILD_META.to_string(), owner.to_string());
        // Trusting what every sandbox trusts (a `RUN pip install` behind the host's proxy).
        let rec = crate::api::host_trust::create(
            self.manager.as_ref(),
            CreateParams {
                template_id: parent.to_string(),
                timeout_secs: Some(timeout_secs as i64),
                metadata,
                secure: false,
                team: team.to_string(),
                ..Default::default()
            },
        )
        .await
        .map_err(|e| format!("starting the build sandbox: {e}"))?;
        Ok(rec.id)
    }
}
