//! What the proxy records: operations on the agent's port (Connect RPCs of the process and
//! filesystem services, `/files` uploads and downloads) go on the sandbox's audit record, read
//! by [`crate::audit::tap::Tap`] from the request as it is sent and the answer as it streams.
//! Upgraded connections and the sandbox's other ports are not recorded.

use axum::body::Body;
use axum::response::Response;
use http::Uri;

use super::transport::{Head, Prepared};
use crate::audit::tap::Tap;
use crate::audit::AuditLog;

/// The record of a request to `port` of sandbox `id` (`None`: not recorded).
pub fn begin(log: &AuditLog, id: &str, port: u16, head: &Head, uri: &Uri) -> Option<Tap> {
    match port {
        kiln_proto::envd::ENVD_PORT if !head.upgrade => {
            Tap::begin(log, id, &head.method, uri, &head.headers)
        }
        _ => None,
    }
}

/// `body` on its way out: read now when buffered, watched as it streams otherwise.
pub fn request(tap: Option<&mut Tap>, body: Prepared) -> Prepared {
    match (tap, body) {
        (None, body) => body,
        (Some(t), Prepared::Buffered(bytes)) => {
            t.request(&bytes);
            Prepared::Buffered(bytes)
        }
        (Some(t), Prepared::Streamed(body)) => Prepared::Streamed(t.wrap_request(body)),
    }
}

/// The answer, recorded as it streams to the client.
pub async fn response(tap: Option<Tap>, resp: Response<Body>) -> Response<Body> {
    match tap {
        Some(t) => t.response(resp).await,
        None => resp,
    }
}
