//! `kiln control`: a stateless API replica of a cluster. It serves the E2B routes unchanged
//! (the server's own router and `AppState`) over an [`EtcdStore`] for keys, teams, events and
//! sandbox records and a [`ClusterService`] for the lifecycle, and is the gateway: envd and
//! port traffic (header mode and `{port}-{id}.<domain>`) goes through the server's proxy to a
//! tunnel into the node that owns the sandbox; what it forwards and the API calls naming a
//! sandbox are recorded on that node's audit chain ([`audit`]). The web console is served too,
//! its sessions in etcd ([`crate::console`]) so any replica knows them. Every replica
//! campaigns for the cluster's singleton work ([`leader`]). Teams' secrets are kept in etcd
//! ([`crate::secrets`]); a create's or an update's `network.rules` and `egressProxy` are
//! checked here and applied by the sandbox's node.

mod audit;
mod builds;
mod cache;
mod client;
mod forks;
mod leader;
mod moves;
mod observe;
mod pages;
pub mod placement;
mod service;
mod snapshots;
mod templates;
pub mod unavailable;
mod volumes;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kiln_server::api::{ApiConfig, AppState};
use kiln_server::{auth, edge, front, LifecycleConfig};

use crate::error::{ClusterError, Result};
use crate::secret::ClusterSecret;
use crate::store::EtcdStore;
pub use cache::Cache;
pub use client::{NodeClient, TunnelConnector};
pub use service::ClusterService;

/// What a control replica is told.
#[derive(Debug, Clone)]
pub struct ControlConfig {
    pub listen: SocketAddr,
    pub domain: String,
    /// This replica's name (the leader key holds it).
    pub replica: String,
    pub secret: ClusterSecret,
    /// Timeouts and team quota defaults (sizes and the rest are the nodes').
    pub lifecycle: LifecycleConfig,
    pub edge: edge::EdgeConfig,
    pub metrics_token: Option<String>,
    /// The leader's lease.
    pub leader_ttl: Duration,
    /// Whether the leader moves drained nodes' paused sandboxes off them.
    pub move_drained: bool,
    /// Whether the replica records what it forwards on its nodes' audit chains and serves the
    /// audit routes ([`audit`]).
    pub audit: bool,
    /// `iss` of workload identity tokens and the issuer the OIDC discovery names (None:
    /// `http://<listen address>`). Give every replica and node the same: the URL verifiers
    /// reach the cluster at.
    pub identity_issuer: Option<String>,
}

/// A replica ready to serve.
pub struct Control {
    pub listener: tokio::net::TcpListener,
    pub local_addr: SocketAddr,
    /// Set when the cluster had no API key: the one made now (shown once).
    pub first_key: Option<auth::NewKey>,
    state: Arc<AppState>,
    etcd: EtcdStore,
    cache: Arc<Cache>,
    service: Arc<ClusterService>,
    cfg: ControlConfig,
}

impl Control {
    /// Loads the cluster view, makes the first API key of an empty cluster, binds.
    pub async fn prepare(etcd: EtcdStore, cfg: ControlConfig) -> Result<Self> {
        let cache = Cache::start(etcd.clone()).await?;
        let store: Arc<dyn kiln_server::store::StateStore> = Arc::new(etcd.clone());
        let first_key = auth::ensure_first_key(store.as_ref()).await?;
        let audit = kiln_server::audit::AuditLog::start_remote(
            Arc::new(audit::NodeAudit::new(
                cache.clone(),
                etcd.clone(),
                NodeClient::new(cfg.secret.clone()),
                tokio::runtime::Handle::current(),
            )),
            &kiln_server::audit::AuditConfig {
                enabled: cfg.audit,
                ..Default::default()
            },
        )
        .map_err(|e| ClusterError::Store(kiln_server::store::StoreError::Task(e.to_string())))?;
        let service = Arc::new(
            ClusterService::new(
                cfg.lifecycle.clone(),
                etcd.clone(),
                cache.clone(),
                NodeClient::new(cfg.secret.clone()),
            )
            .with_audit(audit.clone()),
        );
        let listen_err = |source| ClusterError::Listen {
            addr: cfg.listen.to_string(),
            source,
        };
        let listener = tokio::net::TcpListener::bind(cfg.listen)
            .await
            .map_err(listen_err)?;
        let local_addr = listener.local_addr().map_err(listen_err)?;
        // Teams' secrets and the identity key are the cluster's, sealed with the key every
        // process derives from the cluster secret.
        let vault = Arc::new(crate::cluster_keys::cluster_vault(&etcd, &cfg.secret)?);
        let issuer_url = cfg
            .identity_issuer
            .clone()
            .unwrap_or_else(|| format!("http://{local_addr}"));
        let issuer = kiln_server::identity::Issuer::from_pkcs8(
            &crate::cluster_keys::identity_key(&etcd, &vault).await?,
            &issuer_url,
            &cfg.domain,
        )?;
        let state = Arc::new(
            AppState::for_service(
                service.clone(),
                store,
                cfg.lifecycle.webhooks.clone(),
                ApiConfig {
                    domain: cfg.domain.clone(),
                    metrics_token: cfg.metrics_token.clone(),
                },
            )
            .with_audit(audit)
            .with_vault(vault)
            .with_identity(Arc::new(issuer))
            .with_console_sessions(Arc::new(crate::console::EtcdSessions::new(etcd.clone())))
            .with_console_sign_ins(Arc::new(crate::sign_ins::EtcdSignIns::new(etcd.clone()))),
        );
        Ok(Self {
            listener,
            local_addr,
            first_key,
            state,
            etcd,
            cache,
            service,
            cfg,
        })
    }

    /// Serves until SIGTERM or SIGINT.
    pub async fn serve(self) -> std::io::Result<()> {
        let leading = tokio::spawn(leader::run(
            self.etcd.clone(),
            self.cache.clone(),
            self.service.clone(),
            self.cfg.replica.clone(),
            self.cfg.leader_ttl,
            self.cfg.move_drained,
        ));
        let _webhooks = self.state.webhooks.spawn(self.state.manager.subscribe());
        let app = front::router(self.state.clone())
            .layer(axum::middleware::from_fn_with_state(
                Arc::<str>::from(self.cfg.domain.as_str()),
                unavailable::rewrite,
            ))
            .layer(axum::middleware::from_fn_with_state(
                Arc::new(volumes::ContentGate {
                    service: self.service.clone(),
                    domain: Arc::from(self.cfg.domain.as_str()),
                }),
                volumes::forward_content,
            ))
            .layer(axum::middleware::from_fn_with_state(
                Arc::new(builds::BuildGate {
                    state: self.state.clone(),
                    service: self.service.clone(),
                    domain: Arc::from(self.cfg.domain.as_str()),
                }),
                builds::forward_builds,
            ));
        let mut serving = tokio::spawn(edge::serve(self.listener, app, self.cfg.edge));
        tokio::select! {
            r = &mut serving => r.map_err(std::io::Error::other)?,
            _ = kiln_server::stop_signal() => serving.abort(),
        }
        leading.abort();
        Ok(())
    }
}
