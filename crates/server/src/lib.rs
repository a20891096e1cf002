//! kiln-server: the E2B-compatible control plane.
//!
//! - [`api`]: the REST API the `e2b` SDK talks to, with API-key auth, in front of it the
//!   [`proxy`] that forwards sandbox-addressed traffic ([`routing`]) to each sandbox's agent;
//! - [`manager`]: sandbox lifecycle (create, timeouts, kill, recovery after a restart);
//! - [`driver`]: isolation drivers ([`driver::gvisor`]);
//! - [`store`]: the SQLite state; [`auth`]: API keys;
//! - [`client`]: a Rust client of the REST API and of the proxied envd API (used by the CLI).

pub mod agent_http;
pub mod api;
pub mod auth;
pub mod bench;
pub mod client;
pub mod driver;
pub mod error;
pub mod manager;
pub mod proxy;
pub mod routing;
pub mod store;
pub mod templates;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

pub use error::{ApiError, ErrorBody};
pub use manager::{LifecycleConfig, LifecycleEvent, Manager};

/// Default domain of sandbox host names.
pub const DEFAULT_DOMAIN: &str = "kiln.local";

/// Everything `kiln serve` configures.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    pub domain: String,
    pub state_dir: PathBuf,
    pub platform: String,
    /// runsc binary; `None` finds `runsc` on `$PATH`.
    pub runsc: Option<PathBuf>,
    pub ignore_cgroups: bool,
    pub lifecycle: LifecycleConfig,
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
    #[error("gVisor driver: {0}")]
    Driver(#[from] driver::DriverError),
    #[error("recovering sandboxes from the previous run: {0}")]
    Recover(ApiError),
    #[error("listening on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// A server ready to serve: listener bound, state recovered.
pub struct Server {
    pub manager: Arc<Manager>,
    pub listener: tokio::net::TcpListener,
    pub local_addr: SocketAddr,
    /// Set on first start only: the generated API key (shown once).
    pub first_key: Option<auth::NewKey>,
    pub recovery: manager::RecoveryReport,
    domain: String,
}

impl Server {
    /// Opens the state, recovers sandboxes from a previous run, binds the listener.
    pub async fn prepare(
        cfg: ServerConfig,
        templates: Arc<dyn templates::Templates>,
    ) -> Result<Self, ServerError> {
        std::fs::create_dir_all(&cfg.state_dir).map_err(|source| ServerError::StateDir {
            path: cfg.state_dir.display().to_string(),
            source,
        })?;
        let store = Arc::new(store::Store::open(&cfg.state_dir.join("kiln.db"))?);
        let first_key = auth::ensure_first_key(&store)?;
        let mut gcfg = driver::gvisor::GvisorConfig::new(&cfg.state_dir);
        gcfg.platform = cfg.platform.clone();
        if let Some(r) = &cfg.runsc {
            gcfg.runsc = r.clone();
        }
        gcfg.ignore_cgroups = cfg.ignore_cgroups;
        let driver = Arc::new(driver::gvisor::GvisorDriver::new(gcfg)?);
        let manager = Manager::new(cfg.lifecycle.clone(), store, driver, templates);
        let recovery = manager.recover().await.map_err(ServerError::Recover)?;
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
        Ok(Self {
            manager,
            listener,
            local_addr,
            first_key,
            recovery,
            domain: cfg.domain,
        })
    }

    /// Serves until the process ends (sandboxes keep running across restarts by design).
    pub async fn serve(self) -> std::io::Result<()> {
        let _reaper = self.manager.spawn_reaper();
        let state = Arc::new(api::AppState {
            manager: self.manager.clone(),
            cfg: api::ApiConfig {
                domain: self.domain.clone(),
            },
        });
        let app = api::router(state);
        axum::serve(self.listener, app).await
    }
}
