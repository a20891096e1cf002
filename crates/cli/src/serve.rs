//! `kiln serve`: prepares the host (runsc, packages) and the base template, then runs the kiln
//! server.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use kiln_host::runsc::{self, platform};
use kiln_server::templates::{self, Templates};
use kiln_server::{LifecycleConfig, Server, ServerConfig};

use crate::drivers::{DriverConfig, DriverKind, ServerSetup};

#[derive(clap::Args)]
pub struct Args {
    /// Address to listen on (API and sandbox traffic share it). Port 0 picks a free port.
    #[arg(long, env = "KILN_LISTEN", default_value = "127.0.0.1:3000")]
    listen: SocketAddr,
    /// Domain of sandbox host names: `{port}-{sandboxID}.{domain}` is routed to that sandbox.
    #[arg(long, env = "KILN_DOMAIN", default_value = kiln_server::DEFAULT_DOMAIN)]
    domain: String,
    /// TLS certificate chain (PEM, leaf first) of the listener: clients that start a TLS
    /// handshake get TLS (ALPN h2/http1.1), others plain HTTP on the same port. With a
    /// certificate for `<domain>` and `*.<domain>` and those names resolving to this server on
    /// port 443, the e2b SDK needs only E2B_DOMAIN. Needs --tls-key.
    #[arg(long, env = "KILN_TLS_CERT", value_name = "PEM", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// Private key (PEM: PKCS#8, PKCS#1 or SEC1) of --tls-cert.
    #[arg(long, env = "KILN_TLS_KEY", value_name = "PEM", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// State directory (database, sandbox layers). Default: KILN_STATE_DIR or /var/lib/kiln/state.
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// `iss` of the workload identity tokens sandboxes' network rules inject (`iam.tokens`),
    /// the URL upstreams find `/.well-known/jwks.json` under. Default: `https://api.<domain>`
    /// with --tls-cert, else `http://<listen address>`.
    #[arg(long, env = "KILN_IDENTITY_ISSUER", value_name = "URL")]
    identity_issuer: Option<String>,
    /// Trust the host's extra CA certificates (the `*.crt` files of --host-ca-dir) inside
    /// every sandbox, so sandboxes work behind the same TLS-inspecting proxy as the host.
    #[arg(long, env = "KILN_HOST_CAS", default_value = "on", value_parser = ["on", "off"])]
    host_cas: String,
    /// Where the host's extra CA certificates are.
    #[arg(long, env = "KILN_HOST_CA_DIR", value_name = "DIR",
          default_value = kiln_server::api::host_trust::DEFAULT_DIR)]
    host_ca_dir: PathBuf,
    /// Isolation driver: gvisor, microvm, or auto (what `kiln doctor` recommends here).
    #[arg(long, env = "KILN_DRIVER", default_value = "auto")]
    driver: DriverKind,
    /// gVisor platform (systrap, kvm, ptrace). Default: the fastest that works here, as
    /// `kiln doctor` reports it.
    #[arg(long, env = "KILN_PLATFORM")]
    platform: Option<String>,
    /// runsc binary to use (any version). Default: the one kiln installed, else the host's when
    /// recent enough, else downloaded from Debian bookworm-backports (see `kiln runtime`).
    #[arg(long, env = kiln_host::runsc::RUNSC_ENV)]
    runsc: Option<PathBuf>,
    /// gVisor: do not configure cgroups (only for hosts where runsc cannot manage them).
    #[arg(long)]
    ignore_cgroups: bool,
    /// gVisor: timer slack (milliseconds) of each sandbox's host tasks. An idle systrap sandbox
    /// wakes ≈1,000 times a second; a slack of 20 cuts its idle host CPU ≈4×, but any timer
    /// inside (a `sleep 0.001`) may fire that much late. Default: the kernel's (50 µs).
    #[arg(long, env = "KILN_SENTRY_TIMER_SLACK_MS")]
    sentry_timer_slack_ms: Option<f64>,
    /// gVisor: timer slack (milliseconds) of the host tasks of a sandbox hinted idle (see
    /// --idle-hint-after).
    #[arg(long, env = "KILN_IDLE_TIMER_SLACK_MS", default_value_t = 50.0)]
    idle_timer_slack_ms: f64,
    /// gVisor: a sandbox still hinted idle this long after its hint (parked rather than
    /// waiting for an agent's next step) gets --deep-idle-timer-slack-ms instead: `off`, or
    /// e.g. `2m` (docs/density.md).
    #[arg(
        long,
        env = "KILN_DEEP_IDLE_AFTER",
        default_value = "2m",
        value_name = "DURATION"
    )]
    deep_idle_after: String,
    /// gVisor: timer slack (milliseconds) of the host tasks of a sandbox idle long (see
    /// --deep-idle-after).
    #[arg(long, env = "KILN_DEEP_IDLE_TIMER_SLACK_MS", default_value_t = 500.0)]
    deep_idle_timer_slack_ms: f64,
    /// Timeout (seconds) of sandboxes whose create request names none.
    #[arg(long, default_value_t = 300)]
    default_timeout: u64,
    /// Refuse timeouts above this many seconds (default: no cap).
    #[arg(long)]
    max_timeout: Option<u64>,
    /// vCPUs of each sandbox.
    #[arg(long, default_value_t = 2)]
    cpus: u32,
    /// Memory limit of each sandbox, MiB.
    #[arg(long, default_value_t = 512)]
    memory_mb: u32,
    /// Process limit of each sandbox; each command in it may use all but 32 of them (a fork
    /// bomb gets EAGAIN while the agent and other commands go on).
    #[arg(long, default_value_t = 4096)]
    pids_limit: u32,
    /// Writable disk of each sandbox, MiB (a template's `disk_mb` overrides it): writes beyond
    /// it get ENOSPC inside the sandbox. 0: unbounded.
    #[arg(long, default_value_t = 2048)]
    disk_mb: u32,
    /// Size of each new volume, MiB (a sparse ext4 image: writes beyond it get ENOSPC inside
    /// the sandboxes that mount it and 507 from the volume-content API).
    #[arg(long, default_value_t = 10240, value_parser = clap::value_parser!(u32).range(16..))]
    volume_mb: u32,
    /// Most volumes one team may hold (`kiln team set T --max-volumes N` overrides it for a
    /// team): creating one more answers 429. 0: no cap.
    #[arg(long, env = "KILN_TEAM_MAX_VOLUMES",
          default_value_t = kiln_server::manager::DEFAULT_TEAM_MAX_VOLUMES)]
    team_max_volumes: u32,
    /// At most this many sandboxes at once; further creates get 429 with Retry-After
    /// (default: as many as the host's capacity allows — those get 503).
    #[arg(long, env = "KILN_MAX_SANDBOXES")]
    max_sandboxes: Option<usize>,
    /// Default per-team quota: sandboxes a team may have at once (429 beyond; `kiln team set`
    /// overrides it per team).
    #[arg(long, env = "KILN_TEAM_MAX_SANDBOXES")]
    team_max_sandboxes: Option<u32>,
    /// Default per-team quota: largest timeout, seconds (400 beyond).
    #[arg(long, env = "KILN_TEAM_MAX_TIMEOUT")]
    team_max_timeout: Option<u64>,
    /// Default per-team quota: creates per minute (429 with Retry-After beyond).
    #[arg(long, env = "KILN_TEAM_CREATES_PER_MINUTE")]
    team_creates_per_minute: Option<u32>,
    /// Open client connections at most; further ones get 503 and are closed.
    #[arg(long, env = "KILN_MAX_CONNECTIONS", default_value_t = 4096)]
    max_connections: usize,
    /// Seconds a client has to send a request's headers; idle keep-alive connections are
    /// closed after as long.
    #[arg(long, env = "KILN_HEADER_TIMEOUT", default_value_t = 30)]
    header_timeout: u64,
    /// Skip installing host packages and building the base template.
    #[arg(long)]
    no_prepare: bool,
    /// Bearer token of the Prometheus endpoint `GET /metrics` (without one it is off).
    #[arg(long, env = "KILN_METRICS_TOKEN", hide_env_values = true)]
    metrics_token: Option<String>,
    /// A running sandbox nobody used for this long (no API or proxied traffic, its runtime's
    /// host CPU quiet) is checkpointed with its memory to disk and woken by its next traffic,
    /// staying `running` to clients: `off`, or e.g. `30s`, `5m` (docs/standby.md). Per
    /// sandbox, metadata `kiln.standby=off` opts out.
    #[arg(
        long,
        env = "KILN_STANDBY_AFTER",
        default_value = "off",
        value_name = "DURATION"
    )]
    standby_after: String,
    /// A running sandbox unused this long whose runtime is quiet is hinted idle to its driver
    /// (gVisor: --idle-timer-slack-ms of timer slack on its host tasks, taken back before its
    /// first use goes on): `off`, or e.g. `30s` (docs/density.md). Per sandbox, metadata
    /// `kiln.standby=off` opts out.
    #[arg(
        long,
        env = "KILN_IDLE_HINT_AFTER",
        default_value = "30s",
        value_name = "DURATION"
    )]
    idle_hint_after: String,
    /// Seconds between two metrics samples of each running sandbox.
    #[arg(long, env = "KILN_METRICS_INTERVAL", default_value_t = 5.0)]
    metrics_interval: f64,
    /// Seconds before a failed webhook delivery is retried (doubling on each retry).
    #[arg(long, env = "KILN_WEBHOOK_RETRY_BASE", default_value_t = 2.0)]
    webhook_retry_base: f64,
    /// Allow webhooks to loopback, link-local, private and sandbox addresses (refused by
    /// default: a webhook must not be a way into the host's or the sandboxes' networks).
    #[arg(long, env = "KILN_WEBHOOK_ALLOW_PRIVATE")]
    webhook_allow_private: bool,
    /// Warm pool: keep exactly N booted sandboxes of TEMPLATE ready, whatever the demand
    /// (repeatable; other templates keep their adaptive pool).
    #[arg(long = "pool", value_name = "TEMPLATE=N", value_parser = kiln_server::manager::parse_pool)]
    pools: Vec<(String, u32)>,
    /// No warm pools: every create boots its sandbox (by default each used template keeps a
    /// pool sized from its recent demand).
    #[arg(long, env = "KILN_POOL_OFF", conflicts_with = "pools")]
    pool_off: bool,
    /// An adaptive pool holds at most this many sandboxes of one template.
    #[arg(long, env = "KILN_POOL_MAX", default_value_t = 100)]
    pool_max: u32,
    /// Seconds over which a template's demand is measured: a pool shrinks to one sandbox
    /// after this long without a burst.
    #[arg(long, env = "KILN_POOL_IDLE", default_value_t = 120.0)]
    pool_idle: f64,
    /// Seconds a create waits for a pooled sandbox or a boot slot before a 503 with
    /// Retry-After (half the SDK's 60 s request timeout: the boot that follows needs time too).
    #[arg(long, env = "KILN_CREATE_QUEUE", default_value_t = 30.0)]
    create_queue: f64,
    /// The audit log of every sandbox's processes, file operations, connections, lifecycle
    /// and API calls: on or off.
    #[arg(long, env = "KILN_AUDIT", default_value = "on", value_parser = ["on", "off"])]
    audit: String,
    /// Audit retention: drop records older than this many hours (default: keep).
    #[arg(long, env = "KILN_AUDIT_MAX_AGE_HOURS")]
    audit_max_age_hours: Option<u64>,
    /// Audit retention: keep at most this many records, dropping the oldest (default: keep).
    #[arg(long, env = "KILN_AUDIT_MAX_RECORDS")]
    audit_max_records: Option<u64>,
    /// Anomaly-detection rules evaluated on the audit stream: `builtin` (the built-in pack),
    /// a rules file (reloaded when it changes or on SIGHUP), or `off` (docs/rules.md).
    #[arg(
        long,
        env = "KILN_RULES",
        default_value = "builtin",
        value_name = "FILE|builtin|off"
    )]
    rules: String,
    /// Pull a registry's images from a mirror in Template API builds (`fromImage`):
    /// `REGISTRY=URL` (e.g. `docker.io=http://127.0.0.1:5000`); repeatable; adds to
    /// $KILN_REGISTRY_MIRRORS (comma-separated), as `kiln template build --from-image` does.
    #[arg(long = "registry-mirror", value_name = "REGISTRY=URL")]
    registry_mirrors: Vec<String>,
    /// How often built templates are collected by themselves (as `kiln template gc` does with
    /// its defaults: never a version a sandbox, snapshot or running build uses), with the
    /// uploaded COPY archives nothing names: e.g. `1h`, `10m`, or `off`.
    #[arg(
        long,
        env = "KILN_TEMPLATE_GC_INTERVAL",
        default_value = "1h",
        value_name = "DURATION"
    )]
    template_gc_interval: String,
    /// Uploaded COPY archives younger than this (since uploaded or last reported present to
    /// a client) are never collected.
    #[arg(
        long,
        env = "KILN_TEMPLATE_FILES_GRACE",
        default_value = "1h",
        value_name = "DURATION"
    )]
    template_files_grace: String,
    /// How long a sandbox of a built template's last step's parent layer stands ready for the
    /// template's next build (a rebuild that changed the last step starts it at once), e.g.
    /// `10m`, or `off`. Hidden, outside the team's quota; one per template, two at most, and
    /// only while the server has room for it and one sandbox more.
    #[arg(
        long,
        env = "KILN_TEMPLATE_STANDING",
        default_value = "10m",
        value_name = "DURATION"
    )]
    template_standing: String,
    /// Whether the automatic collection also removes the template store's old versions and
    /// unused image layers (`kiln template gc` without `--built`, keeping one older version).
    #[arg(long, env = "KILN_TEMPLATE_GC_STORE", default_value = "on", value_parser = ["on", "off"])]
    template_gc_store: String,
    /// Extra template made of a bare rootfs directory, NAME=DIR (repeatable; for tests).
    #[arg(long = "template-dir", value_name = "NAME=DIR")]
    template_dirs: Vec<String>,
    #[command(flatten)]
    net: crate::serve_net::NetArgs,
}

fn template_source(a: &Args) -> anyhow::Result<Arc<dyn Templates>> {
    let store = kiln_template::Store::open_default().context("opening the template store")?;
    let mut extra = Vec::new();
    for spec in &a.template_dirs {
        let (name, dir) = spec
            .split_once('=')
            .with_context(|| format!("--template-dir {spec:?}: expected NAME=DIR"))?;
        extra.push(templates::from_dir(name, &PathBuf::from(dir)));
    }
    Ok(Arc::new(templates::Chain(
        store,
        templates::FixedTemplates(extra),
    )))
}

/// Raises host limits that are merely defaults (kernel.pid_max), saying so.
fn raise_host_limits() {
    match kiln_host::capacity::raise_pid_max() {
        Ok(Some(old)) => println!(
            "kiln: raised kernel.pid_max from {old} to {} (gVisor sandboxes hold tens of host \
             threads each)",
            kiln_host::capacity::PID_MAX_TARGET
        ),
        Ok(None) => {}
        Err(msg) => eprintln!("kiln: warning: {msg}"),
    }
}

/// A host ready to run a server: the runtime, the server's settings, the driver's, the
/// templates (what `kiln serve` and `kiln node` share).
pub struct Prepared {
    pub rt: tokio::runtime::Runtime,
    pub cfg: ServerConfig,
    pub setup: ServerSetup,
    pub templates: Arc<dyn Templates>,
    rules: String,
}

impl Prepared {
    /// Starts anomaly detection on `server` as `--rules` says (it reads the audit log).
    pub fn start_rules(rules: &str, cfg: &ServerConfig, server: &Server) -> anyhow::Result<()> {
        let Some(src) = kiln_server::alerts::RulesSource::parse(rules) else {
            return Ok(());
        };
        if cfg.audit.enabled {
            let st = server.start_alerts(src)?;
            println!(
                "kiln: anomaly detection: {} rules ({:?})",
                st.rules, st.source
            );
        } else if rules != "builtin" {
            anyhow::bail!("--rules {rules} needs the audit log (--audit on)");
        } else {
            println!("kiln: anomaly detection off (it reads the audit log, which is off)");
        }
        Ok(())
    }

    /// The `--rules` setting.
    pub fn rules(&self) -> &str {
        &self.rules
    }
}

pub fn run(a: Args) -> anyhow::Result<i32> {
    let Prepared {
        rt,
        cfg,
        setup,
        templates,
        rules,
    } = prepare(&a)?;
    serve(rt, cfg, setup, templates, rules)
}

/// Prepares the host (unless `--no-prepare`) and reads the server's settings from `a`.
pub fn prepare(a: &Args) -> anyhow::Result<Prepared> {
    raise_host_limits();
    if a.no_prepare && a.disk_mb > 0 {
        // Without preparation nothing is installed, but a missing mkfs.ext4 or losetup would
        // only show at the first create: name them now.
        kiln_host::prereq::check(kiln_host::prereq::DISK_TOOLS)
            .context("the per-sandbox disk quota (--disk-mb 0 turns it off)")?;
    }
    if !a.no_prepare {
        kiln_host::prereq::ensure(kiln_host::prereq::SERVE_TOOLS)?;
        // `sandbox.get_host(port)` names resolve on this host (Python's resolver too).
        match kiln_host::names::prepare(&a.domain) {
            Ok(Some(done)) => println!("kiln: sandbox host names: {done}"),
            Ok(None) => {}
            Err(msg) => eprintln!("kiln: warning: sandbox host names: {msg}"),
        }
        let store = kiln_template::Store::open_default()?;
        kiln_template::ensure_base(&store, &kiln_template::BuildOptions::default())
            .context("preparing the base template")?;
    }
    let runsc = if a.no_prepare {
        runsc::resolve(a.runsc.as_deref())?
    } else {
        runsc::ensure(a.runsc.as_deref())?
    };
    let platform = match &a.platform {
        Some(p) => p.clone(),
        None => platform::pick(&runsc.path, platform::kvm_at_hardware_speed()).map_err(|e| {
            anyhow::anyhow!(
                "no gVisor platform works with {}: {e}",
                runsc.path.display()
            )
        })?,
    };
    println!(
        "kiln: runsc {} ({}), platform {platform}",
        runsc.version,
        runsc.path.display()
    );
    let templates = template_source(a)?;
    let tls = match (&a.tls_cert, &a.tls_key) {
        (Some(c), Some(k)) => Some(kiln_server::tls::load(c, k).context("--tls-cert/--tls-key")?),
        _ => None,
    };
    let state_dir = a
        .state_dir
        .clone()
        .unwrap_or_else(kiln_host::paths::state_dir);
    let rt = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    let network = rt.block_on(crate::serve_net::network_config(&a.net, &state_dir))?;
    let sandbox_ranges: Vec<kiln_net::Cidr> = network.iter().map(|n| n.range).collect();
    let driver = {
        let mut d = DriverConfig {
            kind: a.driver,
            ..Default::default()
        };
        d.gvisor.platform = Some(platform);
        d.gvisor.runsc = Some(runsc.path.clone());
        d.gvisor.ignore_cgroups = a.ignore_cgroups;
        d.gvisor.network = network;
        d.gvisor.timer_slack = a
            .sentry_timer_slack_ms
            .map(|ms| secs(ms / 1000.0, "--sentry-timer-slack-ms"))
            .transpose()?;
        d.gvisor.idle_timer_slack = Some(secs(
            a.idle_timer_slack_ms / 1000.0,
            "--idle-timer-slack-ms",
        )?);
        d.gvisor.deep_idle = kiln_server::manager::parse_standby_after(&a.deep_idle_after)
            .map_err(|e| anyhow::anyhow!("--deep-idle-after: {e}"))?
            .map(|after| {
                Ok::<_, anyhow::Error>(kiln_gvisor::slack::DeepIdle {
                    after,
                    slack: secs(
                        a.deep_idle_timer_slack_ms / 1000.0,
                        "--deep-idle-timer-slack-ms",
                    )?,
                })
            })
            .transpose()?;
        d
    };
    let cfg = ServerConfig {
        listen: a.listen,
        domain: a.domain.clone(),
        state_dir: state_dir.clone(),
        lifecycle: LifecycleConfig {
            default_timeout_secs: a.default_timeout,
            max_timeout_secs: a.max_timeout,
            default_cpu_count: a.cpus,
            default_memory_mb: a.memory_mb,
            pids_limit: a.pids_limit,
            default_disk_mb: a.disk_mb,
            volume_mb: a.volume_mb,
            admission: kiln_server::manager::AdmissionConfig {
                max_sandboxes: a.max_sandboxes,
                state_dir: Some(state_dir.clone()),
                team_defaults: kiln_server::tenancy::TeamQuota {
                    max_sandboxes: a.team_max_sandboxes,
                    max_timeout_secs: a.team_max_timeout,
                    creates_per_minute: a.team_creates_per_minute,
                    max_volumes: (a.team_max_volumes > 0).then_some(a.team_max_volumes),
                },
                ..Default::default()
            },
            pools: a.pools.clone(),
            pool: kiln_server::manager::PoolPolicy {
                off: a.pool_off,
                max_per_template: a.pool_max,
                idle: secs(a.pool_idle, "--pool-idle")?,
                queue: secs(a.create_queue, "--create-queue")?,
                ..Default::default()
            },
            metrics_interval: secs(a.metrics_interval, "--metrics-interval")?,
            standby_after: kiln_server::manager::parse_standby_after(&a.standby_after)
                .map_err(|e| anyhow::anyhow!("--standby-after: {e}"))?,
            idle_hint_after: kiln_server::manager::parse_standby_after(&a.idle_hint_after)
                .map_err(|e| anyhow::anyhow!("--idle-hint-after: {e}"))?,
            webhooks: kiln_server::obs::webhooks::WebhookConfig {
                retry_base: secs(a.webhook_retry_base, "--webhook-retry-base")?,
                allow_private: a.webhook_allow_private,
                sandbox_ranges: sandbox_ranges.clone(),
                ..Default::default()
            },
            ..LifecycleConfig::default()
        },
        metrics_token: a.metrics_token.clone().filter(|t| !t.is_empty()),
        edge: kiln_server::edge::EdgeConfig {
            max_connections: a.max_connections.max(1),
            header_timeout: std::time::Duration::from_secs(a.header_timeout.max(1)),
            tls: tls.clone(),
            ..Default::default()
        },
        audit: kiln_server::audit::AuditConfig {
            enabled: a.audit == "on",
            retention: kiln_server::audit::Retention {
                max_age: a
                    .audit_max_age_hours
                    .map(|h| std::time::Duration::from_secs(h * 3600)),
                max_records: a.audit_max_records,
            },
            ..Default::default()
        },
        identity_issuer: a.identity_issuer.clone(),
        host_ca_dir: (a.host_cas == "on").then(|| a.host_ca_dir.clone()),
        template_builds: crate::template::serve_builds_config(
            &a.registry_mirrors,
            &a.template_gc_interval,
            &a.template_files_grace,
            &a.template_standing,
            a.template_gc_store == "on",
            &state_dir,
        )?,
    };
    let setup = ServerSetup {
        server: cfg.clone(),
        driver,
    };
    Ok(Prepared {
        rt,
        cfg,
        setup,
        templates,
        rules: a.rules.clone(),
    })
}

fn serve(
    rt: tokio::runtime::Runtime,
    cfg: ServerConfig,
    setup: ServerSetup,
    templates: Arc<dyn Templates>,
    rules: String,
) -> anyhow::Result<i32> {
    let tls = cfg.edge.tls.is_some();
    rt.block_on(async move {
        let server = setup.prepare(templates).await?;
        Prepared::start_rules(&rules, &cfg, &server)?;
        let recovery = server.recovery.clone();
        tokio::spawn(async move {
            match recovery.done().await {
                Ok(r) if !(r.adopted.is_empty() && r.standby.is_empty() && r.cleaned.is_empty() && r.orphans_removed.is_empty()) => println!(
                    "kiln: recovered from the previous run: {} sandbox(es) still running, {} gone and cleaned up, {} leftover(s) removed, {} in standby",
                    r.adopted.len(),
                    r.cleaned.len(),
                    r.orphans_removed.len(),
                    r.standby.len()
                ),
                Ok(_) => {}
                Err(e) => eprintln!("kiln: recovering sandboxes from the previous run: {e}"),
            }
        });
        println!("kiln: listening on http://{}", server.local_addr);
        if tls {
            println!(
                "kiln: TLS on the same port: https://{} (clients starting a TLS handshake)",
                server.local_addr
            );
        }
        println!("kiln: state in {}", cfg.state_dir.display());
        if let Some(k) = &server.first_key {
            println!("kiln: first API key (shown once, store it now): {}", k.secret);
        }
        println!(
            "kiln: SDK settings: E2B_API_URL=http://{0} E2B_SANDBOX_URL=http://{0} E2B_API_KEY=<key>",
            server.local_addr
        );
        if tls {
            println!(
                "kiln: or, with api.{0} and *.{0} resolving to this server on port 443: \
                 E2B_DOMAIN={0} E2B_API_KEY=<key>",
                cfg.domain
            );
        }
        let mut events = server.manager.subscribe();
        tokio::spawn(async move {
            use tokio::sync::broadcast::error::RecvError;
            loop {
                match events.recv().await {
                    Ok(e) => {
                        let t = chrono_like(e.ts_ms);
                        println!("{t} {} {:<9} {}", e.sandbox_id, e.kind, e.detail);
                    }
                    Err(RecvError::Lagged(n)) => println!("kiln: {n} events not shown"),
                    Err(RecvError::Closed) => break,
                }
            }
        });
        server.serve().await.context("serving")?;
        Ok::<_, anyhow::Error>(())
    })?;
    Ok(0)
}

/// A positive number of seconds from the command line.
fn secs(v: f64, flag: &str) -> anyhow::Result<std::time::Duration> {
    anyhow::ensure!(
        v.is_finite() && v > 0.0 && v < 86_400.0,
        "{flag} must be a positive number of seconds below a day, got {v}"
    );
    Ok(std::time::Duration::from_secs_f64(v))
}

/// `HH:MM:SS.mmm` (UTC) of a Unix time in milliseconds.
fn chrono_like(ms: i64) -> String {
    let s = ms.div_euclid(1000);
    let day = s.rem_euclid(86_400);
    format!(
        "{:02}:{:02}:{:02}.{:03}",
        day / 3600,
        (day / 60) % 60,
        day % 60,
        ms.rem_euclid(1000)
    )
}
