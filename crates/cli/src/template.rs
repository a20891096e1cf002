//! `kiln template build|ls`: thin layer over kiln-template.

use std::path::PathBuf;

use kiln_template::{recipe::BASE_RECIPE, BuildOptions, Recipe, Store};

#[derive(clap::Subcommand)]
pub enum Cmd {
    /// Build a template (cached by recipe + agent hash; a second build says "cached").
    Build {
        /// `base`, or the path of a recipe file (`*.toml`).
        recipe: String,
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
    /// Remove old template versions. Keeps each current one, the N newest others, and every
    /// version a sandbox stacks on (running on this host, or paused in the state dir) or a
    /// snapshot of the state dir does.
    Gc {
        #[arg(long, default_value_t = 1)]
        keep: usize,
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

pub fn run(c: Cmd) -> anyhow::Result<i32> {
    let store = Store::open_default()?;
    match c {
        Cmd::Build {
            recipe,
            force,
            agent,
            mirror,
        } => {
            let recipe = load_recipe(&recipe)?;
            let opts = BuildOptions {
                agent,
                force,
                quiet: false,
                mirror,
            };
            let out = kiln_template::build(&store, &recipe, &opts)?;
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
            Ok(0)
        }
        Cmd::Gc { keep } => {
            // Versions the server's sandboxes (running, paused) and snapshots stack on stay.
            let refs = crate::drivers::TemplateRefs::of_state(&kiln_host::paths::state_dir());
            let in_use = |d: &std::path::Path| {
                let used = refs.uses(d);
                if used {
                    println!("kept {} (sandboxes or snapshots use it)", d.display());
                }
                used
            };
            let removed = store.gc(keep, in_use)?;
            for p in &removed {
                println!("removed {}", p.display());
            }
            println!("{} removed", removed.len());
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
