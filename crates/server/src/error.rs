//! The API's error type and its JSON shape (`{"code": <status>, "message": "…"}`, as E2B's API).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

/// JSON body of every error the REST API and the envd proxy answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub code: u16,
    pub message: String,
}

/// An error answered to an HTTP client: a status plus a message meant for humans.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{status}: {message}")]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }
    pub fn bad_request(m: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, m)
    }
    pub fn unauthorized(m: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, m)
    }
    pub fn not_found(m: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, m)
    }
    pub fn conflict(m: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, m)
    }
    pub fn internal(m: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, m)
    }
    pub fn bad_gateway(m: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_GATEWAY, m)
    }
    /// 501 naming the feature kiln does not implement yet.
    pub fn not_implemented(feature: &str) -> Self {
        Self::new(
            StatusCode::NOT_IMPLEMENTED,
            format!("{feature} is not implemented in kiln yet"),
        )
    }
    pub fn sandbox_not_found(id: &str) -> Self {
        Self::not_found(format!("sandbox \"{id}\" not found"))
    }

    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            code: self.status.as_u16(),
            message: self.message.clone(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::warn!(status = %self.status, message = %self.message, "request failed");
        }
        (self.status, axum::Json(self.body())).into_response()
    }
}

impl From<crate::store::StoreError> for ApiError {
    fn from(e: crate::store::StoreError) -> Self {
        ApiError::internal(format!("state database: {e}"))
    }
}

impl From<crate::driver::DriverError> for ApiError {
    fn from(e: crate::driver::DriverError) -> Self {
        use crate::driver::DriverError as D;
        match &e {
            D::NotImplemented(what) => ApiError::not_implemented(what),
            D::NotFound(id) => ApiError::sandbox_not_found(id),
            _ => ApiError::internal(e.to_string()),
        }
    }
}
