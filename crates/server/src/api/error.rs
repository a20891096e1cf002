//! The API's error answer: a status plus a message meant for humans, as JSON
//! `{"code": <status>, "message": "…"}` (E2B's shape), and the one mapping from the server's
//! typed [`Error`] to HTTP statuses.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

use crate::driver::DriverError;
use crate::error::{redact_host_paths, Error};
use crate::templates::TemplateError;

/// JSON body of every error the REST API and the envd proxy answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApiErrorBody {
    pub code: u16,
    pub message: String,
}

/// An error answered to an HTTP client: a status plus a message meant for humans.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{status}: {message}")]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// Sent as `Retry-After` (seconds) when set.
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            retry_after: None,
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

    pub fn body(&self) -> ApiErrorBody {
        ApiErrorBody {
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
        let mut resp = (self.status, axum::Json(self.body())).into_response();
        if let Some(secs) = self.retry_after {
            resp.headers_mut()
                .insert(axum::http::header::RETRY_AFTER, secs.into());
        }
        resp
    }
}

impl From<Error> for ApiError {
    fn from(e: Error) -> Self {
        let status = status_of(e.cause());
        let text = e.to_string();
        if status.is_server_error() {
            // The full text (host paths included) stays in the server log.
            tracing::warn!(status = %status, error = %text, "request failed");
        }
        let mut a = ApiError::new(status, redact_host_paths(&text));
        if let Error::Capacity {
            retry_after_secs, ..
        } = e.cause()
        {
            a.retry_after = Some(*retry_after_secs);
        }
        a
    }
}

/// The HTTP status of an error's root cause.
fn status_of(e: &Error) -> StatusCode {
    match e {
        Error::BadRequest(_) => StatusCode::BAD_REQUEST,
        Error::SandboxNotFound(_) | Error::NotFound(_) => StatusCode::NOT_FOUND,
        Error::Conflict(_) => StatusCode::CONFLICT,
        Error::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
        Error::Limit(_) => StatusCode::TOO_MANY_REQUESTS,
        Error::Capacity { quota: true, .. } => StatusCode::TOO_MANY_REQUESTS,
        Error::Capacity { quota: false, .. } => StatusCode::SERVICE_UNAVAILABLE,
        Error::Template(TemplateError::InvalidName(_)) => StatusCode::BAD_REQUEST,
        Error::Driver(d) => match d {
            DriverError::NotImplemented(_) | DriverError::Unavailable { .. } => {
                StatusCode::NOT_IMPLEMENTED
            }
            DriverError::NotFound(_) => StatusCode::NOT_FOUND,
            DriverError::InvalidId(_) => StatusCode::BAD_REQUEST,
            DriverError::Unreachable { .. } => StatusCode::BAD_GATEWAY,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        },
        Error::Agent(_) => StatusCode::BAD_GATEWAY,
        Error::Create { source, .. } => status_of(source),
        Error::Store(_) | Error::Template(_) | Error::Internal(_) => {
            StatusCode::INTERNAL_SERVER_ERROR
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn driver_errors_keep_their_meaning() {
        let cases = [
            (
                Error::Driver(DriverError::NotImplemented("pausing sandboxes")),
                501,
            ),
            (Error::Driver(DriverError::NotFound("x".into())), 404),
            (
                Error::create("starting the sandbox")(Error::Driver(DriverError::NotImplemented(
                    "x",
                ))),
                501,
            ),
            (Error::SandboxNotFound("abc".into()), 404),
            (Error::bad_request("no"), 400),
            (Error::Conflict("already paused".into()), 409),
            (
                Error::Template(TemplateError::InvalidName("/etc".into())),
                400,
            ),
        ];
        for (e, want) in cases {
            let text = e.to_string();
            assert_eq!(ApiError::from(e).status.as_u16(), want, "{text}");
        }
    }

    #[test]
    fn internal_errors_do_not_show_host_paths() {
        let e = Error::Driver(DriverError::Io {
            what: "mounting the sandbox overlay at /var/lib/kiln/state/gvisor/sandboxes/x/rootfs"
                .into(),
            source: std::io::Error::from_raw_os_error(1),
        });
        let a = ApiError::from(e);
        assert_eq!(a.status.as_u16(), 500);
        assert!(!a.message.contains("/var/lib"), "{}", a.message);
        assert!(a.message.contains("<host path>"), "{}", a.message);
    }
}
