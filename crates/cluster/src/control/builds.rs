//! Template builds through a control replica. The cluster's builds run on one node, its
//! **build node** (started with `kiln node --template-builds`; the first live one by name
//! when several are): the replica checks the API key and forwards E2B's Template API there as
//! it comes ([`forward_builds`]: the request streamed both ways, the caller's team and key id
//! in headers), so a team's templates, builds, tags and layers live on that node. A create
//! naming a template the team built there runs there, from its last layer
//! ([`ClusterService::built_home`]).

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use kiln_server::api::AppState;
use kiln_server::{ApiError, Error};

use super::service::ClusterService;
use crate::nodes::NodeInfo;
use crate::wire::BuiltQuery;

type Result<T, E = Error> = std::result::Result<T, E>;

impl ClusterService {
    /// The node that runs the cluster's template builds: the first live one (by name)
    /// started with `--template-builds`.
    pub(super) fn build_node(&self) -> Option<NodeInfo> {
        let mut nodes: Vec<NodeInfo> = self
            .cache
            .nodes()
            .into_iter()
            .filter(|n| n.builds)
            .collect();
        nodes.sort_by(|a, b| a.name.cmp(&b.name));
        nodes.into_iter().next()
    }

    /// The build node, when `team` built a template named `template` there (a create of it
    /// runs there).
    pub(super) async fn built_home(&self, team: &str, template: &str) -> Result<Option<NodeInfo>> {
        let Some(node) = self.build_node() else {
            return Ok(None);
        };
        let q = BuiltQuery {
            team: team.to_string(),
            template: template.to_string(),
        };
        // An unreachable build node holds up no create of another template.
        match self.nodes.built(&node.address, &q).await {
            Ok(built) => Ok(built.then_some(node)),
            Err(e) => {
                tracing::warn!(node = %node.name, error = %e,
                    "asking the build node whether a create names a built template");
                Ok(None)
            }
        }
    }
}

/// Whether `method path` is a route of E2B's Template API (those the build node answers).
fn is_build_route(method: &Method, path: &str) -> bool {
    let s: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let (get, post) = (method == Method::GET, method == Method::POST);
    match s.as_slice() {
        ["v3", "templates"] => post,
        ["templates", _, "files", _] => get,
        ["v2", "templates", _, "builds", _] => post,
        ["templates", _, "builds", _, "status" | "logs"] => get,
        ["templates", "tags"] => post || method == Method::DELETE,
        ["templates", "aliases", _] => get,
        ["templates", _, "tags"] => get,
        ["templates", _, "tags", "count" | "exists" | "groups"] => get,
        ["templates", _, "tags", _, "assignments"] => get,
        ["template-builds", "gc"] => post,
        ["v2", "templates"] => get,
        ["v2", "templates", _] => method == Method::PATCH,
        ["default-templates"] => get,
        ["templates", _] => method == Method::DELETE,
        _ => false,
    }
}

/// What the replica's Template API forwarding needs.
pub struct BuildGate {
    pub state: Arc<AppState>,
    pub service: Arc<ClusterService>,
    /// The sandbox domain (a request to a sandbox's port is never the Template API).
    pub domain: Arc<str>,
}

/// The middleware (its state: the gate) answering the Template API and its upload URLs by
/// forwarding them to the build node; everything else goes on. A `DELETE /templates/{id}`
/// the build node does not know (not a built template) goes on too: it deletes a snapshot.
pub async fn forward_builds(State(g): State<Arc<BuildGate>>, req: Request, next: Next) -> Response {
    let path = req.uri().path().to_string();
    let upload = path.starts_with(&format!(
        "{}/",
        kiln_server::api::template_api::UPLOAD_PREFIX
    ));
    if (!upload && !is_build_route(req.method(), &path))
        || super::unavailable::to_a_sandbox(&req, &g.domain)
    {
        return next.run(req).await;
    }
    let deleting = req.method() == Method::DELETE
        && matches!(
            path.trim_start_matches('/').split('/').collect::<Vec<_>>().as_slice(),
            ["templates", id] if *id != "tags"
        );
    let caller = if upload {
        None
    } else {
        match kiln_server::auth::verify(
            g.state.access.as_ref(),
            kiln_server::auth::presented_key(req.headers()).as_deref(),
        )
        .await
        {
            Ok(Ok(c)) => Some(c),
            Ok(Err(e)) => return ApiError::unauthorized(e.to_string()).into_response(),
            Err(e) => return ApiError::from(Error::from(e)).into_response(),
        }
    };
    let Some(node) = g.service.build_node() else {
        if deleting {
            return next.run(req).await;
        }
        return ApiError::new(
            StatusCode::NOT_IMPLEMENTED,
            "template builds on a kiln cluster run on a node started with `kiln node \
             --template-builds`, and no such node is in the cluster now",
        )
        .into_response();
    };
    let path_q = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or(path);
    let host = kiln_server::routing::request_host(req.headers(), req.uri()).map(str::to_string);
    if deleting {
        // Without a body: the request itself goes on if the build node has no such template.
        let answer = g
            .service
            .nodes
            .forward_api(
                &node.address,
                req.method().clone(),
                &path_q,
                caller.as_ref(),
                host.as_deref(),
                req.headers(),
                reqwest::Body::from(Vec::new()),
            )
            .await;
        return match answer {
            Ok(r) if r.status().as_u16() == 404 => next.run(req).await,
            Ok(r) => relay(r),
            Err(e) => ApiError::from(e).into_response(),
        };
    }
    let (parts, body) = req.into_parts();
    let body = reqwest::Body::wrap_stream(body.into_data_stream());
    match g
        .service
        .nodes
        .forward_api(
            &node.address,
            parts.method,
            &path_q,
            caller.as_ref(),
            host.as_deref(),
            &parts.headers,
            body,
        )
        .await
    {
        Ok(r) => relay(r),
        Err(e) => ApiError::from(e).into_response(),
    }
}

/// A node's answer as the replica's, its body streamed.
pub(super) fn relay(r: reqwest::Response) -> Response {
    let status = StatusCode::from_u16(r.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let mut out = Response::builder().status(status);
    for h in [
        header::CONTENT_TYPE,
        header::CONTENT_LENGTH,
        header::CONTENT_DISPOSITION,
        header::LOCATION,
    ] {
        if let Some(v) = r.headers().get(&h) {
            out = out.header(h, v);
        }
    }
    out.body(Body::from_stream(r.bytes_stream()))
        .unwrap_or_else(|e| ApiError::internal(format!("a node's answer: {e}")).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_template_api_routes_are_known() {
        for (m, p) in [
            (Method::POST, "/v3/templates"),
            (Method::GET, "/templates/t1/files/abc"),
            (Method::POST, "/v2/templates/t1/builds/b1"),
            (Method::GET, "/templates/t1/builds/b1/status"),
            (Method::GET, "/templates/t1/builds/b1/logs"),
            (Method::POST, "/templates/tags"),
            (Method::DELETE, "/templates/tags"),
            (Method::GET, "/templates/aliases/my-app"),
            (Method::GET, "/templates/t1/tags/groups"),
            (Method::GET, "/templates/t1/tags/v1/assignments"),
            (Method::GET, "/v2/templates"),
            (Method::PATCH, "/v2/templates/t1"),
            (Method::DELETE, "/templates/t1"),
        ] {
            assert!(is_build_route(&m, p), "{m} {p}");
        }
        for (m, p) in [
            (Method::GET, "/templates"),
            (Method::GET, "/templates/base"),
            (Method::POST, "/sandboxes"),
            (Method::GET, "/snapshots"),
            (Method::GET, "/v3/templates"),
        ] {
            assert!(!is_build_route(&m, p), "{m} {p}");
        }
    }
}
