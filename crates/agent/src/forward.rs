//! Forwarding to servers bound to localhost inside the sandbox, as E2B's agent does: kiln's
//! port routing reaches the sandbox's own address, so a server listening on 127.0.0.1 only
//! (`python3 -m http.server --bind 127.0.0.1 8000`) is refused there. kiln then asks the agent
//! `GET /kiln/forward?port=N` with `Upgrade: kiln-tcp`; the agent connects to 127.0.0.1:N and,
//! once that worked, answers 101 and relays bytes both ways.
//!
//! No access token is needed: the connection only reaches what a process inside the sandbox
//! could reach, and kiln's proxy applies its own checks (traffic access token) before asking.

use http::{header, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;

use crate::reply::api_error;
use crate::rpc::{self, Body};

/// Path of the forwarding endpoint.
pub const PATH: &str = "/kiln/forward";
/// The `Upgrade` protocol name.
pub const PROTOCOL: &str = "kiln-tcp";

fn port_of(query: Option<&str>) -> Option<u16> {
    query?
        .split('&')
        .find_map(|kv| kv.strip_prefix("port="))
        .and_then(|p| p.parse().ok())
        .filter(|p| *p != 0)
}

/// Handles `GET /kiln/forward?port=N`.
pub async fn handle(req: Request<Incoming>) -> Response<Body> {
    let Some(port) = port_of(req.uri().query()) else {
        return api_error(StatusCode::BAD_REQUEST, "expected ?port=N (1-65535)");
    };
    let upgrade_ok = req
        .headers()
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case(PROTOCOL));
    if !upgrade_ok {
        return api_error(
            StatusCode::BAD_REQUEST,
            format!("expected `Upgrade: {PROTOCOL}`"),
        );
    }
    let target = match tokio::net::TcpStream::connect(("127.0.0.1", port)).await {
        Ok(s) => s,
        Err(e) => {
            return api_error(
                StatusCode::BAD_GATEWAY,
                format!("nothing is listening on 127.0.0.1:{port} in the sandbox ({e})"),
            )
        }
    };
    let _ = target.set_nodelay(true);
    crate::control::spawn_upgraded(async move {
        match hyper::upgrade::on(req).await {
            Ok(up) => {
                let mut up = TokioIo::new(up);
                let mut target = target;
                let _ = tokio::io::copy_bidirectional(&mut up, &mut target).await;
            }
            Err(e) => tracing::debug!("forward upgrade failed: {e}"),
        }
    });
    Response::builder()
        .status(StatusCode::SWITCHING_PROTOCOLS)
        .header(header::CONNECTION, "upgrade")
        .header(header::UPGRADE, PROTOCOL)
        .body(rpc::empty())
        .expect("valid response")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_parsed_from_the_query() {
        assert_eq!(port_of(Some("port=8000")), Some(8000));
        assert_eq!(port_of(Some("x=1&port=22")), Some(22));
        for bad in [
            None,
            Some(""),
            Some("port=0"),
            Some("port=70000"),
            Some("port=x"),
        ] {
            assert_eq!(port_of(bad), None, "{bad:?}");
        }
    }
}
