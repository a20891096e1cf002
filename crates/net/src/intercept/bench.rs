//! What interception costs a request, measured on loopback (for `kiln bench net`): an HTTPS
//! upstream of its own (certificate from a CA made here), a keep-alive client sending small
//! GETs to it directly, through a plain TCP relay (what the egress proxy does for a host
//! without a rule: the same request without a rule), and through [`super::mitm::relay`] with a
//! rule that injects a secret header. The connections are reused for every request (E2B's
//! clients keep them alive), and the requests alternate, so all see the same machine.

use std::convert::Infallible;
use std::path::Path;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use tokio::net::{TcpListener, TcpStream};

use super::{Interceptor, RuleSet, SecretSource, Transforms};

const NAME: &str = "bench.kiln.test";

type Err = Box<dyn std::error::Error + Send + Sync>;

struct Fixed;
impl SecretSource for Fixed {
    fn value<'a>(
        &'a self,
        _team: &'a str,
        _name: &'a str,
    ) -> std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Option<String>, String>> + Send + 'a>,
    > {
        Box::pin(async { Ok(Some("bench-secret".to_string())) })
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// An HTTPS server on `l` answering 100 bytes (`A` when the request carried the injected
/// header), its certificate for `names` signed by a CA made here (written to
/// `dir/upstream-ca.pem`). Serves until the runtime ends.
pub fn serve_upstream(dir: &Path, l: TcpListener, names: &[&str]) -> Result<(), Err> {
    let ca_key = KeyPair::generate()?;
    let mut ca = CertificateParams::default();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    // Names of their own: a leaf whose issuer reads as its subject looks self-signed to OpenSSL.
    ca.distinguished_name
        .push(DnType::CommonName, "kiln bench upstream CA");
    let ca_cert = ca.self_signed(&ca_key)?;
    std::fs::write(dir.join("upstream-ca.pem"), ca_cert.pem())?;
    let issuer = Issuer::new(ca, ca_key);
    let key = KeyPair::generate()?;
    let names = names.iter().map(|n| n.to_string()).collect::<Vec<_>>();
    let mut leaf = CertificateParams::new(names.clone())?;
    leaf.distinguished_name.push(
        DnType::CommonName,
        names.first().cloned().unwrap_or_default(),
    );
    let leaf = leaf.signed_by(&key, &issuer)?;
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(
            vec![leaf.der().clone()],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        )?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(cfg));
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(s).await else {
                    return;
                };
                let svc = hyper::service::service_fn(|req: Request<Incoming>| async move {
                    let c = if req.headers().get("authorization").is_some() {
                        b'A'
                    } else {
                        b'-'
                    };
                    Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(vec![c; 100]))))
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tls), svc)
                    .await;
            });
        }
    });
    Ok(())
}

/// A rule for `name` injecting `Authorization: Bearer <a fixed secret>`, as a sandbox's
/// policy carries it.
pub fn rule_for(name: &str, interceptor: Arc<Interceptor>) -> Result<Transforms, Err> {
    let rules = RuleSet::parse(&serde_json::json!({name: [{"transform": {"headers": {
        "Authorization": "Bearer ${e2b.secrets.key}"}}}]}))?;
    Ok(Transforms {
        rules,
        team: "bench".into(),
        secrets: Arc::new(Fixed),
        tokens: None,
        interceptor,
    })
}

type Sender = hyper::client::conn::http1::SendRequest<Empty<Bytes>>;

/// A keep-alive HTTPS client connection to `addr` trusting `ca_pem` only.
async fn client(addr: std::net::SocketAddr, ca_pem: &str) -> Result<Sender, Err> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(CertificateDer::from_pem_slice(ca_pem.as_bytes())?)?;
    let cfg = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let tcp = TcpStream::connect(addr).await?;
    tcp.set_nodelay(true)?;
    let tls = tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(ServerName::try_from(NAME)?, tcp)
        .await?;
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await?;
    tokio::spawn(conn);
    Ok(sender)
}

/// One GET: its time and its body's first byte.
async fn get(s: &mut Sender) -> Result<(Duration, u8), Err> {
    let t = Instant::now();
    s.ready().await?;
    let req = Request::get("/small")
        .header(http::header::HOST, NAME)
        .body(Empty::new())?;
    let body = s.send_request(req).await?.into_body().collect().await?;
    let b = body.to_bytes();
    Ok((t.elapsed(), b.first().copied().unwrap_or(0)))
}

/// `requests` small GETs each way. `dir` holds the CAs.
pub async fn measure(dir: &Path, requests: usize) -> Result<Times, Err> {
    let l = TcpListener::bind("127.0.0.1:0").await?;
    let up = l.local_addr()?;
    serve_upstream(dir, l, &[NAME])?;
    let interceptor = Arc::new(Interceptor::open(
        &dir.join("kiln"),
        &[dir.join("upstream-ca.pem")],
    )?);
    let t = Arc::new(rule_for(NAME, interceptor.clone())?);
    let host = t.rules.hosts[0].clone();
    let l = TcpListener::bind("127.0.0.1:0").await?;
    let front = l.local_addr()?;
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            let (t, host) = (t.clone(), host.clone());
            tokio::spawn(async move {
                // As the egress proxy dials it; the sandbox's side is the relay's to set.
                let upstream = TcpStream::connect(up).await;
                if let Ok(u) = &upstream {
                    let _ = u.set_nodelay(true);
                }
                let n = || Arc::new(AtomicU64::new(0));
                let _ = super::mitm::relay(t, host, NAME, s, Vec::new(), upstream, n(), n()).await;
            });
        }
    });
    let relay = TcpListener::bind("127.0.0.1:0").await?;
    let plain_front = relay.local_addr()?;
    tokio::spawn(async move {
        while let Ok((mut s, _)) = relay.accept().await {
            tokio::spawn(async move {
                if let Ok(mut u) = TcpStream::connect(up).await {
                    let _ = (s.set_nodelay(true), u.set_nodelay(true));
                    let _ = tokio::io::copy_bidirectional(&mut s, &mut u).await;
                }
            });
        }
    });
    let upstream_ca = std::fs::read_to_string(dir.join("upstream-ca.pem"))?;
    let mut direct = client(up, &upstream_ca).await?;
    let mut plain = client(plain_front, &upstream_ca).await?;
    let mut through = client(front, interceptor.ca.cert_pem()).await?;
    let mut times = Times::default();
    for k in 0..requests + 5 {
        let (td, cd) = get(&mut direct).await?;
        let (tp, cp) = get(&mut plain).await?;
        let (ti, ci) = get(&mut through).await?;
        if (cd, cp, ci) != (b'-', b'-', b'A') {
            return Err("the intercepted request did not carry the injected header".into());
        }
        // The first few warm the connections up.
        if k >= 5 {
            times.direct.push(td);
            times.relayed.push(tp);
            times.intercepted.push(ti);
        }
    }
    Ok(times)
}

/// The request times of [`measure`].
#[derive(Debug, Default)]
pub struct Times {
    /// Straight to the upstream.
    pub direct: Vec<Duration>,
    /// Through a plain TCP relay (a host without a rule).
    pub relayed: Vec<Duration>,
    /// Through the interception relay with a rule.
    pub intercepted: Vec<Duration>,
}
