//! Any image becomes a kiln template, through the same cache as recipes, in two stages:
//!
//! 1. **image stage** (`.base/<stage-hash>/{rootfs/, image.json}`): the layers applied in
//!    order ([`super::unpack`]); keyed by the image digest alone, so every template and agent
//!    version made from one image shares it. An image without `/bin/bash` stops here.
//! 2. **template** (`<name>/<key>`): a hard-linked copy plus what kiln adds (kiln-agent, the
//!    user `user`, sudo through the agent's broker, mount points) and the ext4 image; keyed by
//!    image digest + agent binary + builder version. The image config's `Env`, `WorkingDir` and
//!    `User` become the template's env, workdir and user (`user` and its home when unset).
//!
//! Like recipe builds, everything is made under `.tmp/` and renamed into place.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use sha2::{Digest, Sha256};

use super::blobs::Blobs;
use super::image::Image;
use super::registry::{pull, PullOptions};
use super::rootpath::{resolve, Resolve};
use super::unpack::apply_layer;
use super::{users, OciError};
use crate::build::layers::{install_compat, make_ext4, tree_size};
use crate::build::progress::{Log, Ui};
use crate::build::{find_agent, sha256_file, statx_compat_wanted, template_key, BuildOutcome};
use crate::store::{remove_tree, Store, Template};
use crate::{io_err, Error, Result};

/// Bump when what the image builder makes from the same image changes.
const IMAGE_BUILDER_VERSION: &str = "kiln-image-builder-1";
/// PATH for images whose config sets none.
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Where an image comes from.
#[derive(Debug, Clone)]
pub enum ImageSource {
    /// A registry image name (`python:3.12`, `ghcr.io/org/img@sha256:…`).
    Registry(String),
    /// A `docker save` or OCI-layout tarball.
    Archive(PathBuf),
}

#[derive(Debug, Clone, Default)]
pub struct ImageBuildOptions {
    /// kiln-agent binary to install; found automatically when `None`.
    pub agent: Option<PathBuf>,
    /// Rebuild even when cached (the layers in the blob cache are reused).
    pub force: bool,
    pub quiet: bool,
    pub pull: PullOptions,
}

/// The blob cache of `store`.
pub fn blobs_of(store: &Store) -> Result<Blobs> {
    Ok(Blobs::open(
        store.root().join(".blobs"),
        store.root().join(".tmp"),
    )?)
}

/// Fetches the image (registry or tarball) into the blob cache. Blocking: a registry pull runs
/// on its own thread and runtime, so this may be called from anywhere.
pub fn fetch(store: &Store, source: &ImageSource, opts: &PullOptions) -> Result<Image> {
    let blobs = blobs_of(store)?;
    match source {
        ImageSource::Archive(f) => Ok(super::archive::import(&blobs, f)?),
        ImageSource::Registry(name) => {
            let name = name.clone();
            let opts = opts.clone();
            std::thread::spawn(move || -> Result<Image, OciError> {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                    .map_err(|e| OciError::io("starting the pull runtime", e))?;
                rt.block_on(pull(&blobs, &name, &opts))
            })
            .join()
            .map_err(|_| Error::Oci(OciError::Invalid("the pull thread panicked".into())))?
            .map_err(Error::from)
        }
    }
}

/// The template name used when none is given: for a registry image, its name in `store`
/// ([`image_template_name`]).
pub fn default_name(store: &Store, source: &ImageSource, opts: &PullOptions) -> Result<String> {
    Ok(match source {
        ImageSource::Registry(n) => {
            image_template_name(store, &super::reference::resolve(n, &opts.mirrors)?)?
        }
        ImageSource::Archive(f) => {
            let stem = f
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .split('.')
                .next()
                .unwrap_or("")
                .to_string();
            sanitize(&stem)
        }
    })
}

/// The kiln template registry image `image` is, in `store`: the readable name
/// [`template_name_for`](super::reference::template_name_for) gives it (`python:3.12` →
/// `python-3-12`), unless the current template of that name was made from another image
/// (`ghcr.io/x/python:3.12` beside `python:3.12`); then that name with a hash of the image's
/// full name, so two images never share a template. A template of that name not made from an
/// image (`base`, a recipe's) is the image name's meaning, as a Dockerfile's `FROM base`.
/// `kiln template build --from-image` and the server's `fromImage` builds both name with it.
pub fn image_template_name(store: &Store, image: &super::reference::ImageName) -> Result<String> {
    let readable = super::reference::template_name_for(image);
    let made_from = image_of(store, &readable)?.map(|i| i.source);
    Ok(name_beside(readable, made_from.as_deref(), &image.full))
}

/// `readable`, or `readable-<hash of full>` when the template of that name was made from an
/// image other than `full`.
fn name_beside(readable: String, made_from: Option<&str>, full: &str) -> String {
    match made_from {
        Some(other) if other != full => {
            let h = hex::encode(&Sha256::digest(full.as_bytes())[..6]);
            let keep = &readable[..readable.len().min(64 - h.len() - 1)];
            format!("{}-{h}", keep.trim_end_matches('-'))
        }
        _ => readable,
    }
}

fn sanitize(s: &str) -> String {
    let mut out = String::new();
    for c in s.chars().map(|c| c.to_ascii_lowercase()) {
        if c.is_ascii_lowercase() || c.is_ascii_digit() {
            out.push(c);
        } else if !out.is_empty() && !out.ends_with('-') {
            out.push('-');
        }
    }
    let out = out.trim_end_matches('-');
    if out.is_empty() {
        "image".into()
    } else {
        out[..out.len().min(64)].trim_end_matches('-').to_string()
    }
}

fn check_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('-')
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(Error::Oci(OciError::Invalid(format!(
            "template name {name:?} is invalid: use 1-64 lowercase letters, digits and '-'"
        ))))
    }
}

/// The image stage's key: the image digest and the builder version.
fn stage_hash(image_digest: &str) -> String {
    let mut h = Sha256::new();
    for part in [IMAGE_BUILDER_VERSION, image_digest] {
        h.update(part.as_bytes());
        h.update([0]);
    }
    hex::encode(h.finalize())
}

/// Fetches the image and builds template `name` (default: from the image name) from it.
pub fn build_from_image(
    store: &Store,
    source: &ImageSource,
    name: Option<&str>,
    opts: &ImageBuildOptions,
) -> Result<BuildOutcome> {
    let started = Instant::now();
    let name = match name {
        Some(n) => n.to_string(),
        None => default_name(store, source, &opts.pull)?,
    };
    check_name(&name)?;
    let agent = find_agent(opts.agent.as_deref())?;
    let agent_sha256 = sha256_file(&agent)?;
    let image = fetch(store, source, &opts.pull)?;
    let stage = stage_hash(&image.digest);
    let statx_compat = statx_compat_wanted();
    let key = template_key(
        &format!("{IMAGE_BUILDER_VERSION}:{stage}"),
        &agent_sha256,
        statx_compat,
    );
    let ui = Ui { quiet: opts.quiet };
    if !opts.force {
        if let Some(t) = store.get(&name, &key)? {
            let t = store.publish_existing(&t)?;
            ui.line(&format!(
                "template {} is cached (image {}, key {})",
                t.name,
                image.digest,
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
    kiln_host::prereq::ensure(&[kiln_host::prereq::Tool {
        program: "mkfs.ext4",
        package: "e2fsprogs",
        why: "template ext4 images",
    }])?;
    let log_path = store.log_path(&name, &key);
    let mut log = Log::create(&log_path)?;
    ui.line(&format!(
        "building template {name} from {} ({}, key {}, log {})",
        image.source,
        image.digest,
        &key[..12],
        log_path.display()
    ));
    let blobs = blobs_of(store)?;
    let (stage_root, base_cached) =
        image_stage(store, &blobs, &image, &stage, opts.force, &ui, &mut log)?;

    let staging = tempfile::Builder::new()
        .prefix("template-")
        .tempdir_in(store.root().join(".tmp"))
        .map(tempfile::TempDir::keep)
        .map_err(io_err("creating a temp dir for the template"))?;
    let result = (|| {
        let rootfs = staging.join("rootfs");
        let phase = ui.phase("add kiln-agent, user `user`, sudo");
        let out = Command::new("cp")
            .arg("-al")
            .arg(&stage_root)
            .arg(&rootfs)
            .output()
            .map_err(io_err("running cp"))?;
        if !out.status.success() {
            log.write(&out.stderr);
            return Err(log.failure("copying the image stage", &log_path));
        }
        let (user, workdir, env) = add_kiln(&rootfs, &agent, &image)?;
        if statx_compat {
            let lib = resolve(
                &rootfs,
                Path::new("usr/lib"),
                Resolve {
                    follow_last: true,
                    create_parents: true,
                },
            )
            .map_err(Error::from)?;
            let etc = resolve(
                &rootfs,
                Path::new("etc"),
                Resolve {
                    follow_last: true,
                    create_parents: true,
                },
            )
            .map_err(Error::from)?;
            if lib != rootfs.join("usr/lib") || etc != rootfs.join("etc") {
                return Err(Error::Oci(OciError::Invalid(
                    "KILN_STATX_COMPAT needs /usr/lib and /etc to be plain directories in the image".into(),
                )));
            }
            install_compat(&staging, &rootfs, &mut log)
                .map_err(|_| log.failure("building the compat preload library", &log_path))?;
        }
        phase.done();
        log.line(&format!(
            "user {user}, workdir {workdir}, {} env vars",
            env.len()
        ));

        let phase = ui.phase("ext4 image (mkfs.ext4 -d)");
        let size_bytes = tree_size(&rootfs);
        make_ext4(&rootfs, &staging.join("rootfs.ext4"), size_bytes, &mut log)
            .map_err(|_| log.failure("making the ext4 image", &log_path))?;
        phase.done();
        let meta = Template {
            name: name.clone(),
            key: key.clone(),
            recipe_hash: stage.clone(),
            base_stage: Some(stage.clone()),
            agent_sha256: agent_sha256.clone(),
            dir: PathBuf::new(),
            rootfs: PathBuf::new(),
            ext4: PathBuf::new(),
            user,
            workdir,
            env,
            start_cmd: None,
            ready_cmd: None,
            memory_mb: None,
            disk_mb: None,
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
        "template {} built from {} in {:.1}s: {}",
        template.name,
        image.source,
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

/// Stage 1: the layers applied in order, cached by image digest.
fn image_stage(
    store: &Store,
    blobs: &Blobs,
    image: &Image,
    stage: &str,
    force: bool,
    ui: &Ui,
    log: &mut Log,
) -> Result<(PathBuf, bool)> {
    let done = store.base_dir(stage);
    if done.join("rootfs").is_dir() && done.join("image.json").is_file() && !force {
        ui.line("image stage cached (layers already unpacked)");
        return Ok((done.join("rootfs"), true));
    }
    let staging = tempfile::Builder::new()
        .prefix("image-")
        .tempdir_in(store.root().join(".tmp"))
        .map(tempfile::TempDir::keep)
        .map_err(io_err("creating a temp dir for the image stage"))?;
    let result = (|| -> Result<()> {
        let rootfs = staging.join("rootfs");
        std::fs::create_dir(&rootfs).map_err(io_err("creating the image rootfs"))?;
        let n = image.layers.len();
        for (i, layer) in image.layers.iter().enumerate() {
            let phase = ui.phase(&format!("layer {}/{n} {}", i + 1, &layer.digest[..19]));
            let blob = blobs.path(&layer.digest)?;
            let stats = apply_layer(&rootfs, &blob, Some(&layer.diff_id), &layer.digest)
                .inspect_err(|e| log.line(&format!("layer {}/{n}: {e}", i + 1)))?;
            log.line(&format!(
                "layer {}/{n} {}: {}, {} entries, {:.1} MiB, {} whiteouts, {} opaque dirs, {} device nodes skipped",
                i + 1,
                layer.digest,
                stats.compression,
                stats.entries,
                stats.bytes as f64 / 1048576.0,
                stats.whiteouts,
                stats.opaque_dirs,
                stats.skipped_devices
            ));
            phase.done();
        }
        users::require_bash(&rootfs, &image.source)?;
        let json = serde_json::to_vec_pretty(image).expect("image metadata serializes");
        std::fs::write(staging.join("image.json"), json).map_err(io_err("writing image.json"))?;
        Ok(())
    })();
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

/// The image (its full name as [`Image::source`], `docker.io/library/python:3.12`, and its
/// digest) the current version of template `name` was made from; `None` when there is no
/// such template or it was not made from an image.
pub fn image_of(store: &Store, name: &str) -> Result<Option<Image>> {
    let t = match store.lookup(name) {
        Ok(t) => t,
        Err(Error::NotBuilt(_)) => return Ok(None),
        Err(e) => return Err(e),
    };
    let Some(stage) = t.base_stage else {
        return Ok(None);
    };
    let Ok(bytes) = std::fs::read(store.base_dir(&stage).join("image.json")) else {
        return Ok(None);
    };
    Ok(serde_json::from_slice::<Image>(&bytes).ok())
}

/// Removes cached blobs no image stage in the cache uses (run after [`Store::gc`], which
/// removes the stages no kept template stacks on). Returns the files removed.
pub fn gc_blobs(store: &Store) -> Result<Vec<PathBuf>> {
    let mut live = std::collections::HashSet::new();
    let bases = store.root().join(".base");
    for b in std::fs::read_dir(&bases)
        .map_err(io_err(format!("listing {}", bases.display())))?
        .flatten()
    {
        let Ok(bytes) = std::fs::read(b.path().join("image.json")) else {
            continue;
        };
        if let Ok(img) = serde_json::from_slice::<Image>(&bytes) {
            live.insert(img.config_digest);
            live.extend(img.layers.into_iter().map(|l| l.digest));
        }
    }
    Ok(blobs_of(store)?.retain(|d| live.contains(d))?)
}

type Defaults = (String, String, std::collections::BTreeMap<String, String>);

/// Stage 2's additions; returns the template's user, workdir and env.
fn add_kiln(rootfs: &Path, agent: &Path, image: &Image) -> Result<Defaults, OciError> {
    users::ensure_dirs(rootfs)?;
    let default_user = users::ensure_default_user(rootfs)?;
    users::install_sudo(rootfs)?;
    users::install_agent(rootfs, agent)?;
    let user = match &image.config.user {
        Some(u) => users::user_name(rootfs, u)?,
        None => default_user.name.clone(),
    };
    let workdir = match &image.config.workdir {
        Some(w) => w.clone(),
        None => users::passwd(rootfs)?
            .into_iter()
            .find(|e| e.name == user)
            .map(|e| e.home)
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "/".into()),
    };
    if !workdir.starts_with('/') {
        return Err(OciError::Invalid(format!(
            "{}: WorkingDir {workdir:?} is not absolute",
            image.source
        )));
    }
    let wd = resolve(
        rootfs,
        Path::new(&workdir),
        Resolve {
            follow_last: true,
            create_parents: true,
        },
    )?;
    if wd.symlink_metadata().is_err() {
        std::fs::create_dir(&wd)
            .map_err(|e| OciError::io(format!("creating {}", wd.display()), e))?;
    }
    let mut env = image.config.env.clone();
    env.entry("PATH".into())
        .or_insert_with(|| DEFAULT_PATH.into());
    Ok((user, workdir, env))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_keys() {
        assert_eq!(sanitize("My_Image.v2"), "my-image-v2");
        assert_eq!(sanitize("__"), "image");
        assert!(check_name("ok-1").is_ok());
        assert!(check_name("Bad").is_err());
        assert_ne!(stage_hash("sha256:a"), stage_hash("sha256:b"));
        let src = ImageSource::Archive(PathBuf::from("/x/Foo_bar.tar.gz"));
        let d = tempfile::tempdir().unwrap();
        let store = Store::open(d.path()).unwrap();
        assert_eq!(
            default_name(&store, &src, &PullOptions::default()).unwrap(),
            "foo-bar"
        );
    }

    /// Two images whose readable names are one never share a template: the second gets the
    /// name with a hash of its full name; the same image, or a template not made from an
    /// image, keeps the readable name.
    #[test]
    fn two_images_never_share_a_template_name() {
        let hub = "docker.io/library/python:3.12";
        let ghcr = "ghcr.io/x/python:3.12";
        let n = |made: Option<&str>, full: &str| name_beside("python-3-12".into(), made, full);
        assert_eq!(n(None, ghcr), "python-3-12");
        assert_eq!(n(Some(hub), hub), "python-3-12");
        let other = n(Some(hub), ghcr);
        assert!(
            other.starts_with("python-3-12-") && other.len() == 24,
            "{other}"
        );
        assert_ne!(other, n(Some(hub), "ghcr.io/y/python:3.12"));
        assert_eq!(other, n(Some("x"), ghcr), "the hashed name is stable");
        assert_eq!(n(Some(ghcr), hub).len(), 24);
        let long = name_beside("a".repeat(64), Some(hub), ghcr);
        assert!(long.len() <= 64 && check_name(&long).is_ok(), "{long}");
    }
}
