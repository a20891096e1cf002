//! The plain HTTP API's responses (everything outside the Connect services): JSON bodies and
//! JSON errors in envd's `{code, message}` shape.

use http::{header, Response, StatusCode};
use kiln_proto::envd::ApiError;

use crate::rpc::{self, Body};

/// JSON error of the plain HTTP API.
pub fn api_error(status: StatusCode, message: impl Into<String>) -> Response<Body> {
    let body = serde_json::to_vec(&ApiError {
        code: status.as_u16(),
        message: message.into(),
    })
    .unwrap_or_default();
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .body(rpc::full(body))
        .expect("valid response")
}

pub fn json_response<T: serde::Serialize>(v: &T) -> Response<Body> {
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/json")
        .body(rpc::full(serde_json::to_vec(v).unwrap_or_default()))
        .expect("valid response")
}
