//! E2B's `egressProxy`: a sandbox's allowed TCP egress tunnelled through an upstream SOCKS5
//! proxy (RFC 1928, user/password RFC 1929, with tokio-socks), dialled from the router
//! namespace **after** the policy decided, failing closed: a proxy that is down, refuses the
//! authentication or the connection fails the sandbox's connection; there is no direct
//! fallback. The proxy is asked for the IPv4 address the sandbox dialled. With `tls`, SOCKS5
//! runs inside TLS to the proxy (its certificate always verified: against `caCert` when
//! given, which replaces the host's roots, else the host's store; for `serverName`, default
//! the address's host).

use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use serde_json::{json, Value};
use tokio::net::TcpStream;

use crate::egress_sock::SocketMaker;

const MAX_CREDENTIAL: usize = 255;
const MAX_SERVER_NAME: usize = 253;
const MAX_CA_CERT: usize = 8192;

/// TLS to the proxy.
#[derive(Clone, PartialEq, Eq)]
pub struct ProxyTls {
    /// The name checked and sent as SNI.
    pub server_name: String,
    server_name_given: bool,
    /// PEM that replaces the host's roots.
    ca_cert: Option<String>,
}

/// A connection to the destination: plain, or inside TLS to the proxy.
pub enum UpStream {
    Tcp(TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

impl AsyncRead for UpStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            UpStream::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            UpStream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for UpStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            UpStream::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            UpStream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            UpStream::Tcp(s) => Pin::new(s).poll_flush(cx),
            UpStream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            UpStream::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            UpStream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// The host's roots, read once.
fn host_roots() -> io::Result<Arc<rustls::RootCertStore>> {
    static ROOTS: OnceLock<Arc<rustls::RootCertStore>> = OnceLock::new();
    if let Some(r) = ROOTS.get() {
        return Ok(r.clone());
    }
    let r = Arc::new(crate::intercept::host_roots(&[]).map_err(io::Error::other)?);
    Ok(ROOTS.get_or_init(|| r).clone())
}

fn parse_ca(pem: &str) -> Result<rustls::RootCertStore, String> {
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(pem.as_bytes()) {
        let c = c.map_err(|e| bad(format!("tls.caCert: {e}")))?;
        roots.add(c).map_err(|e| bad(format!("tls.caCert: {e}")))?;
    }
    if roots.is_empty() {
        return Err(bad("tls.caCert holds no PEM certificate"));
    }
    Ok(roots)
}

/// A sandbox's upstream SOCKS5 proxy.
#[derive(Clone, PartialEq, Eq)]
pub struct EgressProxyConfig {
    /// `host:port` as given.
    pub address: String,
    host: String,
    port: u16,
    pub username: Option<String>,
    password: Option<String>,
    pub tls: Option<ProxyTls>,
}

impl std::fmt::Debug for EgressProxyConfig {
    /// Never the password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EgressProxyConfig")
            .field("address", &self.address)
            .field("username", &self.username)
            .finish()
    }
}

fn bad(m: impl std::fmt::Display) -> String {
    format!("network.egressProxy: {m}")
}

impl EgressProxyConfig {
    /// Parses `{address, username?, password?, tls?}` (TLS to the proxy is refused: kiln
    /// speaks SOCKS5 in the clear to it).
    pub fn parse(v: &Value) -> Result<Self, String> {
        let o = v.as_object().ok_or_else(|| bad("expected an object"))?;
        if let Some(k) = o
            .keys()
            .find(|k| !matches!(k.as_str(), "address" | "username" | "password" | "tls"))
        {
            return Err(bad(format!("unknown field {k:?}")));
        }
        let s = |k: &str| -> Result<Option<String>, String> {
            match o.get(k) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(_) => Err(bad(format!("{k} is not a string"))),
            }
        };
        let address = s("address")?.ok_or_else(|| bad("address (host:port) is required"))?;
        let (host, port) = address
            .rsplit_once(':')
            .and_then(|(h, p)| Some((h, p.parse::<u16>().ok().filter(|p| *p != 0)?)))
            .filter(|(h, _)| !h.is_empty() && !h.contains(['[', ']', '/', ' ']))
            .ok_or_else(|| bad(format!("address {address:?} is not host:port")))?;
        let (username, password) = (s("username")?, s("password")?);
        for (k, v) in [("username", &username), ("password", &password)] {
            if v.as_ref()
                .is_some_and(|v| v.is_empty() || v.len() > MAX_CREDENTIAL)
            {
                return Err(bad(format!("{k} must be 1 to {MAX_CREDENTIAL} bytes")));
            }
        }
        if password.is_some() && username.is_none() {
            return Err(bad("a password needs a username"));
        }
        let tls = match o.get("tls") {
            None | Some(Value::Null) => None,
            Some(Value::Object(t)) if t.get("enabled") == Some(&Value::Bool(true)) => {
                if let Some(k) = t
                    .keys()
                    .find(|k| !matches!(k.as_str(), "enabled" | "serverName" | "caCert"))
                {
                    return Err(bad(format!("unknown tls field {k:?}")));
                }
                let st = |k: &str| match t.get(k) {
                    None | Some(Value::Null) => Ok(None),
                    Some(Value::String(s)) => Ok(Some(s.clone())),
                    Some(_) => Err(bad(format!("tls.{k} is not a string"))),
                };
                let (name, ca) = (st("serverName")?, st("caCert")?);
                if name
                    .as_ref()
                    .is_some_and(|n| n.is_empty() || n.len() > MAX_SERVER_NAME)
                {
                    return Err(bad(format!(
                        "tls.serverName must be 1 to {MAX_SERVER_NAME} characters"
                    )));
                }
                let server_name = name.clone().unwrap_or_else(|| host.to_string());
                ServerName::try_from(server_name.clone())
                    .map_err(|_| bad(format!("tls.serverName {server_name:?} is not a name")))?;
                if let Some(pem) = &ca {
                    if pem.len() > MAX_CA_CERT {
                        return Err(bad(format!("tls.caCert is over {MAX_CA_CERT} bytes")));
                    }
                    parse_ca(pem)?;
                }
                Some(ProxyTls {
                    server_name,
                    server_name_given: name.is_some(),
                    ca_cert: ca,
                })
            }
            Some(Value::Object(_)) => None,
            Some(_) => return Err(bad("tls is an object")),
        };
        Ok(Self {
            host: host.to_string(),
            port,
            username,
            password,
            address,
            tls,
        })
    }

    /// The API's view: never the password.
    pub fn info_json(&self) -> Value {
        let mut v = json!({"address": self.address});
        if let Some(u) = &self.username {
            v["username"] = json!(u);
        }
        if let Some(t) = &self.tls {
            v["tls"] = match t.server_name_given {
                true => json!({"enabled": true, "serverName": t.server_name}),
                false => json!({"enabled": true}),
            };
        }
        v
    }

    /// The proxy's IPv4 addresses (resolved now, by the host's resolver).
    pub async fn resolve(&self) -> Result<Vec<Ipv4Addr>, String> {
        if let Ok(ip) = self.host.parse::<Ipv4Addr>() {
            return Ok(vec![ip]);
        }
        let addrs = tokio::time::timeout(
            Duration::from_secs(5),
            tokio::net::lookup_host((self.host.as_str(), self.port)),
        )
        .await
        .map_err(|_| bad(format!("resolving {} timed out", self.host)))?
        .map_err(|e| bad(format!("{} does not resolve: {e}", self.host)))?;
        let v4: Vec<Ipv4Addr> = addrs
            .filter_map(|a| match a {
                SocketAddr::V4(a) => Some(*a.ip()),
                SocketAddr::V6(_) => None,
            })
            .collect();
        if v4.is_empty() {
            return Err(bad(format!("{} has no IPv4 address", self.host)));
        }
        Ok(v4)
    }

    /// Checks at create/update that the proxy resolves to addresses sandboxes may reach
    /// (never a private, loopback or link-local one).
    pub async fn check_public(&self) -> Result<(), String> {
        for ip in self.resolve().await? {
            if let Some(c) = crate::addr::always_denied().iter().find(|c| c.contains(ip)) {
                return Err(bad(format!(
                    "{} resolves to {ip}, in the always-denied range {c}: the proxy must have \
                     a public address",
                    self.host
                )));
            }
        }
        Ok(())
    }

    /// A connection to `target` through the proxy (re-resolved for this dial), from the router
    /// namespace's socket maker; any failure is the connection's failure.
    pub(crate) async fn dial(
        &self,
        sockets: &SocketMaker,
        target: SocketAddrV4,
        timeout: Duration,
    ) -> std::io::Result<UpStream> {
        let io = |m: String| std::io::Error::other(format!("egress proxy {}: {m}", self.address));
        let ip = self
            .resolve()
            .await
            .map_err(io)?
            .first()
            .copied()
            .ok_or_else(|| io("no address".into()))?;
        if crate::addr::always_denied().iter().any(|c| c.contains(ip)) {
            return Err(io(format!("{ip} is not a public address")));
        }
        let tcp = sockets
            .connect(SocketAddr::from((ip, self.port)), timeout)
            .await
            .map_err(|e| io(e.to_string()))?;
        let stream = match &self.tls {
            None => UpStream::Tcp(tcp),
            Some(t) => {
                let roots = match &t.ca_cert {
                    Some(pem) => Arc::new(parse_ca(pem).map_err(io)?),
                    None => host_roots()?,
                };
                let provider = Arc::new(rustls::crypto::ring::default_provider());
                let cfg = rustls::ClientConfig::builder_with_provider(provider)
                    .with_safe_default_protocol_versions()
                    .map_err(|e| io(e.to_string()))?
                    .with_root_certificates(roots)
                    .with_no_client_auth();
                let sn = ServerName::try_from(t.server_name.clone())
                    .map_err(|_| io("bad server name".into()))?;
                let hs = tokio_rustls::TlsConnector::from(Arc::new(cfg)).connect(sn, tcp);
                let s = tokio::time::timeout(timeout, hs)
                    .await
                    .map_err(|_| io("the TLS handshake timed out".into()))?
                    .map_err(|e| io(format!("TLS: {e}")))?;
                UpStream::Tls(Box::new(s))
            }
        };
        let hs = async {
            match (&self.username, &self.password) {
                (Some(u), p) => {
                    tokio_socks::tcp::Socks5Stream::connect_with_password_and_socket(
                        stream,
                        SocketAddr::V4(target),
                        u,
                        p.as_deref().unwrap_or(""),
                    )
                    .await
                }
                (None, _) => {
                    tokio_socks::tcp::Socks5Stream::connect_with_socket(
                        stream,
                        SocketAddr::V4(target),
                    )
                    .await
                }
            }
        };
        let s = tokio::time::timeout(timeout, hs)
            .await
            .map_err(|_| io("the SOCKS5 handshake timed out".into()))?
            .map_err(|e| io(e.to_string()))?;
        Ok(s.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configs_parse_and_never_show_the_password() {
        let c = EgressProxyConfig::parse(&json!({
            "address": "proxy.test:1080", "username": "u", "password": "secret-pw"
        }))
        .unwrap();
        assert_eq!(
            c.info_json(),
            json!({"address": "proxy.test:1080", "username": "u"})
        );
        assert!(!format!("{c:?}").contains("secret-pw"));
        let t = EgressProxyConfig::parse(&json!({
            "address": "proxy.test:1080", "tls": {"enabled": true, "serverName": "p.test"}
        }))
        .unwrap();
        assert_eq!(t.tls.as_ref().unwrap().server_name, "p.test");
        assert_eq!(
            t.info_json(),
            json!({"address": "proxy.test:1080", "tls": {"enabled": true, "serverName": "p.test"}})
        );
        let t = EgressProxyConfig::parse(&json!({"address": "h.test:1", "tls": {"enabled": true}}))
            .unwrap();
        assert_eq!(t.tls.unwrap().server_name, "h.test");
        for bad in [
            json!({}),
            json!({"address": "nohost"}),
            json!({"address": "h:0"}),
            json!({"address": "h:1080", "password": "p"}),
            json!({"address": "h:1080", "username": "x".repeat(256)}),
            json!({"address": "h:1080", "tls": {"enabled": true, "caCert": "not pem"}}),
            json!({"address": "h:1080", "tls": {"enabled": true, "serverName": ""}}),
            json!({"address": "h:1080", "other": 1}),
        ] {
            assert!(EgressProxyConfig::parse(&bad).is_err(), "{bad}");
        }
    }

    #[tokio::test]
    async fn private_proxies_are_refused() {
        let c = EgressProxyConfig::parse(&json!({"address": "10.1.2.3:1080"})).unwrap();
        assert!(c
            .check_public()
            .await
            .unwrap_err()
            .contains("always-denied"));
        let c = EgressProxyConfig::parse(&json!({"address": "198.51.100.9:1080"})).unwrap();
        c.check_public().await.unwrap();
    }
}
