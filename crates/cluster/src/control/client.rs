//! How a control replica reaches a node: JSON calls to its internal API ([`NodeClient`]) and
//! byte tunnels to one port of one of its sandboxes ([`TunnelConnector`], the connector the
//! gateway's envd clients use).

use std::time::Duration;

use kiln_envd::{BoxIo, Connector};
use kiln_server::store::SandboxRecord;
use kiln_server::Error;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::secret::ClusterSecret;
use crate::wire::{error_of, CreateDoc, Op, OpAnswer, API_PREFIX, TUNNEL_PROTOCOL};

/// The most a tunnel's answer head may take.
const MAX_HEAD: usize = 16 * 1024;
/// How long a node has to answer a tunnel request.
const TUNNEL_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Deserialize)]
struct Refusal {
    #[serde(default)]
    message: String,
}

/// Calls to nodes' internal APIs.
#[derive(Clone)]
pub struct NodeClient {
    http: reqwest::Client,
    secret: ClusterSecret,
}

impl NodeClient {
    pub fn new(secret: ClusterSecret) -> Self {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(3))
            .pool_idle_timeout(Duration::from_secs(30))
            .build()
            .unwrap_or_default();
        Self { http, secret }
    }

    pub fn secret(&self) -> &ClusterSecret {
        &self.secret
    }

    /// Creates a sandbox on the node at `addr`.
    pub async fn create(&self, addr: &str, doc: &CreateDoc) -> Result<(SandboxRecord, i64), Error> {
        let a: OpAnswer = self.post(addr, "/sandboxes", doc, "").await?;
        let rec = a
            .sandbox
            .ok_or_else(|| Error::internal("the node answered a create without its sandbox"))?;
        Ok((rec.into(), a.revision))
    }

    /// One lifecycle call on sandbox `id` of the node at `addr`.
    pub async fn op(&self, addr: &str, id: &str, op: &Op) -> Result<OpAnswer, Error> {
        check_id(id)?;
        self.post(addr, &format!("/sandboxes/{id}"), op, id).await
    }

    async fn post<B: Serialize, R: DeserializeOwned>(
        &self,
        addr: &str,
        path: &str,
        body: &B,
        sandbox: &str,
    ) -> Result<R, Error> {
        let unreachable = |e: reqwest::Error| {
            tracing::warn!(node = addr, error = %e, "calling a node");
            Error::Unavailable("the node that runs the sandbox is unreachable; retry".into())
        };
        let r = self
            .http
            .post(format!("http://{addr}{API_PREFIX}{path}"))
            .header(http::header::AUTHORIZATION, self.secret.bearer())
            .json(body)
            .send()
            .await
            .map_err(unreachable)?;
        let status = r.status();
        if status.is_success() {
            return r.json::<R>().await.map_err(unreachable);
        }
        let message = r
            .json::<Refusal>()
            .await
            .map(|r| r.message)
            .unwrap_or_default();
        Err(error_of(status, message, sandbox))
    }
}

/// Sandbox ids go into paths as they are: only the characters kiln's ids use.
fn check_id(id: &str) -> Result<(), Error> {
    let ok = !id.is_empty()
        && id.len() <= 128
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(Error::SandboxNotFound(id.chars().take(64).collect()))
    }
}

/// A connection to `port` of sandbox `id` through the internal API of the node at `addr`.
pub struct TunnelConnector {
    pub addr: String,
    pub id: String,
    pub port: u16,
    pub secret: ClusterSecret,
}

#[async_trait::async_trait]
impl Connector for TunnelConnector {
    async fn connect(&self) -> std::io::Result<BoxIo> {
        use std::io::{Error as IoError, ErrorKind};
        check_id(&self.id).map_err(|e| IoError::new(ErrorKind::InvalidInput, e.to_string()))?;
        let open = async {
            let mut s = tokio::net::TcpStream::connect(&self.addr).await?;
            s.set_nodelay(true)?;
            let req = format!(
                "GET {API_PREFIX}/sandboxes/{}/ports/{}/tunnel HTTP/1.1\r\nHost: {}\r\n\
                 Authorization: {}\r\nConnection: Upgrade\r\nUpgrade: {TUNNEL_PROTOCOL}\r\n\r\n",
                self.id,
                self.port,
                self.addr,
                self.secret.bearer()
            );
            s.write_all(req.as_bytes()).await?;
            // Byte by byte: nothing past the head may be taken from the tunnel.
            let mut head = Vec::with_capacity(256);
            let mut b = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") {
                if head.len() >= MAX_HEAD || s.read(&mut b).await? == 0 {
                    return Err(IoError::new(
                        ErrorKind::UnexpectedEof,
                        "the node closed the tunnel",
                    ));
                }
                head.push(b[0]);
            }
            let line = String::from_utf8_lossy(&head);
            let line = line.lines().next().unwrap_or_default();
            if line.split_whitespace().nth(1) != Some("101") {
                return Err(IoError::new(
                    ErrorKind::ConnectionRefused,
                    format!("the node refused the tunnel: {line}"),
                ));
            }
            Ok(Box::new(s) as BoxIo)
        };
        tokio::time::timeout(TUNNEL_TIMEOUT, open)
            .await
            .map_err(|_| IoError::new(ErrorKind::TimedOut, "the node did not open the tunnel"))?
    }

    fn describe(&self) -> String {
        format!("tunnel:{}/{}:{}", self.addr, self.id, self.port)
    }
}
