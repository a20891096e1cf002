//! The sandbox proxy: forwards sandbox-addressed requests to a port inside the sandbox through
//! the driver's [`connect`](crate::driver::Driver::connect), streaming bodies both ways and
//! passing WebSocket/HTTP upgrades through. A request passes, in order:
//!
//! - the lifecycle's [`open_route`](crate::manager::SandboxService::open_route), one call: the sandbox
//!   settled by recovery, resumed or woken, its port's client, tokens and ingress settings,
//!   the guard that keeps it awake and the audit log;
//! - `access`: the envd access token on the agent's port, the traffic access token on the
//!   others, the server's private `/kiln/` paths;
//! - `rewrite`: the headers the sandbox sees (and the answer's hop-by-hop headers dropped);
//! - `tap`: the audit record of operations on the agent's port;
//! - `transport`: HTTP/1.1 buffered (retried once) or streamed, h2c for gRPC, upgrades
//!   spliced;
//! - `reply`: the proxy's own answers when it cannot forward.

mod access;
mod reply;
mod rewrite;
mod tap;
mod transport;

use axum::body::Body;
use axum::response::Response;
use http::{Request, StatusCode};

use crate::manager::{PortRoute, SandboxService};
use crate::routing::Target;

pub use access::constant_time_eq;
pub use access::{ACCESS_TOKEN_HEADER, TRAFFIC_TOKEN_HEADER};

/// Forwards `req` to `target`.
pub async fn forward(
    manager: &dyn SandboxService,
    target: Target,
    mut req: Request<Body>,
) -> Response {
    let (id, port) = (target.sandbox_id.as_str(), target.port);
    let PortRoute {
        route,
        client,
        in_use,
        audit,
    } = match manager.open_route(id, port).await {
        Ok(r) => r,
        Err(why) => return reply::no_route(id, why),
    };
    if let Err(why) = access::check(&route, port, req.headers(), req.uri()) {
        return reply::refused(id, why);
    }
    let upgrade = rewrite::wants_upgrade(req.headers());
    let client_upgrade = upgrade.as_ref().map(|_| hyper::upgrade::on(&mut req));
    let scheme = match req.extensions().get::<crate::edge::Https>() {
        Some(_) => "https",
        None => "http",
    };
    let (parts, body) = req.into_parts();
    let out = rewrite::Outgoing {
        port,
        ingress: &route.ingress,
        scheme,
        upgrade: upgrade.as_ref(),
    };
    let head = transport::Head {
        grpc: transport::is_grpc(parts.version, &parts.headers, upgrade.is_some()),
        upgrade: upgrade.is_some(),
        headers: rewrite::request_headers(parts.headers, &parts.uri, &out),
        path: parts
            .uri
            .path_and_query()
            .map(|p| p.as_str())
            .unwrap_or("/")
            .to_string(),
        method: parts.method,
    };
    let mut tap = tap::begin(&audit, id, port, &head, &parts.uri);
    let body = match transport::prepare(body, &head, port).await {
        Ok(b) => tap::request(tap.as_mut(), b),
        Err(e) => return reply::body_error(id, e),
    };
    let resp = match transport::send(&client, &head, body, id).await {
        Ok(r) => r,
        Err(transport::Failed::Build(e)) => return reply::bad_request(id, e),
        Err(transport::Failed::Unreachable(e)) => {
            return reply::error(
                StatusCode::BAD_GATEWAY,
                id,
                crate::error::redact_host_paths(&format!(
                    "cannot reach port {port} of sandbox {id}: {e}"
                )),
            )
        }
    };
    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        return transport::splice(resp, client_upgrade, in_use);
    }
    let (mut parts, body) = resp.into_parts();
    rewrite::strip_hop_by_hop(&mut parts.headers);
    let resp = Response::from_parts(parts, transport::held_body(body, in_use));
    tap::response(tap, resp).await
}
