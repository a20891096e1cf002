//! `kiln-vmm`: one process per microVM. See the crate docs of `kiln_vmm` for the boot path and
//! `kiln_vmm::api` for the control protocol.
//!
//! Exit status: 0 when the guest reset itself or the VM was stopped through the API, 2 when the
//! guest shut down abnormally (triple fault), 1 on a VMM error (message on stderr).

#![warn(clippy::undocumented_unsafe_blocks)]

use std::path::PathBuf;

use clap::Parser;
use kiln_vmm::config::{DiskConfig, VmConfig, VsockConfig};
use kiln_vmm::jail::{Bind, JailConfig};
use kiln_vmm::vmm::{BootOptions, RestoreOptions, Vmm};
use kiln_vmm::vstate::vcpu::ExitReason;

#[derive(Parser)]
#[command(name = "kiln-vmm", about = "KVM microVM monitor for kiln", version)]
struct Cli {
    /// ELF vmlinux to boot (PVH entry used when present, else the 64-bit boot protocol).
    #[arg(long)]
    kernel: Option<PathBuf>,
    /// Kernel command line (virtio-mmio devices are appended).
    #[arg(long, default_value = "")]
    cmdline: String,
    /// Guest memory in MiB.
    #[arg(long, default_value_t = 128)]
    mem_mib: u64,
    /// Number of vCPUs.
    #[arg(long, default_value_t = 1)]
    vcpus: u8,
    /// Block device base image (read-only, never written).
    #[arg(long)]
    disk_base: Option<PathBuf>,
    /// Copy-on-write overlay for the block device (per VM; created sparse if missing). For a
    /// restore: this VM's own overlay, initialized from the snapshot's copy.
    #[arg(long)]
    disk_overlay: Option<PathBuf>,
    /// Expose the block device read-only.
    #[arg(long)]
    disk_ro: bool,
    /// Add a vsock device with this guest CID.
    #[arg(long)]
    vsock_cid: Option<u64>,
    /// vsock hybrid Unix socket path (guest->host port P connects to `<path>_P`).
    #[arg(long)]
    vsock_uds: Option<PathBuf>,
    /// Add a virtio-rng device.
    #[arg(long)]
    rng: bool,
    /// Serial console output file (default: stdout).
    #[arg(long)]
    serial_out: Option<PathBuf>,
    /// Control API socket (newline-delimited JSON).
    #[arg(long)]
    api_sock: Option<PathBuf>,
    /// Create vCPUs paused; `{"op":"start"}` on the API runs them.
    #[arg(long)]
    paused: bool,
    /// Restore from this snapshot directory instead of booting.
    #[arg(long)]
    restore: Option<PathBuf>,
    /// Disable the seccomp filters (debugging only).
    #[arg(long)]
    no_seccomp: bool,
    /// Run jailed, with this per-VM directory as the root (see `kiln_vmm::jail`): only the
    /// kernel, the disk images, the directories of the overlay, serial output, API and vsock
    /// sockets, the restore snapshot and `--jail-bind` paths are visible, at their host paths.
    /// Needs root; the VMM then runs as `--jail-uid`/`--jail-gid`, which must be able to write
    /// those directories.
    #[arg(long, requires_all = ["jail_uid", "jail_gid"])]
    jail: Option<PathBuf>,
    /// Unprivileged uid of the jailed VMM.
    #[arg(long, requires = "jail")]
    jail_uid: Option<u32>,
    /// Unprivileged gid of the jailed VMM.
    #[arg(long, requires = "jail")]
    jail_gid: Option<u32>,
    /// Another host directory made writable in the jail (e.g. where snapshots go).
    #[arg(long, requires = "jail")]
    jail_bind: Vec<PathBuf>,
}

impl Cli {
    /// Makes every path absolute (the jail's working directory is its root).
    fn absolute(mut self) -> std::io::Result<Self> {
        fn abs(p: &mut Option<PathBuf>) -> std::io::Result<()> {
            if let Some(x) = p {
                *x = std::path::absolute(&*x)?;
            }
            Ok(())
        }
        for p in [
            &mut self.kernel,
            &mut self.disk_base,
            &mut self.disk_overlay,
            &mut self.vsock_uds,
            &mut self.serial_out,
            &mut self.api_sock,
            &mut self.restore,
            &mut self.jail,
        ] {
            abs(p)?;
        }
        for p in &mut self.jail_bind {
            *p = std::path::absolute(&*p)?;
        }
        Ok(self)
    }

    /// The jail this command line asks for, with the host paths the VM needs.
    fn jail_config(&self) -> Option<JailConfig> {
        let dir = self.jail.clone()?;
        let ro = |p: &Option<PathBuf>| {
            p.clone().map(|path| Bind {
                path,
                writable: false,
            })
        };
        let parent = |p: &Option<PathBuf>| {
            p.as_ref().and_then(|p| p.parent()).map(|d| Bind {
                path: d.to_path_buf(),
                writable: true,
            })
        };
        let mut binds: Vec<Bind> = [
            ro(&self.kernel),
            ro(&self.disk_base),
            ro(&self.restore),
            parent(&self.disk_overlay),
            parent(&self.serial_out),
            parent(&self.api_sock),
            parent(&self.vsock_uds),
        ]
        .into_iter()
        .flatten()
        .collect();
        binds.extend(self.jail_bind.iter().map(|p| Bind {
            path: p.clone(),
            writable: true,
        }));
        Some(JailConfig {
            dir,
            uid: self.jail_uid?,
            gid: self.jail_gid?,
            binds,
        })
    }
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            // Guest-triggered queue errors are logged by virtio-queue at error level; they are
            // counted in the device metrics instead, so a guest cannot flood the log.
            tracing_subscriber::EnvFilter::try_from_env("KILN_VMM_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,virtio_queue=off")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    std::process::exit(match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kiln-vmm: error: {e:#}");
            1
        }
    });
}

fn run(cli: Cli) -> anyhow::Result<i32> {
    let cli = cli.absolute()?;
    if let Some(jail) = cli.jail_config() {
        kiln_vmm::jail::enter(&jail)?;
    }
    let vmm = if let Some(dir) = cli.restore {
        Vmm::restore(RestoreOptions {
            dir,
            serial_out: cli.serial_out,
            api_sock: cli.api_sock,
            overlay: cli.disk_overlay,
            vsock_uds: cli.vsock_uds,
            start_paused: cli.paused,
            seccomp: !cli.no_seccomp,
        })?
    } else {
        let disk = cli.disk_base.map(|base| DiskConfig {
            base,
            overlay: cli.disk_overlay,
            read_only: cli.disk_ro,
        });
        let vsock = match (cli.vsock_cid, cli.vsock_uds) {
            (Some(cid), Some(uds)) => Some(VsockConfig { cid, uds }),
            (None, None) => None,
            _ => anyhow::bail!("--vsock-cid and --vsock-uds go together"),
        };
        let config = VmConfig {
            kernel: cli.kernel,
            cmdline: cli.cmdline,
            mem_mib: cli.mem_mib,
            vcpus: cli.vcpus,
            disk,
            vsock,
            rng: cli.rng,
        };
        Vmm::boot(BootOptions {
            config,
            serial_out: cli.serial_out,
            api_sock: cli.api_sock,
            start_paused: cli.paused,
            seccomp: !cli.no_seccomp,
        })?
    };
    let reason = vmm.run()?;
    eprintln!("kiln-vmm: vm exited: {reason:?}");
    Ok(match reason {
        ExitReason::GuestReset | ExitReason::Stopped => 0,
        ExitReason::GuestShutdown => 2,
        ExitReason::Error(_) => 1,
    })
}
