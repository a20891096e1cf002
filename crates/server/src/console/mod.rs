//! The web console at `/console`: sign-in with an API key into a server-side session
//! ([`session`], kept hashed in a [`SessionStore`]: the state database's [`ConsoleDb`], or
//! etcd on a cluster; failed sign-ins limited per client address by [`limit`], counted in the
//! same place), the HTML pages ([`pages`]), the embedded front-end bundle (built from
//! `crates/server/console/` by esbuild and committed under its `dist/`), a terminal over the
//! sandbox agent's PTY API ([`terminal`]), a desktop sandbox's screen over noVNC bridged to
//! its VNC server ([`desktop`]), a template's builds ([`builds`]),
//! and `/console/api/*`, which hands each request to the REST API's own router as the
//! session's caller: the console has no business logic of its own, and sees exactly what the
//! session's key sees through the API.
//!

pub mod builds;
pub mod desktop;
pub mod limit;
pub mod pages;
pub mod session;
pub mod store;
pub mod terminal;

pub use crate::store::{ConsoleDb, SessionRow};
pub use store::SessionStore;

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{ConnectInfo, Form, Path, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use axum::Router;
use serde_json::json;
use tower::ServiceExt;

use crate::api::AppState;
use session::{same_origin, same_token, Session, Sessions, SignInError};

/// The bundled front end (see `crates/server/console/`).
pub const APP_JS: &str = include_str!("../../console/dist/app.js");
pub const APP_CSS: &str = include_str!("../../console/dist/app.css");

pub use crate::api::ViewRead;

/// What the console's handlers share.
pub struct ConsoleState {
    pub app: Arc<AppState>,
    /// The REST API's router (with its own layers: body limit, audit, auth).
    api: Router,
    pub sessions: Sessions,
    /// Failed sign-ins per client address.
    pub sign_in_limit: Arc<dyn limit::SignInCounter>,
}

impl ConsoleState {
    /// The request's live session.
    pub async fn current(&self, headers: &HeaderMap) -> Option<Session> {
        self.sessions
            .current(self.app.access.as_ref(), headers)
            .await
    }
}

type Cs = State<Arc<ConsoleState>>;

/// The console's routes (mounted at `/console`); `api` is the REST API's router.
pub fn router(app: Arc<AppState>, api: Router) -> Router {
    let db: Result<Arc<dyn SessionStore>, _> = match app.console_sessions.clone() {
        Some(db) => Ok(db),
        None => ConsoleDb::open_in_memory().map(|db| Arc::new(db) as Arc<dyn SessionStore>),
    };
    let db = match db {
        Ok(db) => db,
        Err(e) => {
            // Only an in-memory SQLite database failing to open: the console is off.
            tracing::error!(error = %e, "console sessions: the console is not served");
            return Router::new().fallback(|| async {
                json_error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the console is not available",
                )
            });
        }
    };
    let st = Arc::new(ConsoleState {
        api,
        sessions: Sessions::new(db),
        sign_in_limit: app
            .console_sign_ins
            .clone()
            .unwrap_or_else(|| Arc::new(limit::SignInLimit::default())),
        app,
    });
    Router::new()
        .route("/", get(index))
        .route(
            "/app.js",
            get(|| asset(APP_JS, "text/javascript; charset=utf-8")),
        )
        .route(
            "/app.css",
            get(|| asset(APP_CSS, "text/css; charset=utf-8")),
        )
        .route("/login", post(login).get(|| async { redirect("/console") }))
        .route("/logout", post(logout))
        .route("/terminal/{sandboxID}", get(terminal::open))
        .route("/desktop/{sandboxID}", get(desktop::status))
        .route("/desktop/{sandboxID}/stream", post(desktop::start_stream))
        .route("/vnc/{sandboxID}", get(desktop::open))
        .route("/builds/{templateID}", get(builds::list))
        .route("/api/{*rest}", any(to_api))
        .with_state(st)
}

async fn asset(body: &'static str, ty: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, ty),
            (header::CACHE_CONTROL, "no-cache"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        body,
    )
        .into_response()
}

fn redirect(to: &'static str) -> Response {
    (StatusCode::SEE_OTHER, [(header::LOCATION, to)]).into_response()
}

/// `GET /console`: the app for a signed-in browser, else the sign-in page.
async fn index(State(cs): Cs, headers: HeaderMap) -> Response {
    match cs.current(&headers).await {
        Some(s) => pages::app(&s),
        None => pages::sign_in(StatusCode::OK, None),
    }
}

/// `POST /console/login` (form field `key`): checks the key as the API does; a session
/// cookie and the app, or the sign-in page again with what was wrong.
async fn login(
    State(cs): Cs,
    peer: Option<axum::Extension<ConnectInfo<SocketAddr>>>,
    headers: HeaderMap,
    Form(f): Form<HashMap<String, String>>,
) -> Response {
    // The edge puts each connection's peer address in its requests; a request from
    // elsewhere (an in-process client) counts as one unnamed client.
    let ip = peer
        .map(|p| p.0 .0.ip())
        .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
    if let Some(wait) = cs.sign_in_limit.check(ip).await {
        let mut r = pages::sign_in(
            StatusCode::TOO_MANY_REQUESTS,
            Some(&format!(
                "Too many failed sign-ins from your address: try again in {wait} s."
            )),
        );
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(wait));
        return r;
    }
    if !same_origin(&headers) {
        return pages::sign_in(
            StatusCode::FORBIDDEN,
            Some("Sign-in must come from this console's own page."),
        );
    }
    let key = f.get("key").map(|k| k.trim()).unwrap_or("");
    if key.is_empty() {
        return pages::sign_in(StatusCode::BAD_REQUEST, Some("Enter an API key."));
    }
    let store = cs.app.access.clone();
    match cs.sessions.sign_in(store.as_ref(), key).await {
        Ok((id, _)) => {
            let mut r = redirect("/console");
            if let Ok(v) = HeaderValue::from_str(&session::set_cookie(&id, &headers)) {
                r.headers_mut().insert(header::SET_COOKIE, v);
            }
            r
        }
        Err(SignInError::Refused(e)) => {
            cs.sign_in_limit.failed(ip).await;
            pages::sign_in(
                StatusCode::UNAUTHORIZED,
                Some(&format!(
                    "Sign-in failed: {e}. Check the key and try again."
                )),
            )
        }
        Err(SignInError::Full) => pages::sign_in(
            StatusCode::SERVICE_UNAVAILABLE,
            Some("Too many console sessions are open; try again later."),
        ),
        Err(SignInError::Store(e)) => {
            tracing::error!(error = %e, "console sign-in");
            pages::sign_in(
                StatusCode::INTERNAL_SERVER_ERROR,
                Some("The server could not check the key (its log says why); try again."),
            )
        }
    }
}

/// `POST /console/logout` (form field `csrf`): ends the session.
async fn logout(
    State(cs): Cs,
    headers: HeaderMap,
    Form(f): Form<HashMap<String, String>>,
) -> Response {
    let Some(s) = cs.current(&headers).await else {
        return redirect("/console");
    };
    let ok = f.get("csrf").is_some_and(|t| same_token(t, &s.csrf)) && same_origin(&headers);
    if !ok {
        return csrf_refused();
    }
    cs.sessions.end(&headers).await;
    let mut r = redirect("/console");
    if let Ok(v) = HeaderValue::from_str(&session::clear_cookie()) {
        r.headers_mut().insert(header::SET_COOKIE, v);
    }
    r
}

pub(crate) fn json_error(status: StatusCode, message: &str) -> Response {
    (
        status,
        axum::Json(json!({"code": status.as_u16(), "message": message})),
    )
        .into_response()
}

fn csrf_refused() -> Response {
    json_error(
        StatusCode::FORBIDDEN,
        "missing or wrong CSRF token: send the console page's token in X-CSRF-Token",
    )
}

/// Request headers the API call keeps (cookies and credentials stay behind).
const PASSED_HEADERS: &[header::HeaderName] = &[
    header::CONTENT_TYPE,
    header::CONTENT_LENGTH,
    header::ACCEPT,
    header::HOST,
];

/// `/console/api/{rest}`: the REST API's `/{rest}` as the session's caller.
async fn to_api(State(cs): Cs, Path(rest): Path<String>, req: Request) -> Response {
    let Some(s) = cs.current(req.headers()).await else {
        return json_error(StatusCode::UNAUTHORIZED, "sign in to the console first");
    };
    let safe = matches!(*req.method(), Method::GET | Method::HEAD | Method::OPTIONS);
    if !safe {
        let token_ok = req
            .headers()
            .get(session::CSRF_HEADER)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|t| same_token(t, &s.csrf));
        if !token_ok || !same_origin(req.headers()) {
            return csrf_refused();
        }
    }
    let (parts, body) = req.into_parts();
    let path_q = match parts.uri.query() {
        Some(q) => format!("/{rest}?{q}"),
        None => format!("/{rest}"),
    };
    let Ok(uri) = path_q.parse::<axum::http::Uri>() else {
        return json_error(StatusCode::BAD_REQUEST, "malformed path");
    };
    let mut inner = Request::builder().method(parts.method).uri(uri);
    for name in PASSED_HEADERS {
        for v in parts.headers.get_all(name) {
            inner = inner.header(name, v);
        }
    }
    let Ok(mut inner) = inner.body(Body::new(body)) else {
        return json_error(StatusCode::BAD_REQUEST, "malformed request");
    };
    // The API's auth layer takes a caller already in the extensions as authenticated: only
    // this handler puts one there, after checking the session.
    inner.extensions_mut().insert(s.caller);
    if safe {
        inner.extensions_mut().insert(ViewRead);
    }
    match cs.api.clone().oneshot(inner).await {
        Ok(r) => r,
        Err(never) => match never {},
    }
}
