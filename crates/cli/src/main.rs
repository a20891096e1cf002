//! `kiln`: one binary for the server (`kiln serve`) and every client subcommand.
//!
//! Each subcommand lives in its own module and is a thin layer over a library crate:
//! `serve`/`keys` → kiln-server, `sandbox` → the REST client (`client.rs`) and kiln-envd through
//! the server's proxy, `doctor`/`runtime` → kiln-host, `template` → kiln-template, `bench` → the
//! crate whose speed it measures.

mod audit;
mod bench;
mod client;
mod cluster;
mod cluster_objects;
mod completions;
mod dockerfile;
mod doctor;
mod drivers;
mod keys;
mod mcp;
mod observe;
mod rules;
mod runtime;
mod sandbox;
mod sandbox_info;
mod secrets;
mod serve;
mod serve_net;
mod shell;
mod team;
mod template;
mod template_remote;
mod term;
mod top;
mod volumes;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "kiln",
    version,
    about = "Disposable, isolated Linux sandboxes for AI agents, E2B-compatible"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the kiln server (REST API + sandbox proxy), preparing the host and base template first.
    Serve(Box<serve::Args>),
    /// Run sandboxes for a cluster: this host's server, registered in etcd, serving the
    /// node-internal API to control replicas (docs/cluster.md).
    Node(Box<cluster::NodeArgs>),
    /// Serve a cluster's E2B API and gateway over etcd and its nodes (a stateless replica).
    Control(Box<cluster::ControlArgs>),
    /// Tell what this host can do (KVM speed, runsc, cgroups, nftables …) and which driver kiln will use.
    Doctor(doctor::Args),
    /// Build and inspect sandbox templates.
    #[command(subcommand)]
    Template(template::Cmd),
    /// Manage sandboxes through a running kiln server.
    #[command(subcommand)]
    Sandbox(sandbox::Cmd),
    /// Manage API keys (through a server's API with an API key, else on the state directly).
    #[command(subcommand)]
    Keys(keys::Cmd),
    /// Lifecycle events of a running kiln server's sandboxes (`--follow` to keep watching).
    Events(observe::EventsArgs),
    /// Manage webhooks (signed lifecycle event deliveries) of a running kiln server.
    #[command(subcommand)]
    Webhooks(observe::WebhookCmd),
    /// Teams and their quotas (works on the server's state directly).
    #[command(subcommand)]
    Team(team::Cmd),
    /// The gVisor runtime (runsc): find, verify or download the version kiln needs.
    #[command(subcommand)]
    Runtime(runtime::Cmd),
    /// A sandbox's audit record (processes, files, connections, lifecycle, API calls), or
    /// `verify [ID]` to check the hash chains.
    Audit(audit::Args),
    /// Benchmarks: percentiles and ratios against a raw baseline measured in the same run.
    #[command(subcommand)]
    Bench(bench::Cmd),
    /// Alerts raised by a running kiln server's rules (`--follow` to keep watching).
    Alerts(rules::AlertsArgs),
    /// Anomaly-detection rules files: `check FILE` (errors at line:column), `default`.
    #[command(subcommand)]
    Rules(rules::Cmd),
    /// Secrets of the caller's team on a running kiln server (values are write-only).
    #[command(subcommand)]
    Secrets(secrets::Cmd),
    /// Volumes of the caller's team on a running kiln server (storage that outlives sandboxes).
    #[command(subcommand)]
    Volumes(volumes::Cmd),
    /// A live table of the sandboxes of a running server: state, CPU, memory, disk, age.
    Top(top::Args),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completions(completions::CompletionArgs),
    /// Print kiln's man page (roff), or write one page per subcommand with `--dir`.
    Man(completions::ManArgs),
    /// MCP server (stdio, or streamable HTTP with `--http`) exposing sandboxes as tools.
    Mcp(mcp::Args),
}

fn init_tracing() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("KILN_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

fn main() {
    let cli = Cli::parse();
    init_tracing();
    let result = match cli.cmd {
        Cmd::Serve(a) => serve::run(*a),
        Cmd::Node(a) => cluster::node(*a),
        Cmd::Control(a) => cluster::control(*a),
        Cmd::Doctor(a) => doctor::run(a),
        Cmd::Template(c) => template::run(c),
        Cmd::Sandbox(c) => sandbox::run(c),
        Cmd::Keys(c) => keys::run(c),
        Cmd::Events(a) => observe::events(a),
        Cmd::Webhooks(c) => observe::webhooks(c),
        Cmd::Team(c) => team::run(c),
        Cmd::Runtime(c) => runtime::run(c),
        Cmd::Bench(c) => bench::run(c),
        Cmd::Audit(a) => audit::run(a),
        Cmd::Alerts(a) => rules::alerts(a),
        Cmd::Rules(c) => rules::run(c),
        Cmd::Secrets(c) => secrets::run(c),
        Cmd::Volumes(c) => volumes::run(c),
        Cmd::Top(a) => top::run(a),
        Cmd::Completions(a) => completions::completions(a),
        Cmd::Man(a) => completions::man(a),
        Cmd::Mcp(a) => mcp::run(a),
    };
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("kiln: error: {e:#}");
            std::process::exit(1);
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn command_line_is_well_formed() {
        use clap::CommandFactory;
        super::Cli::command().debug_assert();
    }
}
