//! A byte tunnel from a control replica to one port of a sandbox this node runs: an HTTP/1.1
//! `GET …/ports/{port}/tunnel` with `Upgrade: kiln-tunnel`, answered `101` once the port is
//! reached (through the same `open_route` the one-host proxy uses: auto-resume, wake from
//! standby, the in-use guard), then spliced both ways until either side closes or the node's
//! lease is gone.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use hyper_util::rt::TokioIo;
use kiln_server::manager::NoRoute;
use kiln_server::ApiError;

use super::NodeApi;
use crate::wire::TUNNEL_PROTOCOL;

pub(super) async fn open(
    State(n): State<Arc<NodeApi>>,
    Path((id, port)): Path<(String, u16)>,
    mut req: Request,
) -> Response {
    let asks_tunnel = req.headers().get(header::UPGRADE).is_some_and(|v| {
        v.as_bytes()
            .eq_ignore_ascii_case(TUNNEL_PROTOCOL.as_bytes())
    });
    if !asks_tunnel {
        return ApiError::bad_request(format!("a tunnel needs Upgrade: {TUNNEL_PROTOCOL}"))
            .into_response();
    }
    let route = match n.service.open_route(&id, port).await {
        Ok(r) => r,
        Err(NoRoute::NotFound) => return ApiError::sandbox_not_found(&id).into_response(),
        Err(NoRoute::Paused) => {
            return ApiError::conflict(format!("sandbox \"{id}\" is paused")).into_response()
        }
        Err(NoRoute::WakeFailed) => {
            return ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("sandbox \"{id}\" could not be woken"),
            )
            .into_response()
        }
        Err(NoRoute::Unavailable(why)) => {
            return ApiError::new(StatusCode::SERVICE_UNAVAILABLE, why).into_response()
        }
    };
    let mut inner = match route.client.connect_raw().await {
        Ok(s) => s,
        Err(e) => {
            tracing::debug!(sandbox = %id, port, error = %e, "tunnel: the port is unreachable");
            return ApiError::bad_gateway(format!(
                "port {port} of sandbox \"{id}\" is unreachable"
            ))
            .into_response();
        }
    };
    let upgrade = hyper::upgrade::on(&mut req);
    let mut alive = n.alive.clone();
    tokio::spawn(async move {
        let _in_use = route.in_use;
        let Ok(up) = upgrade.await else { return };
        let mut up = TokioIo::new(up);
        tokio::select! {
            _ = tokio::io::copy_bidirectional(&mut up, &mut inner) => {}
            _ = alive.wait_for(|a| !*a) => {}
        }
    });
    Response::builder()
        .status(StatusCode::SWITCHING_PROTOCOLS)
        .header(header::CONNECTION, "upgrade")
        .header(header::UPGRADE, TUNNEL_PROTOCOL)
        .body(Body::empty())
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}
