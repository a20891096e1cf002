//! `kiln node` and `kiln control`: the cluster roles of the binary (docs/cluster.md). A node
//! is `kiln serve`'s host set-up serving the node-internal API; a control replica serves the
//! E2B API and the gateway over etcd and the nodes.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use kiln_cluster::control::{Control, ControlConfig};
use kiln_cluster::node::{NodeConfig, NodeExit};
use kiln_cluster::{ClusterSecret, EtcdStore};
use kiln_server::LifecycleConfig;

/// Where a cluster's state is.
#[derive(clap::Args)]
pub struct Etcd {
    /// etcd members (comma-separated `http://host:port`).
    #[arg(long, env = "KILN_ETCD", value_delimiter = ',', required = true)]
    etcd: Vec<String>,
    /// The key prefix of the cluster's state in etcd (one prefix is one cluster).
    #[arg(long, env = "KILN_ETCD_PREFIX", default_value = "/kiln")]
    etcd_prefix: String,
}

impl Etcd {
    async fn store(&self) -> anyhow::Result<EtcdStore> {
        EtcdStore::connect(&self.etcd, &self.etcd_prefix)
            .await
            .with_context(|| format!("connecting to etcd at {}", self.etcd.join(",")))
    }
}

/// What both roles need to join a cluster.
#[derive(clap::Args)]
pub struct Join {
    #[command(flatten)]
    etcd: Etcd,
    /// The shared secret control replicas present to nodes (at least 16 characters; never
    /// an API key).
    // An `Option` only so that `kiln node drain`, which needs no secret, parses: the flag is
    // required of the roles.
    #[arg(
        long,
        env = "KILN_CLUSTER_SECRET",
        hide_env_values = true,
        required = true
    )]
    cluster_secret: Option<String>,
}

impl Join {
    fn secret(&self) -> anyhow::Result<ClusterSecret> {
        let given = self.cluster_secret.as_deref().unwrap_or_default();
        ClusterSecret::new(given).with_context(|| {
            format!(
                "--cluster-secret must have at least {} characters",
                ClusterSecret::MIN_LEN
            )
        })
    }

    async fn store(&self) -> anyhow::Result<EtcdStore> {
        self.etcd.store().await
    }
}

#[derive(clap::Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct NodeArgs {
    #[command(subcommand)]
    cmd: Option<NodeCmd>,
    #[command(flatten)]
    join: Join,
    /// This node's name in the cluster (default: the host name).
    #[arg(long, env = "KILN_NODE_NAME")]
    name: Option<String>,
    /// Where control replicas reach this node (`host:port`; default: the listen address).
    #[arg(long, env = "KILN_NODE_ADVERTISE")]
    advertise: Option<String>,
    /// Seconds after its last lease renewal the cluster counts this node lost.
    #[arg(long, default_value_t = 5)]
    lease_ttl: u64,
    /// Run the cluster's template builds (E2B's Template API) on this node: replicas send
    /// them here, and sandboxes of the templates built here run here. One node of a cluster
    /// takes this role (the first by name when several are started with it).
    #[arg(long, env = "KILN_TEMPLATE_BUILDS")]
    template_builds: bool,
    /// Seconds the cluster holds this node's running sandboxes after it is stopped (SIGTERM),
    /// for it to come back on the same state directory (an upgrade, a restart); 0 ends them
    /// at once as a lost node's. A node killed or cut off gets no grace.
    #[arg(long, env = "KILN_RESTART_GRACE", default_value_t = 60)]
    restart_grace: u64,
    /// Where paused sandboxes' checkpoints go, so they resume on any node.
    #[command(flatten)]
    objects: crate::cluster_objects::ObjectArgs,
    /// The host set-up and sandbox settings, as `kiln serve` takes them (`--listen` is the
    /// node-internal API's address).
    #[command(flatten)]
    serve: crate::serve::Args,
}

/// `kiln node drain` and `kiln node undrain`.
#[derive(clap::Subcommand)]
pub enum NodeCmd {
    /// Place no new sandbox on a node (and fork none there); say what stays on it.
    Drain(DrainArgs),
    /// Let a drained node take new sandboxes again.
    Undrain(DrainArgs),
}

#[derive(clap::Args)]
pub struct DrainArgs {
    /// The node's name in the cluster.
    name: String,
    #[command(flatten)]
    etcd: Etcd,
}

/// `kiln node`: exits 0 when stopped, 3 when it fenced itself after losing its lease.
pub fn node(mut a: NodeArgs) -> anyhow::Result<i32> {
    if let Some(cmd) = a.cmd.take() {
        return drain(cmd);
    }
    let secret = a.join.secret()?;
    let p = crate::serve::prepare(&a.serve)?;
    let name = a.name.clone().unwrap_or_else(host_name);
    let max_sandboxes = p.cfg.lifecycle.admission.max_sandboxes.unwrap_or(0) as u32;
    let rules = p.rules().to_string();
    p.rt.block_on(async move {
        let etcd = a.join.store().await?;
        let objects = a.objects.node_objects(&p.cfg.state_dir)?;
        if let Some(o) = &objects {
            crate::cluster_objects::check(o).await?;
            println!(
                "kiln: paused sandboxes' checkpoints go to {}",
                a.objects.describe()
            );
        }
        // Sandboxes trust one interception CA wherever they run: the cluster's, in the
        // state directory before the server loads it.
        let vault = kiln_cluster::cluster_keys::cluster_vault(&etcd, &secret)?;
        kiln_cluster::cluster_keys::adopt_interception_ca(&etcd, &vault, &p.cfg.state_dir)
            .await
            .context("the cluster's interception CA")?;
        // The heads of its audit chains in etcd guard its audit log from the first record.
        let heads = kiln_cluster::node::heads::Heads::new(
            etcd.clone(),
            name.clone(),
            tokio::runtime::Handle::current(),
        );
        let mut setup = p.setup;
        setup.server.audit.guard = Some(kiln_server::audit::guard::Given(Arc::new(heads.clone())));
        let server = setup.prepare(p.templates).await?;
        // The node's rule engine evaluates its sandboxes' chains; replicas read its alerts.
        crate::serve::Prepared::start_rules(&rules, &p.cfg, &server)?;
        let advertise = a
            .advertise
            .clone()
            .unwrap_or_else(|| server.local_addr.to_string());
        println!("kiln: state in {}", p.cfg.state_dir.display());
        let cfg = NodeConfig {
            name,
            advertise,
            secret,
            lease_ttl: Duration::from_secs(a.lease_ttl.max(2)),
            load_every: Duration::from_secs(1),
            max_sandboxes,
            objects,
            templates: Some(
                kiln_template::Store::open_default().context("opening the template store")?,
            ),
            builds: a.template_builds,
            restart_grace: Duration::from_secs(a.restart_grace),
            heads,
        };
        match kiln_cluster::node::run(server, etcd, cfg).await? {
            NodeExit::Stopped => Ok(0),
            NodeExit::Fenced => {
                eprintln!("kiln: the node's cluster lease was lost: its sandboxes were stopped");
                Ok(3)
            }
        }
    })
}

#[derive(clap::Args)]
pub struct ControlArgs {
    #[command(flatten)]
    join: Join,
    /// Address of the API and the gateway. Port 0 picks a free port.
    #[arg(long, env = "KILN_LISTEN", default_value = "127.0.0.1:3000")]
    listen: SocketAddr,
    /// Domain of sandbox host names: `{port}-{sandboxID}.{domain}` is routed to that sandbox.
    #[arg(long, env = "KILN_DOMAIN", default_value = kiln_server::DEFAULT_DOMAIN)]
    domain: String,
    /// This replica's name (default: host name and port).
    #[arg(long)]
    replica: Option<String>,
    /// Default sandbox timeout in seconds.
    #[arg(long, default_value_t = 300)]
    default_timeout: u64,
    /// Largest timeout a client may ask for, in seconds.
    #[arg(long)]
    max_timeout: Option<u64>,
    /// Memory (MiB) a sandbox is counted with when placing it.
    #[arg(long, default_value_t = 512)]
    memory_mb: u32,
    /// Default per-team cap on running and paused sandboxes, cluster-wide.
    #[arg(long)]
    team_max_sandboxes: Option<u32>,
    /// Size (MiB) of each new volume's filesystem on the node that keeps it.
    #[arg(long, env = "KILN_VOLUME_MB", default_value_t = 10240,
          value_parser = clap::value_parser!(u32).range(16..))]
    volume_mb: u32,
    /// Default per-team cap on volumes, cluster-wide (0: no cap); `kiln team set T
    /// --max-volumes N` sets one team's.
    #[arg(long, env = "KILN_TEAM_MAX_VOLUMES",
          default_value_t = kiln_server::manager::DEFAULT_TEAM_MAX_VOLUMES)]
    team_max_volumes: u32,
    /// Seconds the leader of the replicas holds its lease between renewals.
    #[arg(long, default_value_t = 5)]
    leader_ttl: u64,
    /// Leave the paused sandboxes of drained nodes where they are until their next resume
    /// (by default the leading replica moves them to other nodes, one at a time, from object
    /// storage).
    #[arg(long, env = "KILN_NO_DRAIN_MOVES")]
    no_drain_moves: bool,
    /// Record the API calls and envd operations this replica forwards on the audit chains its
    /// nodes keep, and serve their audit routes: on or off (off: nothing is recorded here, and
    /// the audit routes answer 501; the nodes' own records are set by `kiln node --audit`).
    #[arg(long, env = "KILN_AUDIT", default_value = "on", value_parser = ["on", "off"])]
    audit: String,
    /// Let webhooks reach private and loopback addresses (refused by default, as in
    /// `kiln serve`).
    #[arg(long, env = "KILN_WEBHOOK_ALLOW_PRIVATE")]
    webhook_allow_private: bool,
    /// `iss` of workload identity tokens and the issuer OIDC discovery names (default:
    /// http://<listen address>). Give every replica and node (`kiln node --identity-issuer`)
    /// the same URL: the one verifiers reach the cluster's replicas at.
    #[arg(long, env = "KILN_IDENTITY_ISSUER")]
    identity_issuer: Option<String>,
}

/// `kiln control`.
pub fn control(a: ControlArgs) -> anyhow::Result<i32> {
    let secret = a.join.secret()?;
    let rt = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    rt.block_on(async move {
        let etcd = a.join.store().await?;
        let mut lifecycle = LifecycleConfig {
            default_timeout_secs: a.default_timeout,
            max_timeout_secs: a.max_timeout,
            default_memory_mb: a.memory_mb,
            volume_mb: a.volume_mb,
            ..LifecycleConfig::default()
        };
        lifecycle.admission.team_defaults.max_sandboxes = a.team_max_sandboxes;
        lifecycle.admission.team_defaults.max_volumes =
            (a.team_max_volumes > 0).then_some(a.team_max_volumes);
        lifecycle.webhooks.allow_private = a.webhook_allow_private;
        let replica = a
            .replica
            .clone()
            .unwrap_or_else(|| format!("{}:{}", host_name(), a.listen.port()));
        let cfg = ControlConfig {
            listen: a.listen,
            domain: a.domain.clone(),
            replica,
            secret,
            lifecycle,
            edge: kiln_server::edge::EdgeConfig::default(),
            metrics_token: None,
            leader_ttl: Duration::from_secs(a.leader_ttl.max(2)),
            move_drained: !a.no_drain_moves,
            audit: a.audit == "on",
            identity_issuer: a.identity_issuer.clone(),
        };
        let control = Control::prepare(etcd, cfg).await?;
        println!("kiln: control replica listening on http://{}", control.local_addr);
        if let Some(k) = &control.first_key {
            println!("kiln: first API key (shown once, store it now): {}", k.secret);
        }
        println!(
            "kiln: SDK settings: E2B_API_URL=http://{0} E2B_SANDBOX_URL=http://{0} E2B_API_KEY=<key>",
            control.local_addr
        );
        control.serve().await.context("serving")?;
        Ok(0)
    })
}

fn drain(cmd: NodeCmd) -> anyhow::Result<i32> {
    let rt = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    rt.block_on(async move {
        match cmd {
            NodeCmd::Drain(a) => {
                let r = a.etcd.store().await?.drain_node(&a.name).await?;
                let name = &a.name;
                println!(
                    "kiln: node {name} {} draining: it takes no new sandboxes{}",
                    if r.already { "was already" } else { "is now" },
                    if r.live {
                        ""
                    } else {
                        " (it is not registered now)"
                    }
                );
                println!(
                    "kiln: {} running sandbox(es) stay on it until they end: {}",
                    r.running.len(),
                    r.running.join(" ")
                );
                println!(
                    "kiln: {} paused sandbox(es): those whose checkpoint is in object storage \
                     move to other nodes, still paused (one at a time, by the leading control \
                     replica), the others stay and resume on it: {}",
                    r.paused.len(),
                    r.paused.join(" ")
                );
                Ok(0)
            }
            NodeCmd::Undrain(a) => {
                let was = a.etcd.store().await?.undrain_node(&a.name).await?;
                println!(
                    "kiln: node {} {} new sandboxes",
                    a.name,
                    if was {
                        "takes"
                    } else {
                        "was not draining; it takes"
                    }
                );
                Ok(0)
            }
        }
    })
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "kiln".to_string())
}
