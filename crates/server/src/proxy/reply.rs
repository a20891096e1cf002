//! The proxy's own answers: E2B's error shape (`code`, `message`, `sandboxId`).

use axum::response::{IntoResponse, Response};
use http::StatusCode;
use serde_json::json;

use super::access::Refused;
use crate::manager::NoRoute;

/// An error answer about sandbox `sandbox_id`.
pub fn error(status: StatusCode, sandbox_id: &str, message: String) -> Response {
    (
        status,
        axum::Json(json!({
            "code": status.as_u16(),
            "message": message,
            "sandboxId": sandbox_id,
        })),
    )
        .into_response()
}

/// The answer when sandbox `id` takes no traffic.
pub fn no_route(id: &str, why: NoRoute) -> Response {
    match why {
        NoRoute::WakeFailed => error(
            StatusCode::SERVICE_UNAVAILABLE,
            id,
            format!("The sandbox {id} could not be woken from standby; retry"),
        ),
        NoRoute::Paused => error(
            StatusCode::BAD_GATEWAY,
            id,
            format!("The sandbox {id} is paused: connect to it to resume it"),
        ),
        NoRoute::NotFound => error(
            StatusCode::BAD_GATEWAY,
            id,
            format!("The sandbox {id} was not found: it does not exist, was killed or timed out"),
        ),
        NoRoute::Unavailable(why) => error(StatusCode::SERVICE_UNAVAILABLE, id, why),
    }
}

/// The answer to a request [`super::access`] refused.
pub fn refused(id: &str, why: Refused) -> Response {
    match why {
        Refused::Private(port) => error(
            StatusCode::FORBIDDEN,
            id,
            format!(
                "port {port} of this sandbox is private: send its traffic access token \
                 in the e2b-traffic-access-token header"
            ),
        ),
        Refused::NoEnvdToken => error(
            StatusCode::UNAUTHORIZED,
            id,
            "missing or invalid envd access token (X-Access-Token)".into(),
        ),
        Refused::Internal(path) => error(StatusCode::NOT_FOUND, id, format!("no route for {path}")),
    }
}

/// The answer when the client's request body cannot be read.
pub fn body_error(id: &str, e: axum::Error) -> Response {
    error(
        StatusCode::BAD_REQUEST,
        id,
        format!("reading the request body: {e}"),
    )
}

/// The answer when the forwarded request cannot be built.
pub fn bad_request(id: &str, e: http::Error) -> Response {
    error(StatusCode::BAD_REQUEST, id, format!("bad request: {e}"))
}
