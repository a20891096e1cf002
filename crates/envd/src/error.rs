//! Errors of the envd client. Their messages never name the connector's target (it may be a host
//! path); the client logs that with `tracing` instead.

use std::time::Duration;

use http::StatusCode;
use kiln_proto::connect::Code;

/// Everything an [`EnvdClient`](crate::EnvdClient) call can fail with.
#[derive(Debug, thiserror::Error)]
pub enum EnvdError {
    #[error("cannot connect to envd: {source}")]
    Connect {
        #[source]
        source: std::io::Error,
    },
    #[error("HTTP exchange with envd failed: {0}")]
    Http(#[from] hyper::Error),
    #[error("envd answered HTTP {status}: {message}")]
    Status { status: u16, message: String },
    #[error("envd RPC failed with {code}: {message}")]
    Rpc { code: String, message: String },
    #[error("envd did not answer within {0:?}")]
    Timeout(Duration),
    #[error("cannot decode the envd response: {0}")]
    Decode(String),
    #[error("invalid request: {0}")]
    Invalid(String),
}

impl EnvdError {
    /// The Connect code (`not_found`, …) of an RPC error, if this is one.
    pub fn rpc_code(&self) -> Option<&str> {
        match self {
            EnvdError::Rpc { code, .. } => Some(code),
            _ => None,
        }
    }

    /// The connection could not be opened (envd not running or not listening yet).
    pub fn is_connect(&self) -> bool {
        matches!(self, EnvdError::Connect { .. })
    }

    pub(crate) fn rpc(code: Code, message: String) -> Self {
        EnvdError::Rpc {
            code: code.as_str().to_string(),
            message,
        }
    }
}

impl From<http::Error> for EnvdError {
    fn from(e: http::Error) -> Self {
        EnvdError::Invalid(e.to_string())
    }
}

/// The error of a non-2xx answer: a Connect error body (string `code`) becomes
/// [`EnvdError::Rpc`], envd's HTTP API error (numeric `code`) or any other body
/// [`EnvdError::Status`].
pub(crate) fn http_error(status: StatusCode, body: &[u8]) -> EnvdError {
    #[derive(serde::Deserialize)]
    struct AnyErr {
        code: serde_json::Value,
        #[serde(default)]
        message: String,
    }
    match serde_json::from_slice::<AnyErr>(body) {
        Ok(AnyErr {
            code: serde_json::Value::String(code),
            message,
        }) => EnvdError::Rpc { code, message },
        Ok(AnyErr { message, .. }) => EnvdError::Status {
            status: status.as_u16(),
            message,
        },
        Err(_) => EnvdError::Status {
            status: status.as_u16(),
            message: String::from_utf8_lossy(body).into_owned(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_bodies_map_to_variants() {
        let e = http_error(
            StatusCode::NOT_FOUND,
            br#"{"code":"not_found","message":"x"}"#,
        );
        assert_eq!(e.rpc_code(), Some("not_found"));
        let e = http_error(
            StatusCode::BAD_REQUEST,
            br#"{"code":400,"message":"bad path"}"#,
        );
        assert!(
            matches!(e, EnvdError::Status { status: 400, ref message } if message == "bad path")
        );
        let e = http_error(StatusCode::BAD_GATEWAY, b"oops");
        assert!(matches!(e, EnvdError::Status { status: 502, ref message } if message == "oops"));
        assert!(!e.is_connect());
    }

    #[test]
    fn connect_error_hides_the_target() {
        let e = EnvdError::Connect {
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        };
        assert!(e.is_connect());
        assert!(!e.to_string().contains('/'), "{e}");
    }
}
