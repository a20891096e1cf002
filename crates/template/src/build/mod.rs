//! The template builder: recipe → root filesystem directory + ext4 image, in two cached stages.
//!
//! 1. **base stage** (`.base/<recipe-hash>`): `mmdebstrap` of the recipe's Debian suite and
//!    packages, with each recipe step run as an mmdebstrap customize hook (so `/proc` and `/dev`
//!    are mounted for `run` steps). Keyed by the recipe alone.
//! 2. **template** (`<name>/<key>`): a hard-linked copy of the base stage plus kiln-agent at
//!    `/usr/bin/kiln-agent`, login scripts that start no programs ([`login`]) (plus, with `KILN_STATX_COMPAT=1`, the statx compat preload library
//!    that runsc releases before 2024 need: see docs/runsc.md), and `rootfs.ext4` made with `mkfs.ext4 -d` (no loop mounts). Keyed by
//!    recipe + agent binary + builder version, so a new agent costs seconds, not a debootstrap.
//!
//! Both stages are built under `.tmp/` and renamed into place; a failed build leaves nothing in
//! the cache and names the failing step with the tail of the full log.
//!
//! Modules: [`mmdebstrap`] (stage 1), [`layers`] (what stage 2 adds, the ext4 image), [`login`]
//! (login scripts that start no programs), [`agent`]
//! (finding a static kiln-agent), [`progress`] (log file and progress display).

mod agent;
pub(crate) mod layers;
mod login;
mod mmdebstrap;
pub(crate) mod progress;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use sha2::{Digest, Sha256};

pub use agent::{find_agent, is_static_elf};
pub use layers::{AGENT_PATH_IN_ROOTFS, COMPAT_PATH_IN_ROOTFS};

use layers::{install_agent, install_compat, make_ext4, tree_size, COMPAT_SOURCE};
use mmdebstrap::run_mmdebstrap;
use progress::{Log, Ui};

use crate::recipe::{Recipe, BASE_RECIPE};
use crate::store::{remove_tree, Store, Template};
use crate::{io_err, Result};

/// Bump when the builder's output for the same inputs changes.
const BUILDER_VERSION: &str = "kiln-template-builder-4";

#[derive(Debug, Clone, Default)]
pub struct BuildOptions {
    /// kiln-agent binary to install; found automatically when `None` (see [`find_agent`]).
    pub agent: Option<PathBuf>,
    /// Rebuild even when the cache has this template.
    pub force: bool,
    /// No progress output (errors are still returned).
    pub quiet: bool,
    /// apt sources for mmdebstrap: a mirror URL or a sources file. Default: `KILN_DEBIAN_MIRROR`,
    /// else the host's own Debian sources file.
    pub mirror: Option<String>,
}

#[derive(Debug, Clone)]
pub struct BuildOutcome {
    pub template: Template,
    /// True when nothing was built because the cache already had it.
    pub cached: bool,
    /// True when the mmdebstrap stage came from the cache (only the agent layer was rebuilt).
    pub base_cached: bool,
    pub elapsed: Duration,
}

/// Builds the base template from the recipe compiled into this binary, unless it is cached.
pub fn ensure_base(store: &Store, opts: &BuildOptions) -> Result<Template> {
    let recipe = Recipe::parse(BASE_RECIPE, "templates/base.toml")?;
    Ok(build(store, &recipe, opts)?.template)
}

/// Environment variable that adds the statx compat preload library to built templates (only
/// needed by runsc releases older than kiln's minimum, which reject `statx(AT_NO_AUTOMOUNT)`).
pub const STATX_COMPAT_ENV: &str = "KILN_STATX_COMPAT";

/// True when `KILN_STATX_COMPAT=1`.
pub fn statx_compat_wanted() -> bool {
    std::env::var(STATX_COMPAT_ENV).as_deref() == Ok("1")
}

/// The cache key of a template: recipe, agent binary, builder version and, when included, the
/// compat library's source.
pub fn template_key(recipe_hash: &str, agent_sha256: &str, statx_compat: bool) -> String {
    let compat = if statx_compat { COMPAT_SOURCE } else { "" };
    let mut h = Sha256::new();
    for part in [BUILDER_VERSION, compat, recipe_hash, agent_sha256] {
        h.update(part.as_bytes());
        h.update([0]);
    }
    hex::encode(h.finalize())
}

/// Builds `recipe` into `store` (or returns the cached template).
pub fn build(store: &Store, recipe: &Recipe, opts: &BuildOptions) -> Result<BuildOutcome> {
    let started = Instant::now();
    let agent = find_agent(opts.agent.as_deref())?;
    let agent_sha256 = sha256_file(&agent)?;
    let recipe_hash = recipe.content_hash();
    let statx_compat = statx_compat_wanted();
    let key = template_key(&recipe_hash, &agent_sha256, statx_compat);
    let ui = Ui { quiet: opts.quiet };

    if !opts.force {
        if let Some(t) = store.get(&recipe.name, &key)? {
            // Make sure it is the current one too (cheap; a rebuilt older key may be current).
            let t = store.publish_existing(&t)?;
            ui.line(&format!(
                "template {} is cached ({}, key {})",
                t.name,
                t.dir.display(),
                &key[..12]
            ));
            return Ok(BuildOutcome {
                template: t,
                cached: true,
                base_cached: true,
                elapsed: started.elapsed(),
            });
        }
    }
    kiln_host::prereq::ensure(&[
        kiln_host::prereq::Tool {
            program: "mmdebstrap",
            package: "mmdebstrap",
            why: "building template root filesystems",
        },
        kiln_host::prereq::Tool {
            program: "mkfs.ext4",
            package: "e2fsprogs",
            why: "template ext4 images",
        },
    ])?;

    let log_path = store.log_path(&recipe.name, &key);
    let mut log = Log::create(&log_path)?;
    ui.line(&format!(
        "building template {} (key {}, log {})",
        recipe.name,
        &key[..12],
        log_path.display()
    ));

    // The filesystem stage does not depend on the sandbox size or the commands the recipe's
    // sandboxes run.
    let stage_hash = Recipe {
        memory_mb: None,
        disk_mb: None,
        start_cmd: None,
        ready_cmd: None,
        ..recipe.clone()
    }
    .content_hash();
    let (base, base_cached) = base_stage(store, recipe, &stage_hash, opts, &ui, &mut log)?;

    let staging = tempdir_in(&store.tmp_dir(), "template-")?;
    let result = (|| {
        let rootfs = staging.join("rootfs");
        let phase = ui.phase(if statx_compat {
            "install kiln-agent and the statx compat library"
        } else {
            "install kiln-agent"
        });
        let out = Command::new("cp")
            .arg("-al")
            .arg(&base)
            .arg(&rootfs)
            .output()
            .map_err(io_err("running cp"))?;
        if !out.status.success() {
            log.write(&out.stderr);
            return Err(log.failure("copying the base stage", &log_path));
        }
        install_agent(&agent, &rootfs)?;
        login::quiet_login(&rootfs)?;
        if statx_compat {
            install_compat(&staging, &rootfs, &mut log)
                .map_err(|_| log.failure("building the compat preload library", &log_path))?;
        }
        phase.done();

        let phase = ui.phase("ext4 image (mkfs.ext4 -d)");
        let size_bytes = tree_size(&rootfs);
        make_ext4(&rootfs, &staging.join("rootfs.ext4"), size_bytes, &mut log)
            .map_err(|_| log.failure("making the ext4 image", &log_path))?;
        phase.done();

        let defaults = recipe.defaults();
        let meta = Template {
            name: recipe.name.clone(),
            key: key.clone(),
            recipe_hash: recipe_hash.clone(),
            base_stage: Some(stage_hash.clone()),
            agent_sha256: agent_sha256.clone(),
            dir: PathBuf::new(),
            rootfs: PathBuf::new(),
            ext4: PathBuf::new(),
            user: defaults.user,
            workdir: defaults.workdir,
            env: defaults.env,
            start_cmd: recipe.start_cmd.clone().filter(|s| !s.trim().is_empty()),
            ready_cmd: recipe.ready_cmd.clone().filter(|s| !s.trim().is_empty()),
            memory_mb: recipe.memory_mb,
            disk_mb: recipe.disk_mb,
            built_at_unix: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            size_bytes,
            build_secs: started.elapsed().as_secs_f64(),
        };
        store.publish(&staging, &meta)
    })();
    if result.is_err() {
        remove_tree(&staging);
    }
    let template = result?;
    ui.line(&format!(
        "template {} built in {:.1}s: {}",
        template.name,
        started.elapsed().as_secs_f64(),
        template.dir.display()
    ));
    Ok(BuildOutcome {
        template,
        cached: false,
        base_cached,
        elapsed: started.elapsed(),
    })
}

impl Store {
    /// Makes an already-built template current again (used on cache hits).
    pub(crate) fn publish_existing(&self, t: &Template) -> Result<Template> {
        match self.lookup(&t.name) {
            Ok(cur) if cur.key == t.key => Ok(cur),
            _ => {
                self.set_current(&t.name, &t.key)?;
                self.lookup(&t.name)
            }
        }
    }
}

/// Stage 1: mmdebstrap + recipe steps, cached by recipe hash. Returns the rootfs directory and
/// whether it came from the cache.
fn base_stage(
    store: &Store,
    recipe: &Recipe,
    recipe_hash: &str,
    opts: &BuildOptions,
    ui: &Ui,
    log: &mut Log,
) -> Result<(PathBuf, bool)> {
    let done = store.base_dir(recipe_hash);
    if done.join("rootfs").is_dir() && !opts.force {
        ui.line("base stage cached (mmdebstrap and steps skipped)");
        return Ok((done.join("rootfs"), true));
    }
    let staging = tempdir_in(&store.tmp_dir(), "base-")?;
    let result = run_mmdebstrap(recipe, opts, &staging, ui, log);
    match result {
        Ok(()) => {
            remove_tree(&done);
            std::fs::rename(&staging, &done).map_err(io_err(format!(
                "moving {} to {}",
                staging.display(),
                done.display()
            )))?;
            Ok((done.join("rootfs"), false))
        }
        Err(e) => {
            remove_tree(&staging);
            Err(e)
        }
    }
}

fn tempdir_in(parent: &Path, prefix: &str) -> Result<PathBuf> {
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in(parent)
        .map(tempfile::TempDir::keep)
        .map_err(io_err(format!(
            "creating a temp dir in {}",
            parent.display()
        )))
}

pub(crate) fn sha256_file(p: &Path) -> Result<String> {
    let mut f = File::open(p).map_err(io_err(format!("opening {}", p.display())))?;
    let mut h = Sha256::new();
    std::io::copy(&mut f, &mut h).map_err(io_err(format!("reading {}", p.display())))?;
    Ok(hex::encode(h.finalize()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_depends_on_recipe_and_agent() {
        let a = template_key("r1", "a1", false);
        assert_eq!(a, template_key("r1", "a1", false));
        assert_ne!(a, template_key("r2", "a1", false));
        assert_ne!(a, template_key("r1", "a2", false));
        assert_ne!(a, template_key("r1", "a1", true));
        // No ambiguity from concatenation.
        assert_ne!(
            template_key("r1a", "1", false),
            template_key("r1", "a1", false)
        );
    }
}
