//! `kiln bench …`: each benchmark prints percentiles and a ratio against a raw baseline measured in
//! the same run. Each lives in the module of the area it measures.

mod agent;
mod audit;
mod audit_egress;
mod create;
mod create_bench;
mod density;
mod exec;
mod idle_cpu;
mod lifecycle;
mod lifecycle_bench;
mod net;
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
mod tti_raw;
mod tti_stats;
mod vmm;
mod volume;

#[derive(clap::Subcommand)]
pub enum Cmd {
    /// kiln-agent: exec round trip and file transfer throughput on loopback, idle RSS.
    Agent(agent::Args),
    /// The audit log's cost: exec round trip and a large upload with auditing on vs off.
    Audit(audit::Args),
    /// Sandbox create → first `echo` output, sequential and concurrent, vs raw `runsc run`.
    Create(create::Args),
    /// Idle sandboxes per host in steps: MiB and threads per sandbox, create and exec latency,
    /// CPU idle; then restart time and kill throughput.
    Density(density::Args),
    /// A command's cost inside a sandbox vs raw `runsc run`: fork+exec, python start, login
    /// shell, `commands.run("true")` round trip, kill.
    Exec(exec::Args),
    /// Pause, resume, fork and create-from-pool vs raw `runsc checkpoint`/`restore`.
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
    /// plus exec round trip, resume, fork and idle MiB, each beside raw runsc.
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

/// The runsc binary and gVisor platform a bench uses: the given ones, else what `kiln serve`
/// would use on this host (its runsc; the fastest platform that works).
pub(crate) fn runtime(
    runsc: Option<&std::path::Path>,
    platform: Option<String>,
) -> anyhow::Result<(std::path::PathBuf, String)> {
    let runsc = kiln_host::runsc::resolve(runsc)?;
    let platform = match platform {
        Some(p) => p,
        None => kiln_host::runsc::platform::pick(
            &runsc.path,
            kiln_host::runsc::platform::kvm_at_hardware_speed(),
        )
        .map_err(|e| anyhow::anyhow!("no gVisor platform works: {e}"))?,
    };
    Ok((runsc.path, platform))
}

/// What a bench that runs kiln's own server needs: the template store, a fresh work dir named
/// `<prefix>XXXX` under `work_dir` (default `<state>/bench`; short names: agent socket paths
/// under it must fit in 108 bytes), and gVisor driver settings for the runtime the bench uses.
pub(crate) struct ServerBench {
    pub templates: std::sync::Arc<dyn kiln_server::templates::Templates>,
    pub work: tempfile::TempDir,
    pub driver: crate::drivers::DriverConfig,
    pub platform: String,
}

pub(crate) fn server_bench(
    work_dir: Option<&std::path::Path>,
    prefix: &str,
    runsc: Option<&std::path::Path>,
    platform: Option<String>,
) -> anyhow::Result<ServerBench> {
    use anyhow::Context;
    let store = kiln_template::Store::open_default().context("opening the template store")?;
    let (runsc, platform) = runtime(runsc, platform)?;
    let base = work_dir
        .map(std::path::Path::to_path_buf)
        .unwrap_or_else(|| kiln_host::paths::state_dir().join("bench"));
    std::fs::create_dir_all(&base).with_context(|| format!("creating {}", base.display()))?;
    let work = tempfile::Builder::new()
        .prefix(prefix)
        .rand_bytes(4)
        .tempdir_in(&base)?;
    let mut driver = crate::drivers::DriverConfig {
        kind: crate::drivers::DriverKind::Gvisor,
        ..Default::default()
    };
    driver.gvisor.runsc = Some(runsc);
    driver.gvisor.platform = Some(platform.clone());
    Ok(ServerBench {
        templates: std::sync::Arc::new(store),
        work,
        driver,
        platform,
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
