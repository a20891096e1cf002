//! The REST API: the routes and JSON shapes of E2B's API that the `e2b` SDK uses, API-key
//! auth, and in front of it the entry point that sends sandbox-addressed traffic to the proxy.
//!
//! - [`wire`]: JSON shapes; [`error`]: the error answer and the status mapping;
//! - [`sandboxes`], [`list`], [`templates`], [`snapshots`]: handlers (each a call into the
//!   manager).

mod audit;
mod error;
mod list;
mod network;
mod sandboxes;
mod snapshots;
mod templates;
pub mod wire;

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post, put};
use axum::Router;

pub use error::{ApiError, ApiErrorBody};
pub use list::parse_metadata_filter;

use crate::auth;
use crate::manager::Manager;
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
];

/// Server-wide settings the API needs.
#[derive(Debug, Clone)]
pub struct ApiConfig {
    /// Domain of sandbox host names (`{port}-{id}.{domain}`).
    pub domain: String,
}

pub struct AppState {
    pub manager: Arc<Manager>,
    pub cfg: ApiConfig,
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

async fn require_api_key(State(st): St, mut req: Request, next: Next) -> Response {
    let path = req.uri().path();
    if path == "/health" || path == "/openapi.json" {
        return next.run(req).await;
    }
    let headers: &HeaderMap = req.headers();
    let key = headers
        .get(auth::API_KEY_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .or_else(|| {
            headers
                .get(axum::http::header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
                .map(str::to_string)
        });
    match st.manager.authenticate(key.as_deref()).await {
        Ok(Ok(key_id)) => {
            req.extensions_mut().insert(audit::KeyId(key_id));
            next.run(req).await
        }
        Ok(Err(e)) => ApiError::unauthorized(e.to_string()).into_response(),
        Err(e) => ApiError::from(e).into_response(),
    }
}

async fn route_sandbox_traffic(State(st): St, req: Request, next: Next) -> Response {
    match routing::target_of(req.headers(), &st.cfg.domain) {
        Ok(Some(target)) => crate::proxy::forward(&st.manager, target, req).await,
        Ok(None) => next.run(req).await,
        Err(e) => ApiError::bad_request(e.to_string()).into_response(),
    }
}

/// After a restart, a request naming a sandbox recovery has not reached yet waits for it
/// (bounded) instead of answering 404.
async fn await_recovery(State(st): St, req: Request, next: Next) -> Response {
    if st.manager.recovering() > 0 {
        let mut seg = req.uri().path().split('/');
        if seg.any(|s| s == "sandboxes") {
            if let Some(id) = seg.next().filter(|s| !s.is_empty()) {
                st.manager.wait_adopted(id).await;
            }
        }
    }
    next.run(req).await
}

/// The whole HTTP service: envd proxy in front, then auth, then the API routes.
pub fn router(state: Arc<AppState>) -> Router {
    use sandboxes as s;
    let sbx = "/sandboxes/{sandboxID}";
    let api = Router::new()
        .route("/health", get(health))
        .route("/openapi.json", get(openapi))
        .route("/sandboxes", post(s::create_sandbox).get(list::list_v1))
        .route("/v2/sandboxes", post(s::create_sandbox).get(list::list_v2))
        .route("/sandboxes/metrics", get(s::bulk_metrics))
        .route(sbx, get(s::get_sandbox).delete(s::kill_sandbox))
        .route(&format!("{sbx}/timeout"), post(s::set_timeout))
        .route(&format!("{sbx}/connect"), post(s::connect))
        .route("/v2/sandboxes/{sandboxID}/connect", post(s::connect))
        .route(&format!("{sbx}/refreshes"), post(s::refresh))
        .route(&format!("{sbx}/metrics"), get(s::metrics))
        .route(&format!("{sbx}/logs"), get(s::logs))
        .route("/v2/sandboxes/{sandboxID}/logs", get(s::logs_v2))
        .route(&format!("{sbx}/pause"), post(s::pause))
        .route(&format!("{sbx}/resume"), post(s::resume))
        .route(&format!("{sbx}/fork"), post(s::fork))
        .route(&format!("{sbx}/snapshots"), post(s::snapshot))
        .route(&format!("{sbx}/network"), put(network::update))
        .route(&format!("{sbx}/audit"), get(audit::sandbox_audit))
        .route("/audit", get(audit::search))
        .route("/audit/verify", get(audit::verify))
        .route("/templates", get(templates::list_templates))
        .route("/snapshots", get(snapshots::list_snapshots))
        .route(
            "/templates/{templateID}",
            get(templates::get_template).delete(snapshots::delete_template),
        )
        .fallback(any(fallback))
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(
            state.clone(),
            audit::record_api,
        ))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            await_recovery,
        ))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ));
    api.layer(middleware::from_fn_with_state(
        state.clone(),
        route_sandbox_traffic,
    ))
    .with_state(state)
}
