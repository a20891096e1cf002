//! The front door's dispatch: what one HTTP request reaches once [`crate::edge`] has accepted
//! its connection (connection cap, TLS, header limits). Sandbox-addressed traffic goes to the
//! [`crate::proxy`] (through [`api::route_sandbox_traffic`]); the rest to one of three siblings
//! composed here — the REST API ([`api::routes`], behind the API-key check), the routes that
//! take no API key ([`api::token_routes`]: uploads, volume content, the JWKS) and the web console
//! under `/console` ([`crate::console::router`], which hands its `/console/api/` calls to the
//! API's own router).

use std::sync::Arc;

use axum::{middleware, Router};

use crate::api::{self, AppState};

/// The whole HTTP service of a server with `state`.
pub fn router(state: Arc<AppState>) -> Router {
    let api = api::routes(&state);
    let console = crate::console::router(state.clone(), api.clone().with_state(state.clone()));
    api.merge(api::token_routes())
        .nest_service("/console", console)
        .layer(middleware::from_fn_with_state(
            state.clone(),
            api::route_sandbox_traffic,
        ))
        .with_state(state)
}
