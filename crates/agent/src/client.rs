//! Async client for kiln-agent (and envd), over a Unix socket or TCP, without TLS.
//!
//! Used by the kiln server to drive the agent inside a sandbox and by the agent's own tests and
//! benchmark. RPCs use the Connect protocol with binary protobuf (the e2b SDKs use JSON; the
//! agent serves both).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use http::{header, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use kiln_proto::connect::{EndStream, FLAG_END_STREAM};
use kiln_proto::process::{self as pb, process_event, ProcessConfig, ProcessEvent};
use prost::Message;

/// Errors from [`AgentClient`].
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot connect to kiln-agent at {target}: {source} (is the agent running and listening there?)")]
    Connect {
        target: String,
        source: std::io::Error,
    },
    #[error("HTTP exchange with kiln-agent failed: {0}")]
    Http(#[from] hyper::Error),
    #[error("kiln-agent answered HTTP {status}: {message}")]
    Status { status: u16, message: String },
    #[error("kiln-agent RPC failed with {code}: {message}")]
    Rpc { code: String, message: String },
    #[error("kiln-agent did not answer within {0:?}")]
    Timeout(Duration),
    #[error("cannot decode kiln-agent response: {0}")]
    Decode(String),
    #[error("invalid request: {0}")]
    Invalid(String),
}

impl ClientError {
    /// The Connect code (`not_found`, …) of an RPC error, if this is one.
    pub fn rpc_code(&self) -> Option<&str> {
        match self {
            ClientError::Rpc { code, .. } => Some(code),
            _ => None,
        }
    }
}

#[derive(Debug, Clone)]
enum Target {
    Unix(PathBuf),
    Tcp(SocketAddr),
}

/// Options for [`AgentClient::run`].
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// User to run as (HTTP Basic `user:`); `None` uses the agent's default user.
    pub user: Option<String>,
    /// Working directory; `None` uses the default workdir or the user's home.
    pub cwd: Option<String>,
    /// Extra environment variables.
    pub envs: HashMap<String, String>,
    /// `X-Access-Token`, needed once `/init` set a token.
    pub access_token: Option<String>,
    /// Deadline for the whole command (sent as `connect-timeout-ms` and enforced locally).
    pub timeout: Option<Duration>,
}

/// Collected result of [`AgentClient::run`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunOutput {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    /// Exit code; `-1` when the process was killed by a signal.
    pub exit_code: i32,
}

/// Client of a kiln-agent. Cheap to clone; every call opens its own HTTP/1.1 connection.
#[derive(Debug, Clone)]
pub struct AgentClient {
    target: Target,
    access_token: Option<String>,
}

impl AgentClient {
    /// Client talking to the agent's Unix socket at `path`.
    pub fn unix(path: impl Into<PathBuf>) -> Self {
        AgentClient {
            target: Target::Unix(path.into()),
            access_token: None,
        }
    }

    /// Client talking to the agent over TCP.
    pub fn tcp(addr: SocketAddr) -> Self {
        AgentClient {
            target: Target::Tcp(addr),
            access_token: None,
        }
    }

    /// Send this access token (`X-Access-Token`) with every request unless a call overrides it.
    pub fn with_access_token(mut self, token: Option<String>) -> Self {
        self.access_token = token;
        self
    }

    fn target_name(&self) -> String {
        match &self.target {
            Target::Unix(p) => format!("unix:{}", p.display()),
            Target::Tcp(a) => format!("tcp:{a}"),
        }
    }

    async fn send<B>(&self, req: Request<B>) -> Result<http::Response<Incoming>, ClientError>
    where
        B: hyper::body::Body + Send + 'static,
        B::Data: Send,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let connect_err = |source| ClientError::Connect {
            target: self.target_name(),
            source,
        };
        let mut sender = match &self.target {
            Target::Unix(p) => {
                let s = tokio::net::UnixStream::connect(p)
                    .await
                    .map_err(connect_err)?;
                let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(s)).await?;
                tokio::spawn(async move {
                    let _ = conn.await;
                });
                sender
            }
            Target::Tcp(a) => {
                let s = tokio::net::TcpStream::connect(a)
                    .await
                    .map_err(connect_err)?;
                let _ = s.set_nodelay(true);
                let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(s)).await?;
                tokio::spawn(async move {
                    let _ = conn.await;
                });
                sender
            }
        };
        Ok(sender.send_request(req).await?)
    }

    fn builder(
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
        if let Some(t) = token.or(self.access_token.as_deref()) {
            b = b.header("X-Access-Token", t);
        }
        b
    }

    async fn expect_ok(resp: http::Response<Incoming>) -> Result<Bytes, ClientError> {
        let status = resp.status();
        let body = resp.into_body().collect().await?.to_bytes();
        if status.is_success() {
            Ok(body)
        } else {
            Err(http_error(status, &body))
        }
    }

    /// `GET /health`.
    pub async fn health(&self) -> Result<(), ClientError> {
        let req = self
            .builder(Method::GET, "/health", None, None)
            .body(empty())
            .map_err(invalid)?;
        Self::expect_ok(self.send(req).await?).await.map(|_| ())
    }

    /// Poll `/health` until it answers or `timeout` passes.
    pub async fn wait_ready(&self, timeout: Duration) -> Result<(), ClientError> {
        let start = Instant::now();
        let mut delay = Duration::from_millis(2);
        loop {
            match self.health().await {
                Ok(()) => return Ok(()),
                Err(e) if start.elapsed() >= timeout => {
                    return Err(match e {
                        ClientError::Connect { .. } => ClientError::Timeout(timeout),
                        other => other,
                    })
                }
                Err(_) => {
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_millis(50));
                }
            }
        }
    }

    /// `POST /init`: environment, access token, default user/workdir, clock.
    pub async fn init(&self, req: &kiln_proto::envd::InitRequest) -> Result<(), ClientError> {
        let body = serde_json::to_vec(req).map_err(|e| ClientError::Invalid(e.to_string()))?;
        let r = self
            .builder(Method::POST, "/init", None, None)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)))
            .map_err(invalid)?;
        Self::expect_ok(self.send(r).await?).await.map(|_| ())
    }

    /// Run `cmd` with `/bin/bash -l -c` and collect its output and exit code.
    pub async fn run(&self, cmd: &str, opts: RunOptions) -> Result<RunOutput, ClientError> {
        let req = pb::StartRequest {
            process: Some(ProcessConfig {
                cmd: "/bin/bash".into(),
                args: vec!["-l".into(), "-c".into(), cmd.into()],
                envs: opts.envs.clone(),
                cwd: opts.cwd.clone(),
            }),
            pty: None,
            tag: None,
            stdin: Some(false),
        };
        let fut = async {
            let mut stream = self
                .server_stream(
                    "/process.Process/Start",
                    &req,
                    opts.user.as_deref(),
                    opts.access_token.as_deref(),
                    opts.timeout,
                )
                .await?;
            let mut out = RunOutput::default();
            while let Some(msg) = stream.next_message().await? {
                let resp = pb::StartResponse::decode(msg)
                    .map_err(|e| ClientError::Decode(e.to_string()))?;
                match resp.event.and_then(|e: ProcessEvent| e.event) {
                    Some(process_event::Event::Data(d)) => match d.output {
                        Some(process_event::data_event::Output::Stdout(b)) => {
                            out.stdout.extend_from_slice(&b)
                        }
                        Some(process_event::data_event::Output::Stderr(b)) => {
                            out.stderr.extend_from_slice(&b)
                        }
                        Some(process_event::data_event::Output::Pty(b)) => {
                            out.stdout.extend_from_slice(&b)
                        }
                        None => {}
                    },
                    Some(process_event::Event::End(e)) => {
                        out.exit_code = e.exit_code;
                        return Ok(out);
                    }
                    _ => {}
                }
            }
            Err(ClientError::Decode(
                "process stream ended without an end event".into(),
            ))
        };
        match opts.timeout {
            Some(t) => tokio::time::timeout(t, fut)
                .await
                .map_err(|_| ClientError::Timeout(t))?,
            None => fut.await,
        }
    }

    /// Open a Connect server stream (binary protobuf) and return a reader of its messages.
    pub async fn server_stream<M: Message>(
        &self,
        path: &str,
        msg: &M,
        user: Option<&str>,
        token: Option<&str>,
        timeout: Option<Duration>,
    ) -> Result<MessageStream, ClientError> {
        let payload = msg.encode_to_vec();
        let mut body = BytesMut::with_capacity(payload.len() + 5);
        body.extend_from_slice(&[0]);
        body.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        body.extend_from_slice(&payload);
        let mut b = self
            .builder(Method::POST, path, user, token)
            .header(header::CONTENT_TYPE, "application/connect+proto")
            .header("connect-protocol-version", "1");
        if let Some(t) = timeout {
            b = b.header("connect-timeout-ms", t.as_millis().to_string());
        }
        let resp = self
            .send(b.body(Full::new(body.freeze())).map_err(invalid)?)
            .await?;
        if resp.status() != StatusCode::OK {
            let status = resp.status();
            let body = resp.into_body().collect().await?.to_bytes();
            return Err(http_error(status, &body));
        }
        Ok(MessageStream {
            body: resp.into_body(),
            buf: BytesMut::new(),
            done: false,
        })
    }

    /// Unary Connect call with binary protobuf.
    pub async fn unary<Req: Message, Resp: Message + Default>(
        &self,
        path: &str,
        msg: &Req,
        user: Option<&str>,
    ) -> Result<Resp, ClientError> {
        let r = self
            .builder(Method::POST, path, user, None)
            .header(header::CONTENT_TYPE, "application/proto")
            .header("connect-protocol-version", "1")
            .body(Full::new(Bytes::from(msg.encode_to_vec())))
            .map_err(invalid)?;
        let body = Self::expect_ok(self.send(r).await?).await?;
        Resp::decode(body).map_err(|e| ClientError::Decode(e.to_string()))
    }

    /// `POST /files` (application/octet-stream), creating parent directories.
    pub async fn write_file(
        &self,
        path: &str,
        data: Vec<u8>,
        user: Option<&str>,
    ) -> Result<(), ClientError> {
        let uri = files_uri(path, user);
        let r = self
            .builder(Method::POST, &uri, user, None)
            .header(header::CONTENT_TYPE, "application/octet-stream")
            .body(Full::new(Bytes::from(data)))
            .map_err(invalid)?;
        Self::expect_ok(self.send(r).await?).await.map(|_| ())
    }

    /// Streamed `POST /files` from any body (used for large uploads).
    pub async fn write_file_body<B>(
        &self,
        path: &str,
        body: B,
        user: Option<&str>,
    ) -> Result<(), ClientError>
    where
        B: hyper::body::Body + Send + 'static,
        B::Data: Send,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let uri = files_uri(path, user);
        let r = self
            .builder(Method::POST, &uri, user, None)
            .header(header::CONTENT_TYPE, "application/octet-stream")
            .body(body)
            .map_err(invalid)?;
        Self::expect_ok(self.send(r).await?).await.map(|_| ())
    }

    /// `GET /files`: the whole file in memory.
    pub async fn read_file(&self, path: &str, user: Option<&str>) -> Result<Vec<u8>, ClientError> {
        let resp = self.read_file_stream(path, user).await?;
        Ok(resp.collect().await?.to_bytes().to_vec())
    }

    /// `GET /files` returning the streaming body (for large downloads).
    pub async fn read_file_stream(
        &self,
        path: &str,
        user: Option<&str>,
    ) -> Result<Incoming, ClientError> {
        let uri = files_uri(path, user);
        let r = self
            .builder(Method::GET, &uri, user, None)
            .body(empty())
            .map_err(invalid)?;
        let resp = self.send(r).await?;
        if !resp.status().is_success() {
            let status = resp.status();
            let body = resp.into_body().collect().await?.to_bytes();
            return Err(http_error(status, &body));
        }
        Ok(resp.into_body())
    }
}

/// Reader of the enveloped messages of a Connect server-streaming response.
pub struct MessageStream {
    body: Incoming,
    buf: BytesMut,
    done: bool,
}

impl MessageStream {
    /// Next message payload; `Ok(None)` at a clean end of stream; an end-stream error becomes
    /// [`ClientError::Rpc`].
    pub async fn next_message(&mut self) -> Result<Option<Bytes>, ClientError> {
        loop {
            if self.done {
                return Ok(None);
            }
            if self.buf.len() >= 5 {
                let flags = self.buf[0];
                let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]])
                    as usize;
                if self.buf.len() >= 5 + len {
                    self.buf.advance(5);
                    let msg = self.buf.split_to(len).freeze();
                    if flags & FLAG_END_STREAM != 0 {
                        self.done = true;
                        let end: EndStream = serde_json::from_slice(&msg)
                            .map_err(|e| ClientError::Decode(format!("end-stream message: {e}")))?;
                        if let Some(err) = end.error {
                            return Err(ClientError::Rpc {
                                code: err.code.to_string(),
                                message: err.message,
                            });
                        }
                        return Ok(None);
                    }
                    return Ok(Some(msg));
                }
            }
            match self.body.frame().await {
                Some(frame) => {
                    if let Ok(data) = frame?.into_data() {
                        self.buf.extend_from_slice(&data);
                    }
                }
                None => {
                    self.done = true;
                    return Err(ClientError::Decode(
                        "stream ended without an end-stream message".into(),
                    ));
                }
            }
        }
    }
}

fn files_uri(path: &str, user: Option<&str>) -> String {
    let mut uri = format!("/files?path={}", urlencode(path));
    if let Some(u) = user {
        uri.push_str("&username=");
        uri.push_str(&urlencode(u));
    }
    uri
}

/// Percent-encode a query component.
pub fn urlencode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~' | b'/') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn empty() -> Full<Bytes> {
    Full::new(Bytes::new())
}

fn invalid(e: http::Error) -> ClientError {
    ClientError::Invalid(e.to_string())
}

fn http_error(status: StatusCode, body: &[u8]) -> ClientError {
    #[derive(serde::Deserialize)]
    struct AnyErr {
        code: serde_json::Value,
        #[serde(default)]
        message: String,
    }
    if let Ok(e) = serde_json::from_slice::<AnyErr>(body) {
        if let serde_json::Value::String(code) = e.code {
            return ClientError::Rpc {
                code,
                message: e.message,
            };
        }
        return ClientError::Status {
            status: status.as_u16(),
            message: e.message,
        };
    }
    ClientError::Status {
        status: status.as_u16(),
        message: String::from_utf8_lossy(body).into_owned(),
    }
}
