//! `kiln runtime`: the gVisor runtime (runsc) kiln runs sandboxes with.

use std::path::PathBuf;

use anyhow::Context;
use kiln_host::runsc;

#[derive(clap::Subcommand)]
pub enum Cmd {
    /// Make sure a recent enough runsc is available (downloading it from Debian's
    /// bookworm-backports into kiln's cache when needed); prints its path on stdout.
    Ensure(EnsureArgs),
    /// Show which runsc kiln would use, without downloading anything.
    Show(ShowArgs),
    /// Print the gVisor platform `kiln serve` would use: the fastest that works here (systrap,
    /// kvm only when KVM runs at hardware speed, ptrace).
    Platform(PlatformArgs),
}

#[derive(clap::Args)]
pub struct PlatformArgs {
    /// runsc binary to probe (default: the one kiln resolves).
    #[arg(long, env = runsc::RUNSC_ENV)]
    runsc: Option<PathBuf>,
}

#[derive(clap::Args)]
pub struct EnsureArgs {
    /// Use this runsc binary (any version) instead of finding or fetching one.
    #[arg(long, env = runsc::RUNSC_ENV)]
    runsc: Option<PathBuf>,
    /// Install runsc from this .deb file instead of downloading (offline hosts).
    #[arg(long, conflicts_with = "runsc")]
    deb: Option<PathBuf>,
    /// Debian mirror URI to download from (default: KILN_DEBIAN_MIRROR, else the host's).
    #[arg(long)]
    mirror: Option<String>,
    /// Download and install again even when a suitable runsc is present.
    #[arg(long, conflicts_with_all = ["runsc", "deb"])]
    force: bool,
}

#[derive(clap::Args)]
pub struct ShowArgs {
    /// Print the result as JSON.
    #[arg(long)]
    json: bool,
}

pub fn run(c: Cmd) -> anyhow::Result<i32> {
    match c {
        Cmd::Ensure(a) => {
            let r = if let Some(deb) = &a.deb {
                runsc::fetch::install_deb(deb, &format!("file {}", deb.display()))?
            } else if a.force || a.mirror.is_some() {
                runsc::fetch::download_and_install(a.mirror.clone())?
            } else {
                runsc::ensure(a.runsc.as_deref())?
            };
            eprintln!(
                "kiln: runsc {} ({:?}) at {}",
                r.version,
                r.origin,
                r.path.display()
            );
            println!("{}", r.path.display());
            Ok(0)
        }
        Cmd::Platform(a) => {
            let r = runsc::resolve(a.runsc.as_deref())?;
            let p = runsc::platform::pick(&r.path, runsc::platform::kvm_at_hardware_speed())
                .map_err(|e| {
                    anyhow::anyhow!("no gVisor platform works with {}: {e}", r.path.display())
                })?;
            println!("{p}");
            Ok(0)
        }
        Cmd::Show(a) => {
            let r = runsc::resolve(None).context("no usable runsc")?;
            if a.json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                println!("{} {} ({:?})", r.path.display(), r.version_line, r.origin);
            }
            Ok(0)
        }
    }
}
