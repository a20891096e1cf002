//! Connect protocol facts (https://connectrpc.com/docs/protocol): error codes with their HTTP
//! statuses (both directions), envelope flags and the error bodies. Envelope encoding and
//! decoding live in [`crate::framing`].

use serde::{Deserialize, Serialize};

/// Envelope flag: the message is compressed (kiln never compresses).
pub const FLAG_COMPRESSED: u8 = 0x01;
/// Envelope flag: this is the end-of-stream message (JSON, always).
pub const FLAG_END_STREAM: u8 = 0x02;

/// Connect error codes (serialized in snake_case as on the wire).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Code {
    Canceled,
    Unknown,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Aborted,
    OutOfRange,
    Unimplemented,
    Internal,
    Unavailable,
    DataLoss,
    Unauthenticated,
}

impl Code {
    /// HTTP status used for a unary error response with this code.
    pub fn http_status(self) -> u16 {
        match self {
            Code::Canceled => 499,
            Code::Unknown => 500,
            Code::InvalidArgument => 400,
            Code::DeadlineExceeded => 504,
            Code::NotFound => 404,
            Code::AlreadyExists => 409,
            Code::PermissionDenied => 403,
            Code::ResourceExhausted => 429,
            Code::FailedPrecondition => 400,
            Code::Aborted => 409,
            Code::OutOfRange => 400,
            Code::Unimplemented => 501,
            Code::Internal => 500,
            Code::Unavailable => 503,
            Code::DataLoss => 500,
            Code::Unauthenticated => 401,
        }
    }

    /// The code a client infers from the HTTP status of a unary answer without a Connect error
    /// body (the protocol's HTTP-to-code table).
    pub fn from_http_status(status: u16) -> Code {
        match status {
            400 => Code::Internal,
            401 => Code::Unauthenticated,
            403 => Code::PermissionDenied,
            404 => Code::Unimplemented,
            429 | 502 | 503 | 504 => Code::Unavailable,
            _ => Code::Unknown,
        }
    }

    /// Parses a wire name (`not_found`, …).
    pub fn parse(s: &str) -> Option<Code> {
        serde_json::from_value(serde_json::Value::String(s.to_string())).ok()
    }

    /// Wire name (`not_found`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::Unknown => "unknown",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Aborted => "aborted",
            Code::OutOfRange => "out_of_range",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::DataLoss => "data_loss",
            Code::Unauthenticated => "unauthenticated",
        }
    }
}

impl std::fmt::Display for Code {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A Connect error as carried in a unary error body or an end-stream message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub code: Code,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
}

impl ErrorBody {
    /// The error of a failed unary call: its Connect JSON body when it has one, else a code
    /// derived from the HTTP status with the body text as the message.
    pub fn from_unary(status: u16, body: &[u8]) -> ErrorBody {
        if let Ok(e) = serde_json::from_slice::<ErrorBody>(body) {
            return e;
        }
        ErrorBody {
            code: Code::from_http_status(status),
            message: String::from_utf8_lossy(body).trim().to_string(),
        }
    }
}

/// The JSON end-of-stream message of a streaming response.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct EndStream {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorBody>,
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [Code; 16] = [
        Code::Canceled,
        Code::Unknown,
        Code::InvalidArgument,
        Code::DeadlineExceeded,
        Code::NotFound,
        Code::AlreadyExists,
        Code::PermissionDenied,
        Code::ResourceExhausted,
        Code::FailedPrecondition,
        Code::Aborted,
        Code::OutOfRange,
        Code::Unimplemented,
        Code::Internal,
        Code::Unavailable,
        Code::DataLoss,
        Code::Unauthenticated,
    ];

    #[test]
    fn wire_names_round_trip() {
        for c in ALL {
            assert_eq!(Code::parse(c.as_str()), Some(c));
            assert_eq!(serde_json::to_value(c).unwrap(), c.as_str());
        }
        assert_eq!(Code::parse("nope"), None);
    }

    #[test]
    fn http_status_mapping_both_ways() {
        assert_eq!(Code::NotFound.http_status(), 404);
        assert_eq!(Code::Unauthenticated.http_status(), 401);
        assert_eq!(Code::Unimplemented.http_status(), 501);
        assert_eq!(Code::from_http_status(401), Code::Unauthenticated);
        assert_eq!(Code::from_http_status(403), Code::PermissionDenied);
        assert_eq!(Code::from_http_status(404), Code::Unimplemented);
        assert_eq!(Code::from_http_status(503), Code::Unavailable);
        assert_eq!(Code::from_http_status(418), Code::Unknown);
    }

    #[test]
    fn unary_error_body_or_status_fallback() {
        let e = ErrorBody::from_unary(404, br#"{"code":"not_found","message":"gone"}"#);
        assert_eq!((e.code, e.message.as_str()), (Code::NotFound, "gone"));
        let e = ErrorBody::from_unary(503, b"upstream down\n");
        assert_eq!(
            (e.code, e.message.as_str()),
            (Code::Unavailable, "upstream down")
        );
    }
}
