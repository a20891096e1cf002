//! kiln-server: the E2B-compatible control plane. See docs/architecture.md for the create path
//! through these modules.
//!
//! - [`front`]: what a request reaches: the [`proxy`] that forwards sandbox-addressed traffic
//!   ([`routing`]) into each sandbox, or [`api`] (the REST API the `e2b` SDK talks to, with
//!   API-key auth) or [`console`];
//! - [`manager`]: sandbox lifecycle (create, timeouts, kill, recovery after a restart) — the
//!   only thing handlers call;
//! - [`driver`]: the isolation seam (kiln-driver's traits); the binary builds the driver and
//!   hands it to [`Server::prepare`];
//! - [`store`]: state behind the [`store::StateStore`] trait (SQLite); [`auth`]: API keys;
//! - [`error`]: the typed error that travels from driver to API.

pub mod alerts;
pub mod api;
pub mod audit;
pub mod auth;
pub mod console;
pub mod driver;
pub mod edge;
pub mod error;
pub mod front;
pub mod identity;
pub mod manager;
pub mod obs;
pub mod proxy;
pub mod routing;
pub mod store;
pub mod templates;
pub mod tenancy;
pub mod tls;
pub mod tplbuild;
pub mod vault;
pub mod volume_fs;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

pub use api::{ApiError, ApiErrorBody};
pub use error::Error;
pub use manager::{LifecycleConfig, LifecycleEvent, Manager, SandboxService};

/// Default domain of sandbox host names: `{port}-{id}.localhost` resolves to the loopback
/// address on the kiln host itself without any DNS set-up (RFC 6761; browsers, curl and
/// systemd's nss-myhostname answer `*.localhost` so) — see docs/tls-and-domains.md.
pub const DEFAULT_DOMAIN: &str = "localhost";

/// Everything `kiln serve` configures.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    pub domain: String,
    pub state_dir: PathBuf,
    pub lifecycle: LifecycleConfig,
    /// Bearer token of the Prometheus `/metrics` endpoint (None: the endpoint answers 404).
    pub metrics_token: Option<String>,
    /// Connection limits and timeouts.
    pub edge: edge::EdgeConfig,
    /// The audit log (on by default; `--audit off`).
    pub audit: audit::AuditConfig,
    /// `iss` of workload identity tokens (None: `https://api.<domain>` with TLS, else
    /// `http://<listen address>`).
    pub identity_issuer: Option<String>,
    /// Where the host's extra CA certificates are (`*.crt`), trusted in every sandbox; None:
    /// off (`kiln serve --host-cas off`).
    pub host_ca_dir: Option<PathBuf>,
    /// Template API builds: registry mirrors of `fromImage` pulls, the automatic collection.
    pub template_builds: tplbuild::BuildsConfig,
}

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("state directory {path}: {source}")]
    StateDir {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Store(#[from] store::StoreError),
    #[error("isolation driver: {0}")]
    Driver(#[from] driver::DriverError),
    #[error(transparent)]
    Audit(#[from] audit::AuditError),
    #[error(transparent)]
    Vault(#[from] vault::VaultError),
    #[error(transparent)]
    Identity(#[from] identity::IdentityError),
    #[error("recovering sandboxes from the previous run: {0}")]
    Recover(Error),
    #[error("listening on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// Creates the state directory, readable by its owner only (it holds the database and every
/// sandbox's writable layer).
fn prepare_state_dir(dir: &std::path::Path) -> Result<(), ServerError> {
    use std::os::unix::fs::PermissionsExt;
    let err = |source| ServerError::StateDir {
        path: dir.display().to_string(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(err)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(err)
}

/// Recovery of the previous run's sandboxes, running in the background.
#[derive(Clone)]
pub struct Recovery(tokio::sync::watch::Receiver<Option<Result<manager::RecoveryReport, String>>>);

impl Recovery {
    /// Waits until recovery is over: what it did, or why it failed.
    pub async fn done(&self) -> Result<manager::RecoveryReport, String> {
        let mut rx = self.0.clone();
        let r = rx.wait_for(|v| v.is_some()).await;
        match r {
            Ok(v) => v
                .clone()
                .unwrap_or_else(|| Err("recovery did not finish".into())),
            Err(_) => Err("recovery was abandoned".into()),
        }
    }
}

/// A server ready to serve: listener bound, recovery of the previous run's sandboxes under way
/// in the background (requests for a sandbox not yet recovered wait for it).
pub struct Server {
    pub manager: Arc<Manager>,
    pub listener: tokio::net::TcpListener,
    pub local_addr: SocketAddr,
    /// Set on first start only: the generated API key (shown once).
    pub first_key: Option<auth::NewKey>,
    pub recovery: Recovery,
    domain: String,
    metrics_token: Option<String>,
    edge: edge::EdgeConfig,
    vault: Arc<vault::Vault>,
    interceptor: Option<Arc<kiln_net::intercept::Interceptor>>,
    identity: Arc<identity::Issuer>,
    builds: Arc<tplbuild::Builds>,
    console_db: console::ConsoleDb,
    alerts_db: store::alerts_sql::AlertsDb,
}

impl Server {
    /// Opens the state, binds the listener, and starts recovering sandboxes from a previous
    /// run in the background (so it listens at once, whatever their number); sandboxes run on
    /// `driver`, whose state lives under `cfg.state_dir`.
    pub async fn prepare(
        cfg: ServerConfig,
        driver: Arc<dyn driver::Driver>,
        templates: Arc<dyn templates::Templates>,
    ) -> Result<Self, ServerError> {
        prepare_state_dir(&cfg.state_dir)?;
        let db = store::StateDb::open(&cfg.state_dir.join("kiln.db"))?;
        let store = db.state();
        let first_key = auth::ensure_first_key(store.as_ref()).await?;
        let vault = Arc::new(vault::Vault::open(&cfg.state_dir, db.secrets()?)?);
        let interceptor = match kiln_net::intercept::Interceptor::open(
            &cfg.state_dir,
            &kiln_net::intercept::Interceptor::extra_trust_from_env(),
        ) {
            Ok(i) => Some(Arc::new(i)),
            Err(e) => {
                tracing::warn!(error = %e, "no TLS interception: network.rules will answer 501");
                None
            }
        };
        let manager = Manager::new(cfg.lifecycle.clone(), store, driver, templates);
        manager.set_audit(if cfg.audit.enabled {
            audit::AuditLog::start(db.audit()?, &cfg.audit)?
        } else {
            audit::AuditLog::disabled()
        });
        manager.set_volumes_db(db.volumes()?);
        manager.mount_volumes().await;
        manager.set_metrics_db(obs::persist::MetricsDb::new(db.metrics()?));
        let builds = tplbuild::Builds::open(
            &cfg.state_dir,
            db.builds()?,
            manager.clone(),
            manager.store().clone(),
            cfg.template_builds.clone(),
        )
        .await?;
        let console_db = db.console()?;
        let alerts_db = db.alerts()?;
        let listener = tokio::net::TcpListener::bind(cfg.listen)
            .await
            .map_err(|source| ServerError::Listen {
                addr: cfg.listen,
                source,
            })?;
        let local_addr = listener
            .local_addr()
            .map_err(|source| ServerError::Listen {
                addr: cfg.listen,
                source,
            })?;
        let issuer = cfg
            .identity_issuer
            .clone()
            .unwrap_or_else(|| match cfg.edge.tls {
                Some(_) => format!("https://api.{}", cfg.domain),
                None => format!("http://{local_addr}"),
            });
        let identity = Arc::new(identity::Issuer::open(
            &cfg.state_dir,
            &issuer,
            &cfg.domain,
        )?);
        let host_cas: Option<api::host_trust::HostCas> = match &cfg.host_ca_dir {
            None => None,
            Some(dir) => match api::host_trust::HostCas::read(dir) {
                Ok(c) => {
                    tracing::info!(certificates = c.certs.len(), dir = %dir.display(),
                        "the host's CA certificates are trusted in sandboxes");
                    Some(c)
                }
                Err(e) => {
                    tracing::warn!(dir = %dir.display(), error = %e,
                        "the host's CA certificates are not trusted in sandboxes");
                    None
                }
            },
        };
        manager.set_extra_cas(api::host_trust::extra_cas(
            host_cas.as_ref(),
            interceptor.as_ref().map(|i| i.ca.cert_pem()),
        ));
        let pending = manager
            .begin_recovery()
            .await
            .map_err(ServerError::Recover)?;
        let (tx, rx) = tokio::sync::watch::channel(None);
        let (m, b) = (manager.clone(), builds.clone());
        tokio::spawn(async move {
            let r = m.finish_recovery(pending).await.map_err(|e| e.to_string());
            if r.is_ok() {
                m.sweep_metrics_history().await;
                b.remove_leftover_sandboxes().await;
            }
            if let Err(e) = &r {
                tracing::error!(error = %e, "recovering sandboxes from the previous run");
            }
            let _ = tx.send(Some(r));
        });
        Ok(Self {
            manager,
            recovery: Recovery(rx),
            listener,
            local_addr,
            first_key,
            domain: cfg.domain,
            metrics_token: cfg.metrics_token,
            edge: cfg.edge,
            vault,
            interceptor,
            identity,
            builds,
            console_db,
            alerts_db,
        })
    }

    /// Keeps teams' secrets in `records`, sealed with `key` (32 bytes), instead of this host's
    /// state database and key (a cluster node: the cluster's secrets, shared by every process);
    /// its sandboxes' sealed settings stay in the state database. The vault, for what must
    /// tell it of changes made elsewhere ([`vault::Vault::forget`]).
    pub fn use_secrets(
        &mut self,
        key: &[u8],
        records: Arc<dyn store::SecretStore>,
    ) -> Result<Arc<vault::Vault>, vault::VaultError> {
        let local = self.vault.db().cloned();
        self.vault = Arc::new(vault::Vault::with_store(key, records, local)?);
        Ok(self.vault.clone())
    }

    /// Signs workload identity tokens with the PKCS#8 key `der` instead of this host's own (a
    /// cluster node: the cluster's key, the one every replica's JWKS shows), keeping the
    /// configured issuer URL and trust domain.
    pub fn use_identity_key(&mut self, der: &[u8]) -> Result<(), identity::IdentityError> {
        self.identity = Arc::new(identity::Issuer::from_pkcs8(
            der,
            &self.identity.issuer,
            &self.domain,
        )?);
        Ok(())
    }

    /// Starts anomaly detection: the rules of `source` evaluate the audit stream of this
    /// server's sandboxes, and their alerts go to the state database.
    pub fn start_alerts(
        &self,
        source: alerts::RulesSource,
    ) -> Result<alerts::Started, alerts::AlertsError> {
        alerts::start(&self.manager, self.alerts_db.clone(), source)
    }

    /// Serves until SIGTERM or SIGINT (sandboxes keep running across restarts by design; what
    /// the driver keeps ready for new ones, e.g. network slots, is released).
    pub async fn serve(self) -> std::io::Result<()> {
        self.serve_with(front::router, async {
            stop_signal().await;
        })
        .await
    }

    /// Serves like [`Server::serve`], with `app` made from the API's state answering every
    /// request instead of the public front, until `stop` resolves (a cluster node serves its
    /// internal API so, and stops when signalled or fenced).
    pub async fn serve_with(
        self,
        app: impl FnOnce(Arc<api::AppState>) -> axum::Router,
        stop: impl std::future::Future<Output = ()> + Send,
    ) -> std::io::Result<()> {
        let _reaper = self.manager.spawn_reaper();
        let _sampler = self.manager.spawn_sampler();
        let _webhooks = self.manager.webhooks().spawn(self.manager.subscribe());
        let _watcher = self.manager.spawn_watcher();
        let _idle = self.manager.spawn_idle_tick();
        // Pools start once recovery is over (until then, their sandboxes would look like
        // leftovers of the previous run).
        let (m, recovery) = (self.manager.clone(), self.recovery.clone());
        let pools = tokio::spawn(async move {
            let _ = recovery.done().await;
            m.run_pools().await;
        });
        // The collection of built templates counts recovered sandboxes as users.
        let (b, recovery) = (self.builds.clone(), self.recovery.clone());
        let _template_gc = tokio::spawn(async move {
            if recovery.done().await.is_ok() {
                b.run_gc_timer().await;
            }
        });
        let state = api::AppState::new(
            self.manager.clone(),
            api::ApiConfig {
                domain: self.domain.clone(),
                metrics_token: self.metrics_token.clone(),
            },
        )
        .with_vault(self.vault.clone())
        .with_identity(self.identity.clone())
        .with_builds(self.builds.clone())
        .with_console_db(self.console_db.clone());
        let state = Arc::new(match &self.interceptor {
            Some(i) => state.with_interceptor(i.clone()),
            None => state,
        });
        // Rules and egress proxies of running sandboxes, once recovery has adopted them.
        let (st, recovery) = (state.clone(), self.recovery.clone());
        let _networks = tokio::spawn(async move {
            if recovery.done().await.is_ok() {
                api::reapply_networks(&st).await;
            }
        });
        let app = app(state);
        let mut serving = tokio::spawn(edge::serve(self.listener, app, self.edge));
        let served = tokio::select! {
            r = &mut serving => r.map_err(std::io::Error::other),
            _ = stop => {
                // Stop accepting (connections in flight end with the process).
                serving.abort();
                Ok(())
            }
        };
        // Either way (stopped, or the accept loop ended by a panic), pooled sandboxes belong
        // to no one: they stop with the server, and the driver releases what it keeps ready.
        pools.abort();
        let _ = pools.await;
        self.manager.drain_pools().await;
        self.manager.shutdown_driver().await;
        served
    }
}

/// Resolves on SIGTERM or SIGINT with the signal's number and name (never, when the handlers
/// cannot be installed: the default action, exit, then applies).
pub async fn stop_signal() -> (i32, &'static str) {
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
