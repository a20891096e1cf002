//! `kiln bench …`: each benchmark prints percentiles and a ratio against a raw baseline measured in
//! the same run. Each lives in the module of the area it measures.

mod agent;
mod audit;
mod audit_egress;
mod create;
mod density;
mod idle_cpu;
mod lifecycle;
mod net;
mod rich;
mod side;
mod vmm;

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
    /// Pause, resume, fork and create-from-pool vs raw `runsc checkpoint`/`restore`.
    Lifecycle(lifecycle::Args),
    /// Sandbox networking: create p50 with vs without, proxied vs direct HTTP to a sandbox port.
    Net(net::Args),
    /// Rich templates: create → first run_code, screenshot, CDP connect; image sizes and build
    /// times.
    Rich(rich::Args),
    /// kiln-vmm: process start → first guest instruction, snapshot, restore, VMM RSS.
    Vmm(vmm::Args),
}

pub fn run(cmd: Cmd) -> anyhow::Result<i32> {
    match cmd {
        Cmd::Agent(a) => agent::run(a),
        Cmd::Audit(a) => audit::run(a),
        Cmd::Create(a) => create::run(a),
        Cmd::Density(a) => density::run(a),
        Cmd::Lifecycle(a) => lifecycle::run(a),
        Cmd::Net(a) => net::run(a),
        Cmd::Rich(a) => rich::run(a),
        Cmd::Vmm(a) => vmm::run(a),
    }
}

/// The runsc binary and gVisor platform a bench uses: the given ones, else what `kiln serve`
/// would use on this host (its runsc; the fastest platform that works).
/// Resolves on SIGTERM or SIGINT with the signal's number and name (a bench cleans up, then
/// exits with 128 + the number).
pub(crate) async fn stop_signal() -> (i32, &'static str) {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => (libc::SIGTERM, "SIGTERM"),
        _ = int.recv() => (libc::SIGINT, "SIGINT"),
    }
}

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
