//! How a control replica reaches a node: JSON calls to its internal API ([`NodeClient`]) and
//! byte tunnels to one port of one of its sandboxes ([`TunnelConnector`], the connector the
//! gateway's envd clients use).

use std::time::Duration;

use hyper_util::rt::TokioIo;
use kiln_envd::{BoxIo, Connector};
use kiln_server::store::SandboxRecord;
use kiln_server::Error;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::audit::{AuditAnswer, AuditCall, AUDIT_PATH};
use crate::secret::ClusterSecret;
use crate::wire::{
    error_of, BuiltQuery, CreateDoc, Op, OpAnswer, SnapshotDelete, VolumeCall, API_PREFIX,
    BUILDS_PREFIX, HOST_HEADER, KEY_ID_HEADER, LENGTH_HEADER, TEAM_HEADER, TUNNEL_PROTOCOL,
    VOLUME_TOKEN_HEADER,
};

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

    /// Deletes snapshot `id` of `team` (its files and its record) on the node at `addr`.
    pub async fn delete_snapshot(&self, addr: &str, id: &str, team: &str) -> Result<(), Error> {
        check_id(id)?;
        let body = SnapshotDelete { team: team.into() };
        let path = format!("/snapshots/{id}/delete");
        self.post::<_, OpAnswer>(addr, &path, &body, "")
            .await
            .map(drop)
    }

    /// Has the node at `addr` store template `name` in object storage (unless it is there).
    pub async fn share_template(&self, addr: &str, name: &str) -> Result<(), Error> {
        kiln_server::templates::check_name(name)?;
        let path = format!("/templates/{name}/share");
        self.post::<_, serde_json::Value>(addr, &path, &(), "")
            .await
            .map(drop)
    }

    /// One call on volume `id`, kept by the node at `addr`.
    pub async fn volume(&self, addr: &str, id: &str, call: &VolumeCall) -> Result<(), Error> {
        check_id(id)?;
        let path = format!("/volumes/{id}");
        self.post::<_, serde_json::Value>(addr, &path, call, "")
            .await
            .map(drop)
    }

    /// A volume-content request (`rest`: `{id}/path|dir|file?…`) forwarded to the node at
    /// `addr` that keeps the volume, its body streamed both ways.
    pub async fn volume_content(
        &self,
        addr: &str,
        method: http::Method,
        rest: &str,
        token: &str,
        content_type: Option<&http::HeaderValue>,
        body: reqwest::Body,
    ) -> Result<reqwest::Response, Error> {
        let mut req = self
            .http
            .request(
                method,
                format!("http://{addr}{API_PREFIX}/volumecontent/{rest}"),
            )
            .header(http::header::AUTHORIZATION, self.secret.bearer())
            .header(VOLUME_TOKEN_HEADER, token)
            .body(body);
        if let Some(t) = content_type {
            req = req.header(http::header::CONTENT_TYPE, t);
        }
        req.send().await.map_err(|e| {
            tracing::warn!(node = addr, error = %e, "forwarding a volume-content request");
            Error::Unavailable("the node that keeps the volume is unreachable; retry".into())
        })
    }

    /// Whether `q.team` built a template named `q.template` on the node at `addr`.
    pub async fn built(&self, addr: &str, q: &BuiltQuery) -> Result<bool, Error> {
        #[derive(Deserialize)]
        struct Built {
            built: bool,
        }
        let a: Built = self.post(addr, "/builds/resolve", q, "").await?;
        Ok(a.built)
    }

    /// A Template API request (`path_q`: its path and query) of `caller` (None: an upload
    /// URL's, which carries its own token) forwarded to the node at `addr`, its body streamed
    /// both ways; the client's `Host` and `Content-Length` travel in headers of their own.
    #[allow(clippy::too_many_arguments)]
    pub async fn forward_api(
        &self,
        addr: &str,
        method: http::Method,
        path_q: &str,
        caller: Option<&kiln_server::tenancy::Caller>,
        host: Option<&str>,
        headers: &http::HeaderMap,
        body: reqwest::Body,
    ) -> Result<reqwest::Response, Error> {
        let mut req = self
            .http
            .request(method, format!("http://{addr}{BUILDS_PREFIX}{path_q}"))
            .header(http::header::AUTHORIZATION, self.secret.bearer())
            .body(body);
        if let Some(c) = caller {
            req = req
                .header(TEAM_HEADER, &c.team)
                .header(KEY_ID_HEADER, &c.key_id);
        }
        if let Some(h) = host {
            req = req.header(HOST_HEADER, h);
        }
        for (name, to) in [
            (
                http::header::CONTENT_TYPE.as_str(),
                http::header::CONTENT_TYPE.as_str(),
            ),
            (http::header::CONTENT_LENGTH.as_str(), LENGTH_HEADER),
            ("x-forwarded-proto", "x-forwarded-proto"),
        ] {
            if let Some(v) = headers.get(name) {
                req = req.header(to, v);
            }
        }
        req.send().await.map_err(|e| {
            tracing::warn!(node = addr, error = %e, "forwarding a Template API request");
            Error::Unavailable(
                "the node that runs the cluster's template builds is unreachable; retry".into(),
            )
        })
    }

    /// One call on the audit log of the node at `addr`.
    pub async fn audit(&self, addr: &str, call: &AuditCall) -> Result<AuditAnswer, Error> {
        self.post(addr, AUDIT_PATH, call, "").await
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
            let s = tokio::net::TcpStream::connect(&self.addr).await?;
            s.set_nodelay(true)?;
            let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(s))
                .await
                .map_err(IoError::other)?;
            tokio::spawn(async move {
                // Runs until the upgrade hands the connection over (or it fails).
                let _ = conn.with_upgrades().await;
            });
            let req = http::Request::get(format!(
                "{API_PREFIX}/sandboxes/{}/ports/{}/tunnel",
                self.id, self.port
            ))
            .header(http::header::HOST, self.addr.as_str())
            .header(http::header::AUTHORIZATION, self.secret.bearer())
            .header(http::header::CONNECTION, "upgrade")
            .header(http::header::UPGRADE, TUNNEL_PROTOCOL)
            .body(http_body_util::Empty::<bytes::Bytes>::new())
            .map_err(IoError::other)?;
            let resp = sender.send_request(req).await.map_err(|e| {
                IoError::new(
                    ErrorKind::UnexpectedEof,
                    format!("the node closed the tunnel: {e}"),
                )
            })?;
            if resp.status() != http::StatusCode::SWITCHING_PROTOCOLS {
                return Err(IoError::new(
                    ErrorKind::ConnectionRefused,
                    format!("the node refused the tunnel: {}", resp.status()),
                ));
            }
            // Bytes the node sent right after its answer stay in the upgraded stream.
            let up = hyper::upgrade::on(resp).await.map_err(IoError::other)?;
            Ok(Box::new(TokioIo::new(up)) as BoxIo)
        };
        tokio::time::timeout(TUNNEL_TIMEOUT, open)
            .await
            .map_err(|_| IoError::new(ErrorKind::TimedOut, "the node did not open the tunnel"))?
    }

    fn describe(&self) -> String {
        format!("tunnel:{}/{}:{}", self.addr, self.id, self.port)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A node that answers one tunnel request with `answer` (in one write, as a node whose
    /// sandbox speaks first may), then echoes; returns its address and the request it read.
    async fn node(answer: &'static [u8]) -> (String, tokio::task::JoinHandle<String>) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let task = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut head = Vec::new();
            let mut b = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") {
                s.read_exact(&mut b).await.unwrap();
                head.push(b[0]);
            }
            s.write_all(answer).await.unwrap();
            let mut buf = [0u8; 64];
            while let Ok(n) = s.read(&mut buf).await {
                if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
            String::from_utf8(head).unwrap()
        });
        (addr, task)
    }

    fn connector(addr: String) -> TunnelConnector {
        TunnelConnector {
            addr,
            id: "sbx1".into(),
            port: 5900,
            secret: ClusterSecret::new("0123456789abcdef0123").unwrap(),
        }
    }

    #[tokio::test]
    async fn bytes_right_after_the_upgrade_are_kept_and_the_tunnel_carries_both_ways() {
        let (addr, task) = node(
            b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: kiln-tunnel\r\n\r\nRFB 003.008\n",
        )
        .await;
        let mut io = connector(addr).connect().await.unwrap();
        let mut greeting = [0u8; 12];
        io.read_exact(&mut greeting).await.unwrap();
        assert_eq!(
            &greeting, b"RFB 003.008\n",
            "the port's first bytes are not lost"
        );
        io.write_all(b"ping").await.unwrap();
        let mut back = [0u8; 4];
        io.read_exact(&mut back).await.unwrap();
        assert_eq!(&back, b"ping");
        drop(io);
        let head = task.await.unwrap().to_ascii_lowercase();
        assert!(
            head.starts_with("get /internal/v1/sandboxes/sbx1/ports/5900/tunnel http/1.1\r\n"),
            "{head}"
        );
        assert!(head.contains("upgrade: kiln-tunnel\r\n"), "{head}");
        assert!(
            head.contains("authorization: bearer 0123456789abcdef0123\r\n"),
            "{head}"
        );
    }

    #[tokio::test]
    async fn a_refused_tunnel_says_what_the_node_answered() {
        let (addr, _task) = node(b"HTTP/1.1 404 Not Found\r\ncontent-length: 2\r\n\r\n{}").await;
        let e = connector(addr).connect().await.err().unwrap();
        assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused);
        assert!(e.to_string().contains("404"), "{e}");
    }
}
