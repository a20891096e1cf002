//! The workload identity issuer's public side, without auth: `GET /.well-known/jwks.json`
//! (the key tokens are signed with, for an upstream to verify them) and
//! `GET /.well-known/openid-configuration` (OIDC discovery naming the issuer and the JWKS,
//! for verifiers that start there). See [`crate::identity`].

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::json;

use super::{ApiError, St};

fn issuer(st: &super::AppState) -> Result<&crate::identity::Issuer, ApiError> {
    st.identity
        .as_deref()
        .ok_or_else(|| ApiError::not_implemented("workload identity (no identity key)"))
}

async fn jwks(State(st): St) -> Result<Response, ApiError> {
    let keys = issuer(&st)?.jwks();
    Ok(([(header::CACHE_CONTROL, "public, max-age=300")], Json(keys)).into_response())
}

async fn discovery(State(st): St) -> Result<Json<serde_json::Value>, ApiError> {
    let i = issuer(&st)?;
    Ok(Json(json!({
        "issuer": i.issuer,
        "jwks_uri": format!("{}/.well-known/jwks.json", i.issuer),
        "response_types_supported": ["id_token"],
        "subject_types_supported": ["public"],
        "id_token_signing_alg_values_supported": ["ES256"],
    })))
}

pub fn routes() -> Router<std::sync::Arc<super::AppState>> {
    Router::new()
        .route("/.well-known/jwks.json", get(jwks))
        .route("/.well-known/openid-configuration", get(discovery))
}
