//! The REST API: the routes and JSON shapes of E2B's API that the `e2b` SDK uses, API-key
//! auth, and in front of it the entry point that sends sandbox-addressed traffic to the proxy.
//!
//! - [`wire`]: JSON shapes; [`error`]: the error answer and the status mapping;
//! - [`sandboxes`], [`list`], [`templates`], [`snapshots`]: handlers (each a call into the
//!   manager).

mod alerts;
mod audit;
pub mod error;
pub mod host_trust;
pub mod idempotency;
mod jwks;
mod keys;
mod list;
pub mod net_forwarded;
mod net_inherit;
mod net_persist;
mod net_update;
mod network;
mod observe;
mod rules;
mod sandboxes;
mod scope;
mod secrets;
mod signed;
mod snapshots;
pub mod template_api;
mod templates;
pub mod volume_content;
mod volumes;
mod webhooks;
pub mod wire;

pub use audit::ViewRead;

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post, put};
use axum::Router;

pub use error::{ApiError, ApiErrorBody};
pub use list::parse_metadata_filter;
pub use net_persist::reapply as reapply_networks;

use crate::auth;
use crate::manager::{Manager, SandboxService};
use crate::obs::Telemetry;
use crate::routing;

/// The OpenAPI document of kiln's API (also served at `/openapi.json`).
pub const OPENAPI: &str = include_str!("../../openapi.json");

/// Every (method, path) the router serves, in axum path syntax. Kept in sync with the router
/// and with `openapi.json` by tests.
pub const ROUTES: &[(&str, &str)] = &[
    ("GET", "/health"),
    ("GET", "/openapi.json"),
    ("POST", "/sandboxes"),
    ("GET", "/sandboxes"),
    ("POST", "/v2/sandboxes"),
    ("GET", "/v2/sandboxes"),
    ("GET", "/sandboxes/metrics"),
    ("GET", "/sandboxes/{sandboxID}"),
    ("DELETE", "/sandboxes/{sandboxID}"),
    ("POST", "/sandboxes/{sandboxID}/timeout"),
    ("POST", "/sandboxes/{sandboxID}/connect"),
    ("POST", "/v2/sandboxes/{sandboxID}/connect"),
    ("POST", "/sandboxes/{sandboxID}/refreshes"),
    ("GET", "/sandboxes/{sandboxID}/metrics"),
    ("GET", "/sandboxes/{sandboxID}/logs"),
    ("GET", "/v2/sandboxes/{sandboxID}/logs"),
    ("POST", "/sandboxes/{sandboxID}/pause"),
    ("POST", "/sandboxes/{sandboxID}/resume"),
    ("POST", "/sandboxes/{sandboxID}/fork"),
    ("POST", "/sandboxes/{sandboxID}/snapshots"),
    ("PUT", "/sandboxes/{sandboxID}/network"),
    ("GET", "/sandboxes/{sandboxID}/audit"),
    ("GET", "/audit"),
    ("GET", "/audit/verify"),
    ("GET", "/snapshots"),
    ("GET", "/templates"),
    ("GET", "/templates/{templateID}"),
    ("DELETE", "/templates/{templateID}"),
    ("GET", "/sandboxes/{sandboxID}/events"),
    ("GET", "/events"),
    ("GET", "/metrics"),
    ("POST", "/webhooks"),
    ("GET", "/webhooks"),
    ("GET", "/webhooks/{webhookID}"),
    ("DELETE", "/webhooks/{webhookID}"),
    ("GET", "/webhooks/{webhookID}/deliveries"),
    ("POST", "/webhooks/{webhookID}/test"),
    ("GET", "/alerts"),
    ("POST", "/secrets"),
    ("GET", "/secrets"),
    ("GET", "/secrets/{secretID}"),
    ("POST", "/secrets/{secretID}"),
    ("DELETE", "/secrets/{secretID}"),
    ("POST", "/v3/templates"),
    ("GET", "/templates/{templateID}/files/{hash}"),
    ("POST", "/v2/templates/{templateID}/builds/{buildID}"),
    ("GET", "/templates/{templateID}/builds/{buildID}/status"),
    ("GET", "/templates/{templateID}/builds/{buildID}/logs"),
    ("POST", "/templates/tags"),
    ("DELETE", "/templates/tags"),
    ("GET", "/templates/{templateID}/tags"),
    ("GET", "/templates/{templateID}/tags/count"),
    ("GET", "/templates/{templateID}/tags/exists"),
    ("GET", "/templates/{templateID}/tags/groups"),
    ("GET", "/templates/{templateID}/tags/{tag}/assignments"),
    ("POST", "/template-builds/gc"),
    ("GET", "/templates/aliases/{alias}"),
    ("GET", "/v2/templates"),
    ("PATCH", "/v2/templates/{templateID}"),
    ("GET", "/default-templates"),
    ("POST", "/volumes"),
    ("GET", "/volumes"),
    ("GET", "/volumes/{volumeID}"),
    ("DELETE", "/volumes/{volumeID}"),
    ("GET", "/volumecontent/{volumeID}/path"),
    ("PATCH", "/volumecontent/{volumeID}/path"),
    ("DELETE", "/volumecontent/{volumeID}/path"),
    ("GET", "/volumecontent/{volumeID}/dir"),
    ("POST", "/volumecontent/{volumeID}/dir"),
    ("GET", "/volumecontent/{volumeID}/file"),
    ("PUT", "/volumecontent/{volumeID}/file"),
    ("GET", "/.well-known/jwks.json"),
    ("GET", "/.well-known/openid-configuration"),
    ("GET", "/api-keys"),
    ("POST", "/api-keys"),
    ("DELETE", "/api-keys/{apiKeyID}"),
    ("GET", "/teams"),
];

/// Server-wide settings the API needs.
#[derive(Debug, Clone)]
pub struct ApiConfig {
    /// Domain of sandbox host names (`{port}-{id}.{domain}`).
    pub domain: String,
    /// Bearer token of `GET /metrics` (Prometheus); None: the endpoint is off (404).
    pub metrics_token: Option<String>,
}

pub struct AppState {
    /// The sandboxes' lifecycle (the only way the API reaches a sandbox).
    pub manager: Arc<dyn SandboxService>,
    /// Request and lifecycle counters (`/metrics`).
    pub telemetry: Arc<Telemetry>,
    /// The audit log (`/sandboxes/{id}/audit`, alerts).
    pub audit: crate::audit::AuditLog,
    /// Webhook delivery (`/webhooks`).
    pub webhooks: Arc<crate::obs::webhooks::Webhooks>,
    /// Sandbox records, ended ones included (whose logs a team may read).
    pub sandboxes: Arc<dyn crate::store::SandboxStore>,
    /// API keys and teams (`/api-keys`, `/teams`, the console's sign-in).
    pub access: Arc<dyn crate::store::AccessStore>,
    /// The event log and the webhooks fed from it (`/events`, `/webhooks`).
    pub events: Arc<dyn crate::store::EventStore>,
    pub cfg: ApiConfig,
    /// Idempotency keys of recent creates.
    pub idempotency: idempotency::Idempotency,
    /// Secrets (`/secrets`, network rules' placeholders); `None`: those answer 501.
    pub vault: Option<Arc<crate::vault::Vault>>,
    /// TLS interception for `network.rules`; `None`: rules answer 501.
    pub interceptor: Option<Arc<kiln_net::intercept::Interceptor>>,
    /// The workload identity token issuer (`iam.tokens`); `None`: those answer 501.
    pub identity: Option<Arc<crate::identity::Issuer>>,
    /// Templates built through E2B's Template API; `None`: those routes answer 501.
    pub builds: Option<Arc<crate::tplbuild::Builds>>,
    /// Where the web console keeps its sessions; `None`: in memory (a restart ends them).
    pub console_sessions: Option<Arc<dyn crate::console::store::SessionStore>>,
    /// Where the console counts failed sign-ins; `None`: in this process.
    pub console_sign_ins: Option<Arc<dyn crate::console::limit::SignInCounter>>,
}

impl AppState {
    /// The API of one host's `manager`, with its outlets as they are now (give the manager
    /// its audit log with `Manager::set_audit` first).
    pub fn new(manager: Arc<Manager>, cfg: ApiConfig) -> Self {
        let (telemetry, audit, webhooks) = (
            manager.telemetry().clone(),
            manager.audit().clone(),
            manager.webhooks().clone(),
        );
        Self::of(
            manager.store().clone(),
            telemetry,
            audit,
            webhooks,
            manager,
            cfg,
        )
    }

    /// The API of a lifecycle other than one host's manager (a cluster's control replica):
    /// `store` holds keys, teams, events and sandbox records; no audit log is kept unless
    /// given ([`AppState::with_audit`]).
    pub fn for_service(
        service: Arc<dyn SandboxService>,
        store: Arc<dyn crate::store::StateStore>,
        webhooks: crate::obs::webhooks::WebhookConfig,
        cfg: ApiConfig,
    ) -> Self {
        let telemetry = Arc::new(Telemetry::default());
        let webhooks = Arc::new(crate::obs::webhooks::Webhooks::new(
            store.clone(),
            telemetry.clone(),
            webhooks,
        ));
        let audit = crate::audit::AuditLog::disabled();
        Self::of(store, telemetry, audit, webhooks, service, cfg)
    }

    /// The API over `store` and `manager`, reporting through `telemetry`, `audit` and
    /// `webhooks`; the optional parts unset.
    fn of(
        store: Arc<dyn crate::store::StateStore>,
        telemetry: Arc<Telemetry>,
        audit: crate::audit::AuditLog,
        webhooks: Arc<crate::obs::webhooks::Webhooks>,
        manager: Arc<dyn SandboxService>,
        cfg: ApiConfig,
    ) -> Self {
        Self {
            idempotency: idempotency::Idempotency::with_store(store.clone()),
            sandboxes: store.clone(),
            access: store.clone(),
            events: store,
            telemetry,
            audit,
            webhooks,
            manager,
            cfg,
            vault: None,
            interceptor: None,
            identity: None,
            builds: None,
            console_sessions: None,
            console_sign_ins: None,
        }
    }

    /// With the console's sessions kept in `db`.
    pub fn with_console_db(self, db: crate::store::ConsoleDb) -> Self {
        self.with_console_sessions(Arc::new(db))
    }

    /// The audit log the API records its calls in and reads from (a cluster replica's
    /// forwards to its nodes).
    pub fn with_audit(mut self, audit: crate::audit::AuditLog) -> Self {
        self.audit = audit;
        self
    }

    /// With the console's sessions kept in `sessions` (etcd, on a cluster).
    pub fn with_console_sessions(
        mut self,
        sessions: Arc<dyn crate::console::store::SessionStore>,
    ) -> Self {
        self.console_sessions = Some(sessions);
        self
    }

    /// With the console's failed sign-ins counted by `counter` (etcd, on a cluster).
    pub fn with_console_sign_ins(
        mut self,
        counter: Arc<dyn crate::console::limit::SignInCounter>,
    ) -> Self {
        self.console_sign_ins = Some(counter);
        self
    }

    /// With `network.rules` applied through `interceptor`.
    pub fn with_interceptor(mut self, i: Arc<kiln_net::intercept::Interceptor>) -> Self {
        self.interceptor = Some(i);
        self
    }

    /// With workload identity tokens minted by `issuer`.
    pub fn with_identity(mut self, issuer: Arc<crate::identity::Issuer>) -> Self {
        self.identity = Some(issuer);
        self
    }

    /// With the Template API served by `builds`.
    pub fn with_builds(mut self, builds: Arc<crate::tplbuild::Builds>) -> Self {
        self.builds = Some(builds);
        self
    }

    /// With secrets kept in `vault`.
    pub fn with_vault(mut self, vault: Arc<crate::vault::Vault>) -> Self {
        self.vault = Some(vault);
        self
    }

    /// The vault and the host's table of its sandboxes' sealed settings (None: this process
    /// keeps none, e.g. a cluster's control replica, whose nodes keep them).
    pub(crate) fn settings_db(
        &self,
    ) -> Option<(&Arc<crate::vault::Vault>, &crate::store::SecretsDb)> {
        self.vault.as_ref().and_then(|v| v.db().map(|d| (v, d)))
    }
}

type St = State<Arc<AppState>>;
type ApiResult<T> = Result<T, ApiError>;

async fn health() -> StatusCode {
    StatusCode::OK
}

async fn openapi() -> Response {
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        OPENAPI,
    )
        .into_response()
}

/// Paths of E2B's API that kiln knows but does not implement.
const E2B_PREFIXES: &[&str] = &[
    "/sandboxes",
    "/v2/sandboxes",
    "/templates",
    "/v2/templates",
    "/v3/templates",
    "/snapshots",
    "/secrets",
    "/volumes",
    "/teams",
    "/access-tokens",
    "/api-keys",
    "/nodes",
    "/admin",
];

async fn fallback(method: Method, uri: axum::http::Uri) -> ApiError {
    let path = uri.path();
    if E2B_PREFIXES
        .iter()
        .any(|p| path == *p || path.starts_with(&format!("{p}/")))
    {
        ApiError::not_implemented(&format!("{method} {path}"))
    } else {
        ApiError::not_found(format!("unknown route {method} {path}"))
    }
}

async fn method_not_allowed(method: Method, uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("{method} is not allowed on {}", uri.path()),
    )
}

// ---------- layers ----------

/// Checks the API key and puts the caller ([`crate::tenancy::Caller`]) in the request's
/// extensions.
async fn require_api_key(State(st): St, mut req: Request, next: Next) -> Response {
    // The console's `/console/api/` hands requests on with the caller of its checked
    // session already set; nothing from the network can set an extension.
    if let Some(c) = req.extensions().get::<crate::tenancy::Caller>().cloned() {
        req.extensions_mut().insert(audit::KeyId(c.key_id));
        return next.run(req).await;
    }
    let path = req.uri().path();
    // `/metrics` checks its own token.
    if path == "/health" || path == "/openapi.json" || path == "/metrics" {
        return next.run(req).await;
    }
    let key = auth::presented_key(req.headers());
    match auth::verify(st.access.as_ref(), key.as_deref()).await {
        Ok(Ok(caller)) => {
            req.extensions_mut()
                .insert(audit::KeyId(caller.key_id.clone()));
            req.extensions_mut().insert(caller);
            next.run(req).await
        }
        Ok(Err(e)) => ApiError::unauthorized(e.to_string()).into_response(),
        Err(e) => ApiError::from(crate::error::Error::from(e)).into_response(),
    }
}

/// `body`, adding the bytes of each data frame to a counter of `t` as they pass.
fn count_body(
    body: axum::body::Body,
    t: &Arc<Telemetry>,
    counter: fn(&Telemetry) -> &std::sync::atomic::AtomicU64,
) -> axum::body::Body {
    use http_body_util::BodyExt;
    let t = t.clone();
    axum::body::Body::new(body.map_frame(move |f| {
        if let Some(d) = f.data_ref() {
            Telemetry::add(counter(&t), d.len() as u64);
        }
        f
    }))
}

/// Sends sandbox-addressed requests (routing headers, `{port}-{id}.{domain}` hosts, signed
/// file URLs) to the [`crate::proxy`]; everything else goes on to the API and the console.
pub async fn route_sandbox_traffic(State(st): St, req: Request, next: Next) -> Response {
    let routed = match routing::target_of_request(req.headers(), req.uri(), &st.cfg.domain) {
        // A signed file URL names no sandbox: the signature's token finds it.
        Ok(None) => match signed::signed_files_query(req.method(), req.uri()) {
            Some((q, op)) => match signed::route_signed(st.manager.as_ref(), &q, op) {
                Ok(t) => Ok(Some(t)),
                Err(why) => return signed::unauthorized(why),
            },
            None => Ok(None),
        },
        r => r,
    };
    match routed {
        Ok(Some(target)) => {
            let t = st.telemetry.clone();
            let req = req.map(|b| count_body(b, &t, |t| &t.proxy_request_bytes));
            let resp = crate::proxy::forward(st.manager.as_ref(), target, req).await;
            Telemetry::add(&t.proxy_requests, 1);
            if resp.status().is_server_error() {
                Telemetry::add(&t.proxy_errors, 1);
            }
            resp.map(|b| count_body(b, &t, |t| &t.proxy_response_bytes))
        }
        Ok(None) => next.run(req).await,
        Err(e) => ApiError::bad_request(e.to_string()).into_response(),
    }
}

/// A request naming a sandbox the server cannot answer for yet waits for it (bounded)
/// instead of answering 404: after a restart, until recovery reached it; on a cluster
/// replica, until its view has what another replica did a moment ago. A read of a sandbox's
/// record or of the list first waits until the view is current
/// ([`SandboxService::await_known`](crate::manager::SandboxService::await_known),
/// [`SandboxService::await_current`](crate::manager::SandboxService::await_current)).
async fn await_known(State(st): St, req: Request, next: Next) -> Response {
    let mut seg = req.uri().path().split('/');
    if seg.any(|s| s == "sandboxes") {
        let id = seg.next().filter(|s| !s.is_empty() && *s != "metrics");
        // `GET /sandboxes`, `GET /v2/sandboxes`, `GET /sandboxes/{id}`: answered from the view.
        if req.method() == axum::http::Method::GET && seg.next().is_none() {
            st.manager.await_current().await;
        }
        if let Some(id) = id {
            st.manager.await_known(id).await;
        }
    }
    next.run(req).await
}

/// The REST API's routes with their layers (key check, recovery wait, audit, body limit);
/// [`crate::front::router`] composes them with the console and the sandbox traffic.
pub fn routes(state: &Arc<AppState>) -> Router<Arc<AppState>> {
    use sandboxes as s;
    let sbx = "/sandboxes/{sandboxID}";
    Router::new()
        .route("/health", get(health))
        .route("/openapi.json", get(openapi))
        .route("/sandboxes", post(s::create_sandbox).get(list::list_v1))
        .route("/v2/sandboxes", post(s::create_sandbox).get(list::list_v2))
        .route("/sandboxes/metrics", get(observe::bulk_metrics))
        .route(sbx, get(s::get_sandbox).delete(s::kill_sandbox))
        .route(&format!("{sbx}/timeout"), post(s::set_timeout))
        .route(&format!("{sbx}/connect"), post(s::connect))
        .route("/v2/sandboxes/{sandboxID}/connect", post(s::connect))
        .route(&format!("{sbx}/refreshes"), post(s::refresh))
        .route(&format!("{sbx}/metrics"), get(observe::sandbox_metrics))
        .route(&format!("{sbx}/events"), get(observe::sandbox_events))
        .route("/events", get(observe::events))
        .route("/metrics", get(observe::prometheus))
        .route("/webhooks", post(webhooks::create).get(webhooks::list))
        .route(
            "/webhooks/{webhookID}",
            get(webhooks::get).delete(webhooks::delete),
        )
        .route(
            "/webhooks/{webhookID}/deliveries",
            get(webhooks::deliveries),
        )
        .route("/webhooks/{webhookID}/test", post(webhooks::test))
        .merge(secrets::routes())
        .route("/volumes", post(volumes::create).get(volumes::list))
        .route(
            "/volumes/{volumeID}",
            get(volumes::get_one).delete(volumes::delete),
        )
        .route(&format!("{sbx}/logs"), get(s::logs))
        .route("/v2/sandboxes/{sandboxID}/logs", get(s::logs_v2))
        .route(&format!("{sbx}/pause"), post(s::pause))
        .route(&format!("{sbx}/resume"), post(s::resume))
        .route(&format!("{sbx}/fork"), post(s::fork))
        .route(&format!("{sbx}/snapshots"), post(s::snapshot))
        .route(&format!("{sbx}/network"), put(net_update::update))
        .route(&format!("{sbx}/audit"), get(audit::sandbox_audit))
        .route("/audit", get(audit::search))
        .route("/audit/verify", get(audit::verify))
        .route("/alerts", get(alerts::list))
        .route("/api-keys", get(keys::list).post(keys::create))
        .route("/api-keys/{apiKeyID}", axum::routing::delete(keys::revoke))
        .route("/teams", get(keys::teams))
        .route("/templates", get(templates::list_templates))
        .route("/snapshots", get(snapshots::list_snapshots))
        .route(
            "/templates/{templateID}",
            get(templates::get_template).delete(template_api::delete),
        )
        .merge(template_api::routes())
        .fallback(any(fallback))
        .method_not_allowed_fallback(method_not_allowed)
        // Innermost: bodies are read only once the key was checked.
        .layer(middleware::from_fn(crate::edge::limit_api_body))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            audit::record_api,
        ))
        .layer(middleware::from_fn_with_state(state.clone(), await_known))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ))
}

/// Routes that take no API key: template uploads (signed, single-use URLs), the
/// volume-content API (each volume's token; it streams its bodies) and the identity tokens'
/// public keys (`/.well-known/jwks.json`, OIDC discovery; public by design).
pub fn token_routes() -> Router<Arc<AppState>> {
    template_api::upload_routes()
        .merge(volume_content::routes())
        .merge(jwks::routes())
}
