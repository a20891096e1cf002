//! `kiln bench …`: each benchmark prints percentiles and a ratio against a raw baseline measured in
//! the same run. Each lives in the module of the area it measures.

mod agent;
mod audit;
mod audit_egress;
mod cluster;
mod cluster_gateway;
mod cluster_place;
mod cluster_proc;
mod cluster_resume;
mod create;
mod create_bench;
mod density;
mod density_active;
mod density_end;
mod density_host;
mod density_standby;
mod exec;
mod idle_cpu;
mod lifecycle;
mod lifecycle_bench;
mod net;
mod net_rules;
mod rich;
mod rules;
mod rules_live;
mod served;
mod side;
mod stale;
mod stats;
mod template_api;
mod template_bench;
mod tti;
mod tti_stats;
mod vmm;
mod volume;

#[derive(clap::Subcommand)]
pub enum Cmd {
    /// kiln-agent: exec round trip and file transfer throughput on loopback, idle RSS.
    Agent(agent::Args),
    /// The audit log's cost: exec round trip and a large upload with auditing on vs off.
    Audit(audit::Args),
    /// A cluster: placement decision with 10,000 simulated sandboxes on 50 simulated nodes,
    /// create and exec through a control replica vs straight on the node.
    Cluster(cluster::Args),
    /// Sandbox create → first `echo` output, sequential and concurrent, vs the runtime's raw run.
    Create(create::Args),
    /// Idle sandboxes per host in steps: MiB and threads per sandbox, create and exec latency,
    /// CPU idle; with --active, an exec loop against the same loop with 20 alive; with
    /// --standby-after, what a sandbox in standby keeps and wake vs raw restore; then restart
    /// time and kill throughput.
    Density(density::Args),
    /// A command's cost inside a sandbox vs the runtime's raw run: fork+exec, python start, login
    /// shell, `commands.run("true")` round trip, kill.
    Exec(exec::Args),
    /// Pause, resume, fork and create-from-pool vs the runtime's raw checkpoint/restore.
    Lifecycle(lifecycle::Args),
    /// Sandbox networking: create p50 with vs without, proxied vs direct HTTP to a sandbox port.
    Net(net::Args),
    /// Rich templates: create → first run_code, screenshot, CDP connect; image sizes and build
    /// times.
    Rich(rich::Args),
    /// kiln-vmm: process start → first guest instruction, snapshot, restore, VMM RSS.
    Vmm(vmm::Args),
    /// The rule engine: audit records per second through the built-in pack on one core; attack
    /// → alert latency and exec round trip with the pack on vs off, with sandboxes.
    Rules(rules::Args),
    /// Template API builds: cold build, rebuild of a changed last step, create from a template
    /// that starts running, and pulling an image from a loopback registry, each beside raw.
    Template(template_bench::Args),
    /// ComputeSDK's time-to-interactive through the e2b SDK (sequential, staggered, burst),
    /// plus exec round trip, resume, fork and idle MiB, each beside the raw runtime.
    Tti(tti::Args),
    /// Volumes: read and write MB/s on a mounted volume vs the sandbox's own disk.
    Volume(volume::Args),
}

pub fn run(cmd: Cmd) -> anyhow::Result<i32> {
    let removed = stale::sweep(&kiln_host::paths::state_dir().join("bench"));
    if removed > 0 {
        println!("removed {removed} leftover(s) of interrupted benches");
    }
    match cmd {
        Cmd::Agent(a) => agent::run(a),
        Cmd::Rules(a) => rules::run(a),
        Cmd::Audit(a) => audit::run(a),
        Cmd::Cluster(a) => cluster::run(a),
        Cmd::Create(a) => create::run(a),
        Cmd::Density(a) => density::run(a),
        Cmd::Exec(a) => exec::run(a),
        Cmd::Lifecycle(a) => lifecycle::run(a),
        Cmd::Net(a) => net::run(a),
        Cmd::Rich(a) => rich::run(a),
        Cmd::Vmm(a) => vmm::run(a),
        Cmd::Template(a) => template_bench::run(a),
        Cmd::Tti(a) => tti::run(a),
        Cmd::Volume(a) => volume::run(a),
    }
}

/// The runtime and work directory every bench takes (the runtime's flags, `--work-dir`).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct RuntimeArgs {
    #[command(flatten)]
    pub runtime: crate::drivers::RuntimeFlags,
    /// Directory for the bench's temporary state (default: the kiln state dir).
    #[arg(long)]
    pub work_dir: Option<std::path::PathBuf>,
}

impl RuntimeArgs {
    /// The runtime the bench runs on (see [`crate::drivers::RuntimeFlags::resolve`]).
    pub fn resolve(&self) -> anyhow::Result<crate::drivers::BenchRuntime> {
        self.runtime.resolve()
    }

    /// The directory the bench's work directories go in (created): `--work-dir`, else
    /// `<state>/bench`.
    pub fn work_root(&self) -> anyhow::Result<std::path::PathBuf> {
        use anyhow::Context;
        let base = self
            .work_dir
            .clone()
            .unwrap_or_else(|| kiln_host::paths::state_dir().join("bench"));
        std::fs::create_dir_all(&base).with_context(|| format!("creating {}", base.display()))?;
        Ok(base)
    }

    /// A fresh work directory `<prefix>XXXX` in [`Self::work_root`] (short names: agent socket
    /// paths under it must fit in 108 bytes).
    pub fn work(&self, prefix: &str) -> anyhow::Result<tempfile::TempDir> {
        Ok(tempfile::Builder::new()
            .prefix(prefix)
            .rand_bytes(4)
            .tempdir_in(self.work_root()?)?)
    }
}

/// What a bench that runs kiln's own server needs: the template store, a fresh work dir named
/// `<prefix>XXXX` (see [`RuntimeArgs::work`]), the runtime, and the driver settings for it.
pub(crate) struct ServerBench {
    pub templates: std::sync::Arc<dyn kiln_server::templates::Templates>,
    pub work: tempfile::TempDir,
    pub driver: crate::drivers::DriverConfig,
    pub runtime: crate::drivers::BenchRuntime,
}

pub(crate) fn server_bench(args: &RuntimeArgs, prefix: &str) -> anyhow::Result<ServerBench> {
    use anyhow::Context;
    let store = kiln_template::Store::open_default().context("opening the template store")?;
    let runtime = args.resolve()?;
    Ok(ServerBench {
        templates: std::sync::Arc::new(store),
        work: args.work(prefix)?,
        driver: runtime.driver_config(),
        runtime,
    })
}

/// The configuration of a bench's server with its state in `dir`: `driver`, `audit`, an
/// ephemeral loopback port, admission measuring `dir`'s disk, defaults otherwise.
pub(crate) fn server_config(
    dir: &std::path::Path,
    driver: crate::drivers::DriverConfig,
    audit: kiln_server::audit::AuditConfig,
) -> anyhow::Result<crate::drivers::ServerSetup> {
    let server = kiln_server::ServerConfig {
        listen: "127.0.0.1:0".parse()?,
        domain: kiln_server::DEFAULT_DOMAIN.into(),
        state_dir: dir.to_path_buf(),
        lifecycle: kiln_server::LifecycleConfig {
            admission: kiln_server::manager::AdmissionConfig {
                state_dir: Some(dir.to_path_buf()),
                ..Default::default()
            },
            ..Default::default()
        },
        metrics_token: None,
        edge: Default::default(),
        audit,
        identity_issuer: None,
        host_ca_dir: None,
        template_builds: Default::default(),
    };
    Ok(crate::drivers::ServerSetup { server, driver })
}
