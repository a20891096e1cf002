//! `kiln-agent`: the in-sandbox daemon (envd-compatible).

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use kiln_agent::listen::ListenConfig;
use kiln_agent::state::Agent;
use tokio::signal::unix::{signal, SignalKind};

/// kiln-agent: serves the envd API (Connect process/filesystem services, /files, /init, …).
#[derive(Parser, Debug)]
#[command(name = "kiln-agent", version)]
struct Args {
    /// TCP port to listen on (all interfaces).
    #[arg(long, default_value_t = kiln_proto::envd::ENVD_PORT)]
    port: u16,
    /// Do not listen on TCP.
    #[arg(long)]
    no_tcp: bool,
    /// Also listen on this Unix socket (repeatable; a stale socket file is replaced).
    #[arg(long = "listen-unix", value_name = "PATH")]
    listen_unix: Vec<PathBuf>,
    /// Also listen on this vsock port.
    #[arg(long, value_name = "N")]
    vsock_port: Option<u32>,
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(clap::Subcommand, Debug)]
enum Cmd {
    /// Serve the code interpreter API (e2b-code-interpreter's port 49999) instead of envd.
    Interp(InterpArgs),
    /// Serve the computer-use action API of the desktop template (port 49990).
    Computer(ComputerArgs),
    /// Serve Chromium's DevTools on a public port with URLs rewritten to the routed host.
    Cdp(CdpArgs),
}

#[derive(clap::Args, Debug)]
struct ComputerArgs {
    /// Address to listen on.
    #[arg(long, default_value = "0.0.0.0:49990")]
    listen: SocketAddr,
    /// X display to drive (default: $DISPLAY, else :0).
    #[arg(long)]
    display: Option<String>,
    /// Directory for screenshots in flight.
    #[arg(long, default_value = "/tmp/kiln-computer")]
    tmp: PathBuf,
}

#[derive(clap::Args, Debug)]
struct CdpArgs {
    /// Address to listen on.
    #[arg(long, default_value = "0.0.0.0:9222")]
    listen: SocketAddr,
    /// Chromium's own DevTools address (`--remote-debugging-port`).
    #[arg(long, default_value = "127.0.0.1:9223")]
    upstream: SocketAddr,
}

#[derive(clap::Args, Debug)]
struct InterpArgs {
    /// Address to listen on.
    #[arg(long, default_value = "0.0.0.0:49999")]
    listen: SocketAddr,
    /// Python interpreter with ipykernel.
    #[arg(long, default_value = "python3")]
    python: PathBuf,
    /// Node.js, for JavaScript contexts.
    #[arg(long, default_value = "node")]
    node: PathBuf,
    /// Directory for kernel connection files and bash cells.
    #[arg(long, default_value = "/tmp/kiln-interp")]
    runtime_dir: PathBuf,
    /// Working directory of contexts created without one (default: the current directory).
    #[arg(long)]
    cwd: Option<PathBuf>,
    /// Do not start the default Python context before serving.
    #[arg(long)]
    no_warm: bool,
}

/// Runs one service subcommand on a small runtime; its exit code.
fn run_service<F>(name: &str, f: F) -> i32
where
    F: std::future::Future<Output = anyhow::Result<()>>,
{
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kiln-agent {name}: cannot start the async runtime: {e}");
            return 1;
        }
    };
    match rt.block_on(f) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("kiln-agent {name}: {e:#}");
            1
        }
    }
}

fn interp_main(a: InterpArgs) -> i32 {
    let cfg = kiln_agent::interp::ServeConfig {
        addr: a.listen,
        python: a.python,
        node: a.node,
        runtime_dir: a.runtime_dir,
        default_cwd: a
            .cwd
            .or_else(|| std::env::current_dir().ok())
            .unwrap_or_else(|| PathBuf::from("/")),
        warm: !a.no_warm,
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kiln-agent interp: cannot start the async runtime: {e}");
            return 1;
        }
    };
    match rt.block_on(kiln_agent::interp::serve(cfg)) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("kiln-agent interp: {e:#}");
            1
        }
    }
}

fn main() {
    // Templates link /usr/bin/sudo to this binary: run as that shim.
    let argv0 = std::env::args_os().next().and_then(|a| {
        std::path::Path::new(&a)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
    });
    if argv0.as_deref() == Some("sudo") {
        std::process::exit(kiln_agent::sudo::shim::main());
    }
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KILN_AGENT_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .init();
    match args.cmd {
        Some(Cmd::Interp(a)) => std::process::exit(interp_main(a)),
        Some(Cmd::Computer(a)) => {
            let cfg = kiln_agent::computer::ServeConfig {
                addr: a.listen,
                display: a
                    .display
                    .or_else(|| std::env::var("DISPLAY").ok().filter(|d| !d.is_empty()))
                    .unwrap_or_else(|| ":0".into()),
                tmp: a.tmp,
            };
            std::process::exit(run_service("computer", kiln_agent::computer::serve(cfg)))
        }
        Some(Cmd::Cdp(a)) => std::process::exit(run_service(
            "cdp",
            kiln_agent::cdp::serve(a.listen, a.upstream),
        )),
        None => {}
    }
    let pid1 = std::process::id() == 1;
    if pid1 {
        kiln_agent::relief::block_signal();
        kiln_agent::limits::init();
        std::thread::spawn(kiln_agent::relief::run);
        std::thread::spawn(kiln_agent::watchdog::run);
        kiln_agent::pid1::mount_basics();
        kiln_agent::pid1::ensure_etc_hosts();
        kiln_agent::pid1::ensure_machine_id();
        if let Err(e) = kiln_agent::sudo::broker::start() {
            tracing::warn!("sudo will not work: cannot start the privilege broker: {e}");
        }
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(64)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kiln-agent: cannot start the async runtime: {e}");
            std::process::exit(1);
        }
    };
    // As root, before any request runs with a user's filesystem identity.
    kiln_agent::metastore::store().load();
    let code = rt.block_on(async move {
        tokio::spawn(kiln_agent::reaper::run());
        let agent = Agent::new();
        let cfg = ListenConfig {
            tcp: if args.no_tcp {
                None
            } else {
                Some(SocketAddr::from((Ipv4Addr::UNSPECIFIED, args.port)))
            },
            unix: args.listen_unix.clone(),
            vsock_port: args.vsock_port,
        };
        let a2 = agent.clone();
        let shutdown = async move {
            let (Ok(mut term), Ok(mut int)) = (
                signal(SignalKind::terminate()),
                signal(SignalKind::interrupt()),
            ) else {
                std::future::pending::<()>().await;
                return;
            };
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            tracing::info!("shutting down: terminating children");
            for pid in a2.procs.pids() {
                // SAFETY: signalling a child we started.
                unsafe { libc::kill(pid as i32, libc::SIGTERM) };
            }
            if pid1 {
                kiln_agent::pid1::signal_all(libc::SIGTERM);
            }
            let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
            while !a2.procs.pids().is_empty() && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            for pid in a2.procs.pids() {
                // SAFETY: signalling a child we started.
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            }
            if pid1 {
                kiln_agent::pid1::signal_all(libc::SIGKILL);
                kiln_agent::reaper::reap_all();
            }
        };
        match kiln_agent::listen::run(agent, cfg, shutdown).await {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("kiln-agent: {e:#}");
                1
            }
        }
    });
    if pid1 {
        nix::unistd::sync();
    }
    std::process::exit(code);
}
