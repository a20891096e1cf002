//! What the proxy asks of the manager: one call per request ([`Manager::open_route`]) that
//! waits for recovery to settle the sandbox, resumes it (autoResume) or wakes it (standby),
//! and hands back everything forwarding needs: the port's client, the tokens, the ingress
//! settings, the guard that keeps the sandbox awake and the audit log.

use std::sync::Arc;

use super::{InUse, Manager};
use crate::driver;
use crate::store::{Ingress, SandboxState};

/// A running sandbox as the registry knows it (`None` from [`Manager::route`] otherwise).
#[derive(Debug, Clone)]
pub struct Route {
    pub sandbox_id: String,
    /// The agent's access token (`None`: the sandbox was created with `secure=false`).
    pub envd_token: Option<String>,
    /// Who may reach its other ports, and the `Host` they see.
    pub ingress: Ingress,
}

/// A sandbox ready to take one request (or upgraded connection) on one port.
pub struct PortRoute {
    pub route: Route,
    /// HTTP to the port, through the driver's connect.
    pub client: kiln_envd::EnvdClient,
    /// Keeps the sandbox out of standby until dropped: held as long as the answer streams, or
    /// the upgraded connection lasts.
    pub in_use: InUse,
    /// Where operations on the agent's port are recorded.
    pub audit: crate::audit::AuditLog,
}

/// Why a request cannot be routed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NoRoute {
    /// In standby, and the wake failed (the client may retry).
    WakeFailed,
    /// Paused, and not resumed by traffic (no autoResume, or the resume failed).
    Paused,
    /// Not running nor paused: never existed, killed or timed out.
    NotFound,
    /// Out of reach for now (a cluster's node that is away or restarting); says why.
    Unavailable(String),
}

impl Manager {
    /// Where the proxy sends traffic for `id` (None when it is not running).
    pub fn route(&self, id: &str) -> Option<Route> {
        self.registry
            .get(id)
            .filter(|r| r.state == SandboxState::Running)
            .map(|r| Route {
                sandbox_id: r.id,
                envd_token: r.envd_token,
                ingress: r.ingress,
            })
    }

    /// A client for `port` inside sandbox `id` (raw HTTP through the driver's connect).
    pub fn port_client(&self, id: &str, port: u16) -> kiln_envd::EnvdClient {
        kiln_envd::EnvdClient::new(Arc::new(driver::SandboxConnector {
            driver: self.driver.clone(),
            id: id.to_string(),
            port,
        }))
    }

    /// Everything the proxy needs to forward one request to `port` of sandbox `id`: waits
    /// (bounded) while recovery has yet to settle it, resumes it when it is paused with
    /// autoResume, wakes it from standby, and keeps it awake for as long as the returned
    /// guard lives.
    pub async fn open_route(&self, id: &str, port: u16) -> Result<PortRoute, NoRoute> {
        self.wait_adopted(id).await;
        let why = match port {
            kiln_proto::envd::ENVD_PORT => "an envd request".to_string(),
            p => format!("traffic to port {p}"),
        };
        let Some((route, in_use)) = self.route_resuming(id, &why).await else {
            return Err(if self.standby_since(id).is_some() {
                NoRoute::WakeFailed
            } else if self.registry.get(id).is_some() {
                NoRoute::Paused
            } else {
                NoRoute::NotFound
            });
        };
        Ok(PortRoute {
            route,
            client: self.port_client(id, port),
            in_use,
            audit: self.audit().clone(),
        })
    }

    /// The route to `id` (`why`: for the `wake` event) and the guard that keeps it awake while
    /// the traffic flows: a sandbox paused with autoResume is resumed first (for the default
    /// timeout), one in standby woken. None when it is neither running nor resumable, or could
    /// not be woken.
    pub async fn route_resuming(&self, id: &str, why: &str) -> Option<(Route, InUse)> {
        if self.route(id).is_none() {
            let rec = self.registry.get(id)?;
            if rec.state != SandboxState::Paused || !rec.auto_resume {
                return None;
            }
            let secs = self.cfg.default_timeout_secs as i64;
            if let Err(e) = self.resume(id, true, secs).await {
                tracing::warn!(sandbox = id, error = %e, "auto-resuming on traffic");
            }
        }
        let route = self.route(id)?;
        match self.use_sandbox(id, why).await {
            Ok(guard) => Some((route, guard)),
            Err(e) => {
                tracing::warn!(sandbox = id, error = %e, "waking on traffic");
                None
            }
        }
    }
}
