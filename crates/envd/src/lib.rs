//! kiln-envd: THE client of envd (kiln-agent or E2B's envd), independent of the transport.
//!
//! An [`EnvdClient`] opens one fresh HTTP/1.1 connection per call through a [`Connector`]
//! (a host Unix socket, TCP, or anything yielding a byte stream) and speaks envd's HTTP API
//! (`/health`, `/init`, `/metrics`, `/files`) and its Connect services with binary protobuf.
//! Used by the kiln server (directly to an agent), the `kiln` CLI (through kiln's proxy, with
//! the `E2b-Sandbox-Id` header) and the agent's own tests and benchmark.

mod connector;
mod error;
mod files;
mod process;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{header, HeaderName, HeaderValue, Method, Request};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;

pub use connector::{BoxIo, Connector, Io, TcpConnector, UnixConnector};
pub use error::EnvdError;
pub use files::urlencode;
pub use process::{
    bash_request, MessageStream, ProcessEvent, ProcessStream, RunOptions, RunOutput, MAX_MESSAGE,
};

/// How long [`EnvdClient::health`] waits for an answer.
pub const HEALTH_TIMEOUT: Duration = Duration::from_secs(2);

/// How long [`EnvdClient::wait_ready`] polls every millisecond before it backs off.
const FAST_POLL: Duration = Duration::from_millis(150);

struct Inner {
    connector: Arc<dyn Connector>,
    access_token: Option<String>,
    headers: Vec<(HeaderName, HeaderValue)>,
}

/// Client of one envd. Cheap to clone (an `Arc` inside); every call opens its own connection.
#[derive(Clone)]
pub struct EnvdClient {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for EnvdClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EnvdClient")
            .field("target", &self.inner.connector.describe())
            .field(
                "access_token",
                &self.inner.access_token.as_ref().map(|_| "…"),
            )
            .finish()
    }
}

impl EnvdClient {
    /// A client reaching envd through `connector`.
    pub fn new(connector: Arc<dyn Connector>) -> Self {
        EnvdClient {
            inner: Arc::new(Inner {
                connector,
                access_token: None,
                headers: Vec::new(),
            }),
        }
    }

    /// envd behind the Unix socket at `path`.
    pub fn unix(path: impl Into<std::path::PathBuf>) -> Self {
        Self::new(Arc::new(UnixConnector(path.into())))
    }

    /// envd (or kiln's proxy) at a TCP address.
    pub fn tcp(addr: std::net::SocketAddr) -> Self {
        Self::new(Arc::new(TcpConnector(addr)))
    }

    fn edit(self, f: impl FnOnce(&mut Inner)) -> Self {
        let mut inner = Inner {
            connector: self.inner.connector.clone(),
            access_token: self.inner.access_token.clone(),
            headers: self.inner.headers.clone(),
        };
        f(&mut inner);
        EnvdClient {
            inner: Arc::new(inner),
        }
    }

    /// Send this access token (`X-Access-Token`) with every call unless the call names one.
    pub fn with_access_token(self, token: Option<String>) -> Self {
        self.edit(|i| i.access_token = token)
    }

    /// Send this header on every request (e.g. `E2b-Sandbox-Id` through kiln's proxy). It
    /// replaces a header of the same name the client would set itself (such as `Host`).
    ///
    /// # Panics
    /// If `name` is not a valid header name or `value` not a valid header value (control
    /// characters): both are programming errors, the names are constants.
    pub fn with_header(self, name: &'static str, value: String) -> Self {
        let name = HeaderName::from_bytes(name.as_bytes()).expect("valid header name");
        let value = HeaderValue::try_from(value).expect("header value without control characters");
        self.edit(|i| i.headers.push((name, value)))
    }

    /// The connector's description, for logs (may contain host paths).
    pub fn describe(&self) -> String {
        self.inner.connector.describe()
    }

    /// A fresh byte stream to the connector's target, for protocols other than HTTP (the
    /// console's VNC bridge).
    pub async fn connect_raw(&self) -> Result<BoxIo, EnvdError> {
        self.inner
            .connector
            .connect()
            .await
            .map_err(|source| EnvdError::Connect { source })
    }

    /// Sends one request over a fresh HTTP/1.1 connection, adding the [`with_header`]
    /// headers (the access token is not added: this is the raw path the proxy uses). The
    /// connection keeps running until the response body (or an upgraded stream) is done.
    ///
    /// [`with_header`]: Self::with_header
    pub async fn send<B>(&self, mut req: Request<B>) -> Result<http::Response<Incoming>, EnvdError>
    where
        B: http_body::Body + Send + 'static,
        B::Data: Send,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        for (n, v) in &self.inner.headers {
            req.headers_mut().insert(n.clone(), v.clone());
        }
        let io = match self.inner.connector.connect().await {
            Ok(io) => io,
            Err(source) => {
                tracing::debug!(target = %self.inner.connector.describe(), error = %source, "cannot connect to envd");
                return Err(EnvdError::Connect { source });
            }
        };
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await?;
        tokio::spawn(async move {
            if let Err(e) = conn.with_upgrades().await {
                tracing::debug!(error = %e, "envd connection ended with an error");
            }
        });
        Ok(sender.send_request(req).await?)
    }

    /// Sends one request over a fresh HTTP/2 connection with prior knowledge (h2c), as
    /// [`Self::send`] does over HTTP/1.1: for servers that speak only HTTP/2 (gRPC). The
    /// request's URI must be absolute (its scheme and authority become the pseudo-headers).
    pub async fn send_h2<B>(
        &self,
        mut req: Request<B>,
    ) -> Result<http::Response<Incoming>, EnvdError>
    where
        B: http_body::Body + Send + Unpin + 'static,
        B::Data: Send,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        for (n, v) in &self.inner.headers {
            req.headers_mut().insert(n.clone(), v.clone());
        }
        let io = self
            .inner
            .connector
            .connect()
            .await
            .map_err(|source| EnvdError::Connect { source })?;
        let (mut sender, conn) = hyper::client::conn::http2::handshake(
            hyper_util::rt::TokioExecutor::new(),
            TokioIo::new(io),
        )
        .await?;
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "h2 connection ended with an error");
            }
        });
        Ok(sender.send_request(req).await?)
    }

    /// A request builder with `Host`, Basic auth for `user` and the access token.
    pub(crate) fn builder(
        &self,
        method: Method,
        uri: &str,
        user: Option<&str>,
        token: Option<&str>,
    ) -> http::request::Builder {
        let mut b = Request::builder()
            .method(method)
            .uri(uri)
            .header(header::HOST, "localhost");
        if let Some(u) = user {
            use base64::Engine;
            let v = base64::engine::general_purpose::STANDARD.encode(format!("{u}:"));
            b = b.header(header::AUTHORIZATION, format!("Basic {v}"));
        }
        if let Some(t) = token.or(self.inner.access_token.as_deref()) {
            b = b.header("X-Access-Token", t);
        }
        b
    }

    /// The body of a 2xx answer, else the error it carries.
    pub(crate) async fn expect_ok(resp: http::Response<Incoming>) -> Result<Bytes, EnvdError> {
        let status = resp.status();
        let body = resp.into_body().collect().await?.to_bytes();
        if status.is_success() {
            Ok(body)
        } else {
            Err(error::http_error(status, &body))
        }
    }

    /// The streaming body of a 2xx answer, else the error it carries.
    pub(crate) async fn expect_ok_stream(
        resp: http::Response<Incoming>,
    ) -> Result<Incoming, EnvdError> {
        if resp.status().is_success() {
            return Ok(resp.into_body());
        }
        let status = resp.status();
        let body = resp.into_body().collect().await?.to_bytes();
        Err(error::http_error(status, &body))
    }

    /// `GET /health` answered 2xx within [`HEALTH_TIMEOUT`].
    pub async fn health(&self) -> Result<(), EnvdError> {
        let req = self
            .builder(Method::GET, "/health", None, None)
            .body(empty())?;
        let call = async { Self::expect_ok(self.send(req).await?).await };
        match tokio::time::timeout(HEALTH_TIMEOUT, call).await {
            Ok(r) => r.map(|_| ()),
            Err(_) => Err(EnvdError::Timeout(HEALTH_TIMEOUT)),
        }
    }

    /// Polls `/health` until it answers or `timeout` passes ([`EnvdError::Timeout`] when envd
    /// never accepted a connection, else the last error).
    pub async fn wait_ready(&self, timeout: Duration) -> Result<(), EnvdError> {
        let start = Instant::now();
        let mut delay = Duration::from_millis(1);
        loop {
            match self.health().await {
                Ok(()) => return Ok(()),
                Err(e) if start.elapsed() >= timeout => {
                    return Err(if e.is_connect() {
                        EnvdError::Timeout(timeout)
                    } else {
                        e
                    })
                }
                Err(_) => {
                    tokio::time::sleep(delay).await;
                    // Every millisecond while an agent usually starts (a failed connect costs
                    // microseconds), then backing off to 10 ms for a slow one.
                    if start.elapsed() >= FAST_POLL {
                        delay = (delay * 2).min(Duration::from_millis(10));
                    }
                }
            }
        }
    }

    /// `POST /init`: environment, access token, default user/workdir, clock.
    pub async fn init(&self, req: &kiln_proto::envd::InitRequest) -> Result<(), EnvdError> {
        let body = serde_json::to_vec(req).map_err(|e| EnvdError::Invalid(e.to_string()))?;
        let r = self
            .builder(Method::POST, "/init", None, None)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)))?;
        Self::expect_ok(self.send(r).await?).await.map(|_| ())
    }

    /// `GET /metrics`.
    pub async fn metrics(&self) -> Result<kiln_proto::envd::Metrics, EnvdError> {
        let r = self
            .builder(Method::GET, "/metrics", None, None)
            .body(empty())?;
        let body = Self::expect_ok(self.send(r).await?).await?;
        serde_json::from_slice(&body).map_err(|e| EnvdError::Decode(format!("/metrics: {e}")))
    }
}

pub(crate) fn empty() -> Full<Bytes> {
    Full::new(Bytes::new())
}
