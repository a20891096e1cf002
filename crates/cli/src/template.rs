//! `kiln template build|import|gc|ls`: thin layer over kiln-template (recipes and images);
//! `build -f Dockerfile` and the built templates' collection go to a running server's Template
//! API ([`crate::template_remote`]).

use std::path::PathBuf;

use kiln_template::oci::{self, Credentials, ImageBuildOptions, ImageSource, Mirrors, PullOptions};
use kiln_template::{recipe::BASE_RECIPE, BuildOptions, Recipe, Store};

/// Where images are pulled from and with which credentials.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct RegistryArgs {
    /// Pull a registry's images from a mirror: `REGISTRY=URL` (e.g.
    /// `docker.io=http://127.0.0.1:5000`); repeatable; adds to $KILN_REGISTRY_MIRRORS
    /// (comma-separated).
    #[arg(long = "registry-mirror", value_name = "REGISTRY=URL")]
    pub mirrors: Vec<String>,
    /// Registry user (Basic auth or token request); default $KILN_REGISTRY_USER.
    #[arg(long, env = "KILN_REGISTRY_USER")]
    pub registry_user: Option<String>,
    /// Registry password; default $KILN_REGISTRY_PASSWORD.
    #[arg(long, env = "KILN_REGISTRY_PASSWORD", hide_env_values = true)]
    pub registry_password: Option<String>,
}

impl RegistryArgs {
    fn pull_options(&self) -> anyhow::Result<PullOptions> {
        Ok(PullOptions {
            mirrors: Mirrors::from_env_and(&self.mirrors)?,
            credentials: self.registry_user.clone().map(|user| Credentials {
                user,
                password: self.registry_password.clone().unwrap_or_default(),
            }),
            quiet: false,
            parallel: 0,
            progress: None,
        })
    }
}

// Parsed once per run: the size of the largest variant does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(clap::Subcommand)]
pub enum Cmd {
    /// Build a template from a recipe or, with --from-image, from a container image (cached by
    /// recipe or image digest + agent hash; a second build says "cached").
    Build {
        /// `base`, or the path of a recipe file (`*.toml`).
        #[arg(
            required_unless_present_any = ["from_image", "file"],
            conflicts_with_all = ["from_image", "file"]
        )]
        recipe: Option<String>,
        /// Build from a registry image (`python:3.12`, `ghcr.io/org/img:tag`): its linux/amd64
        /// image, its Env/WorkingDir/User kept, kiln-agent and the user `user` added.
        #[arg(long, value_name = "IMAGE", conflicts_with = "file")]
        from_image: Option<String>,
        /// Build a Dockerfile on a running kiln server through its Template API (FROM, RUN,
        /// COPY/ADD of local files, ENV, ARG, WORKDIR, USER, CMD/ENTRYPOINT as the start
        /// command), as the API key's team; the result is `Sandbox.create(NAME)`.
        #[arg(short = 'f', long = "file", value_name = "DOCKERFILE")]
        file: Option<PathBuf>,
        /// Template name: for --from-image (default: from the image name, `python-3-12`), for
        /// -f (default: the context directory's name).
        #[arg(long)]
        name: Option<String>,
        /// -f: the directory COPY reads from (default: the Dockerfile's); its .dockerignore
        /// applies.
        #[arg(long, requires = "file")]
        context: Option<PathBuf>,
        /// -f: a tag of the build (repeatable).
        #[arg(long = "tag", requires = "file")]
        tags: Vec<String>,
        /// -f: the command that says the start command is ready (default: `sleep 20`, E2B's).
        #[arg(long, requires = "file")]
        ready_cmd: Option<String>,
        #[command(flatten)]
        conn: crate::sandbox::Conn,
        #[command(flatten)]
        registry: RegistryArgs,
        /// Rebuild even when cached.
        #[arg(long)]
        force: bool,
        /// kiln-agent binary to install (default: $KILN_AGENT_BIN or the static build next to kiln).
        #[arg(long)]
        agent: Option<PathBuf>,
        /// apt sources for mmdebstrap (mirror URL or sources file); default: the host's.
        #[arg(long)]
        mirror: Option<String>,
    },
    /// Make a template from a `docker save` tarball or an OCI-layout tarball (optionally gzip-
    /// or zstd-compressed).
    Import {
        file: PathBuf,
        /// Template name (default: from the file name).
        #[arg(long)]
        name: Option<String>,
        #[arg(long)]
        force: bool,
        #[arg(long)]
        agent: Option<PathBuf>,
    },
    /// Remove old template versions. Keeps each current one, the N newest others, and every
    /// version a sandbox stacks on (running on this host, or paused in the state dir) or a
    /// snapshot of the state dir does. Then, on the running server (--url, --api-key), the
    /// API key's team's built templates: versions no tag or name points to and step-cache
    /// entries no kept version uses, never one a running or paused sandbox started from.
    Gc {
        #[arg(long, default_value_t = 1)]
        keep: usize,
        /// Only the server's built templates (Template API), not this host's template store.
        #[arg(long)]
        built: bool,
        #[command(flatten)]
        conn: crate::sandbox::Conn,
    },
    /// List built templates.
    Ls {
        #[arg(long)]
        json: bool,
    },
}

fn load_recipe(arg: &str) -> anyhow::Result<Recipe> {
    if arg == "base" {
        return Ok(Recipe::parse(
            BASE_RECIPE,
            "templates/base.toml (built in)",
        )?);
    }
    let path = PathBuf::from(arg);
    if path.is_file() {
        return Ok(Recipe::load(&path)?);
    }
    let in_repo = PathBuf::from("templates").join(format!("{arg}.toml"));
    if in_repo.is_file() {
        return Ok(Recipe::load(&in_repo)?);
    }
    Err(kiln_template::Error::NoRecipe {
        name: arg.to_string(),
        looked: format!(
            "the built-in `base`, {}, {}",
            path.display(),
            in_repo.display()
        ),
    }
    .into())
}

fn print_outcome(out: &kiln_template::BuildOutcome) {
    let t = &out.template;
    println!(
        "{} {} {} ({:.2}s)\n  rootfs: {}\n  ext4:   {}",
        t.name,
        &t.key[..12],
        if out.cached { "cached" } else { "built" },
        out.elapsed.as_secs_f64(),
        t.rootfs.display(),
        t.ext4.display()
    );
}

pub fn run(c: Cmd) -> anyhow::Result<i32> {
    match c {
        Cmd::Build {
            file: Some(file),
            context,
            name,
            tags,
            ready_cmd,
            force,
            conn,
            ..
        } => {
            let b = crate::template_remote::DockerfileBuild {
                file,
                context,
                name,
                tags,
                ready_cmd,
                force,
            };
            return crate::template_remote::build(conn.client()?, b);
        }
        Cmd::Gc {
            built: true, conn, ..
        } => {
            crate::template_remote::collect(conn.client()?)?;
            return Ok(0);
        }
        _ => {}
    }
    let store = Store::open_default()?;
    match c {
        Cmd::Build {
            from_image: Some(image),
            name,
            registry,
            force,
            agent,
            ..
        } => {
            let opts = ImageBuildOptions {
                agent,
                force,
                quiet: false,
                pull: registry.pull_options()?,
            };
            let out = oci::build_from_image(
                &store,
                &ImageSource::Registry(image),
                name.as_deref(),
                &opts,
            )?;
            print_outcome(&out);
            Ok(0)
        }
        Cmd::Import {
            file,
            name,
            force,
            agent,
        } => {
            let opts = ImageBuildOptions {
                agent,
                force,
                quiet: false,
                pull: PullOptions::default(),
            };
            let out =
                oci::build_from_image(&store, &ImageSource::Archive(file), name.as_deref(), &opts)?;
            print_outcome(&out);
            Ok(0)
        }
        Cmd::Build {
            recipe,
            force,
            agent,
            mirror,
            ..
        } => {
            let recipe = load_recipe(recipe.as_deref().unwrap_or("base"))?;
            let opts = BuildOptions {
                agent,
                force,
                quiet: false,
                mirror,
            };
            let out = kiln_template::build(&store, &recipe, &opts)?;
            print_outcome(&out);
            Ok(0)
        }
        Cmd::Gc { keep, conn, .. } => {
            // Versions the server's sandboxes (running, paused) and snapshots stack on stay.
            let refs = crate::drivers::TemplateRefs::of_state(&kiln_host::paths::state_dir());
            let in_use = |d: &std::path::Path| {
                let used = refs.uses(d);
                if used {
                    println!("kept {} (sandboxes or snapshots use it)", d.display());
                }
                used
            };
            let mut removed = store.gc(keep, in_use)?;
            removed.extend(oci::template::gc_blobs(&store)?);
            for p in &removed {
                println!("removed {}", p.display());
            }
            println!("{} removed", removed.len());
            if let Err(e) = crate::template_remote::collect(conn.client()?) {
                eprintln!("kiln: the server's built templates were not collected: {e:#}");
            }
            Ok(0)
        }
        Cmd::Ls { json } => {
            let list = store.list()?;
            if json {
                println!("{}", serde_json::to_string_pretty(&list)?);
            } else {
                println!("{:<16} {:<14} {:>10}  BUILT", "NAME", "KEY", "SIZE");
                for t in list {
                    println!(
                        "{:<16} {:<14} {:>9}M  {}",
                        t.name,
                        &t.key[..12],
                        t.size_bytes >> 20,
                        t.built_at_unix
                    );
                }
            }
            Ok(0)
        }
    }
}

/// `kiln serve`'s Template API build settings: registry mirrors (`--registry-mirror`s after
/// $KILN_REGISTRY_MIRRORS), the automatic collection's period, the uploaded archives' grace
/// period, how long a sandbox stands for a template's next build, and whether it collects
/// the template store too (as `kiln template gc`).
pub fn serve_builds_config(
    mirrors: &[String],
    gc_interval: &str,
    files_grace: &str,
    standing: &str,
    store_gc: bool,
    state_dir: &std::path::Path,
) -> anyhow::Result<kiln_server::tplbuild::BuildsConfig> {
    use kiln_server::tplbuild::gc::StoreGc;
    let registry_mirrors = Mirrors::from_env_and(mirrors)
        .map_err(|e| anyhow::anyhow!("--registry-mirror / KILN_REGISTRY_MIRRORS: {e}"))?;
    let gc_interval = kiln_server::manager::parse_standby_after(gc_interval)
        .map_err(|e| anyhow::anyhow!("--template-gc-interval: {e}"))?;
    let files_grace = kiln_server::manager::parse_standby_after(files_grace)
        .map_err(|e| anyhow::anyhow!("--template-files-grace: {e}"))?
        .unwrap_or_default();
    let standing = kiln_server::manager::parse_standby_after(standing)
        .map_err(|e| anyhow::anyhow!("--template-standing: {e}"))?;
    let state_dir = state_dir.to_path_buf();
    let store_gc = store_gc.then(|| {
        StoreGc(std::sync::Arc::new(move || {
            let store = kiln_template::Store::open_default().map_err(|e| e.to_string())?;
            let refs = crate::drivers::TemplateRefs::of_state(&state_dir);
            let mut removed = store.gc(1, |d| refs.uses(d)).map_err(|e| e.to_string())?;
            removed
                .extend(kiln_template::oci::template::gc_blobs(&store).map_err(|e| e.to_string())?);
            Ok(removed.iter().map(|p| p.display().to_string()).collect())
        }))
    });
    Ok(kiln_server::tplbuild::BuildsConfig {
        registry_mirrors,
        gc_interval,
        files_grace,
        store_gc,
        standing,
    })
}
