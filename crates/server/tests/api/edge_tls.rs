//! TLS and HTTP/2 on the server's listener, over real TCP with curl as the client (no sandbox
//! needed): a test CA and a wildcard certificate made with the `openssl` CLI; ALPN h2 and
//! http/1.1 over TLS, h2c with prior knowledge and HTTP/1.1 in plain text on the same port; a
//! name outside the certificate is refused by the client; a silent client is dropped.

use crate::common;

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use kiln_server::edge::EdgeConfig;
use tokio::io::AsyncReadExt;

/// The domain of `common::app`.
const DOMAIN: &str = "kiln.test";

/// Whether curl and openssl are here, under the skip policy of [`kiln_testkit`].
fn require_tools() -> bool {
    kiln_testkit::needs().tools(&["curl", "openssl"]).ok()
}

fn sh(dir: &Path, args: &[&str]) {
    let out = Command::new(args[0])
        .args(&args[1..])
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Writes `ca.pem` and a certificate `cert.pem`/`key.pem` for `DOMAIN` and `*.DOMAIN`
/// signed by it.
pub fn make_certs(dir: &Path) {
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
    ];
    let mut ca = vec!["openssl", "req", "-x509", "-days", "2"];
    ca.extend(ec);
    ca.extend([
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-subj",
        "/CN=kiln test CA",
    ]);
    sh(dir, &ca);
    let mut csr = vec!["openssl", "req"];
    csr.extend(ec);
    csr.extend([
        "-keyout",
        "key.pem",
        "-out",
        "leaf.csr",
        "-subj",
        "/CN=kiln.test",
    ]);
    sh(dir, &csr);
    std::fs::write(
        dir.join("ext.cnf"),
        format!(
            "subjectAltName=DNS:{DOMAIN},DNS:*.{DOMAIN}\nbasicConstraints=CA:FALSE\n\
             keyUsage=digitalSignature\nextendedKeyUsage=serverAuth\n"
        ),
    )
    .unwrap();
    sh(
        dir,
        &[
            "openssl",
            "x509",
            "-req",
            "-in",
            "leaf.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-out",
            "cert.pem",
            "-extfile",
            "ext.cnf",
        ],
    );
}

struct Fixture {
    addr: SocketAddr,
    key: String,
    certs: tempfile::TempDir,
    _dir: tempfile::TempDir,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for Fixture {
    fn drop(&mut self) {
        self.server.abort();
    }
}

async fn start() -> Fixture {
    let certs = tempfile::tempdir().unwrap();
    make_certs(certs.path());
    let tls = kiln_server::tls::load(
        &certs.path().join("cert.pem"),
        &certs.path().join("key.pem"),
    )
    .unwrap();
    let dir = common::state_dir();
    let (app, key) = common::empty_app(dir.path()).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let cfg = EdgeConfig {
        tls: Some(tls),
        header_timeout: Duration::from_secs(1),
        ..EdgeConfig::default()
    };
    let server = tokio::spawn(kiln_server::edge::serve(listener, app, cfg));
    Fixture {
        addr,
        key,
        certs,
        _dir: dir,
        server,
    }
}

/// Runs curl against `/sandboxes` at `url_host` (resolved to the fixture) with `flags`;
/// returns curl's exit code and `"<http_version> <status>"`.
async fn curl(f: &Fixture, scheme: &str, host: &str, flags: &[&str]) -> (i32, String) {
    let port = f.addr.port();
    let url = format!("{scheme}://{host}:{port}/sandboxes");
    let resolve = format!("{host}:{port}:127.0.0.1");
    let ca = f.certs.path().join("ca.pem");
    let key = format!("X-API-Key: {}", f.key);
    let mut args: Vec<String> = vec![
        "-sS".into(),
        "-o".into(),
        "/dev/null".into(),
        "-m".into(),
        "20".into(),
        "--resolve".into(),
        resolve,
        "--cacert".into(),
        ca.display().to_string(),
        "-H".into(),
        key,
        "-w".into(),
        "%{http_version} %{http_code}".into(),
    ];
    args.extend(flags.iter().map(|s| s.to_string()));
    args.push(url);
    let out = tokio::process::Command::new("curl")
        .args(&args)
        .output()
        .await
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).trim().to_string(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_alpn_h2_and_plain_h2c_share_the_port() {
    if !require_tools() {
        return;
    }
    let f = start().await;
    let api = format!("api.{DOMAIN}");
    let sandbox_host = format!("49983-abc.{DOMAIN}");
    // TLS, ALPN picks h2.
    assert_eq!(
        curl(&f, "https", &api, &["--http2"]).await,
        (0, "2 200".into())
    );
    // TLS, HTTP/1.1 only.
    assert_eq!(
        curl(&f, "https", &api, &["--http1.1"]).await,
        (0, "1.1 200".into())
    );
    // The wildcard covers sandbox host names (routed to the proxy: no such sandbox → 502).
    assert_eq!(
        curl(&f, "https", &sandbox_host, &["--http2"]).await,
        (0, "2 502".into())
    );
    // Plain text on the same port: h2c with prior knowledge, and HTTP/1.1.
    assert_eq!(
        curl(&f, "http", &api, &["--http2-prior-knowledge"]).await,
        (0, "2 200".into())
    );
    assert_eq!(curl(&f, "http", &api, &[]).await, (0, "1.1 200".into()));
    // A name the certificate does not cover: the client refuses it (curl: 60).
    let (code, _) = curl(&f, "https", "other.example", &[]).await;
    assert_eq!(
        code, 60,
        "a name outside the certificate must fail verification"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_speaks_or_stalls_its_handshake_is_dropped() {
    if !require_tools() {
        return;
    }
    let f = start().await;
    // Says nothing: closed after the header timeout (1 s here).
    let mut s = tokio::net::TcpStream::connect(f.addr).await.unwrap();
    let mut buf = [0u8; 64];
    let r = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf)).await;
    assert!(matches!(r, Ok(Ok(0)) | Ok(Err(_))), "not closed: {r:?}");
    // Starts a TLS record and stalls: closed too.
    let mut s = tokio::net::TcpStream::connect(f.addr).await.unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut s, &[0x16, 0x03, 0x01])
        .await
        .unwrap();
    let r = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf)).await;
    assert!(matches!(r, Ok(Ok(0)) | Ok(Err(_))), "not closed: {r:?}");
    // The server still serves.
    assert_eq!(
        curl(&f, "https", &format!("api.{DOMAIN}"), &[]).await,
        (0, "2 200".into())
    );
}

#[test]
fn a_key_that_is_not_the_certificates_is_refused_at_start() {
    if !require_tools() {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    make_certs(d.path());
    // The CA's key with the leaf certificate.
    let e = kiln_server::tls::load(&d.path().join("cert.pem"), &d.path().join("ca.key"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("do not go together"), "{e}");
    let e = kiln_server::tls::load(&d.path().join("cert.pem"), &d.path().join("leaf.csr"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("no usable private key"), "{e}");
    assert!(kiln_server::tls::load(&d.path().join("cert.pem"), &d.path().join("key.pem")).is_ok());
}
