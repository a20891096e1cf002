//! A bearer-token issuer for the test registry (distribution's `auth.token`): a loopback HTTP
//! endpoint answering `GET /token?service=…&scope=repository:NAME:ACTIONS` with an ES256 JWT
//! whose `x5c` header carries a self-signed certificate (made with `openssl`) that the registry
//! trusts as its root bundle. Anonymous requests get pull access; Basic credentials must match
//! and get what they ask for; wrong ones get 401.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;

use base64::Engine;

pub const SERVICE: &str = "kiln-test-registry";
pub const ISSUER: &str = "kiln-test-issuer";

pub struct TokenServer {
    pub realm: String,
    pub cert_pem: PathBuf,
}

fn openssl(args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .output()
        .expect("running openssl");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn b64url(b: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b)
}

impl TokenServer {
    pub fn start(dir: &Path, user: &str, password: &str) -> TokenServer {
        let p = |n: &str| dir.join(n).display().to_string();
        openssl(&[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            &p("key.pem"),
            "-out",
            &p("cert.pem"),
            "-subj",
            "/CN=kiln-test-issuer",
            "-days",
            "1",
        ]);
        openssl(&[
            "pkcs8",
            "-topk8",
            "-nocrypt",
            "-in",
            &p("key.pem"),
            "-outform",
            "DER",
            "-out",
            &p("key.der"),
        ]);
        openssl(&[
            "x509",
            "-in",
            &p("cert.pem"),
            "-outform",
            "DER",
            "-out",
            &p("cert.der"),
        ]);
        let rng = ring::rand::SystemRandom::new();
        let key = ring::signature::EcdsaKeyPair::from_pkcs8(
            &ring::signature::ECDSA_P256_SHA256_FIXED_SIGNING,
            &std::fs::read(dir.join("key.der")).unwrap(),
            &rng,
        )
        .unwrap();
        let cert = base64::engine::general_purpose::STANDARD
            .encode(std::fs::read(dir.join("cert.der")).unwrap());
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let realm = format!("http://{}/token", listener.local_addr().unwrap());
        let expected = format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"))
        );
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let mut reader = BufReader::new(conn.try_clone().unwrap());
                let mut first = String::new();
                let _ = reader.read_line(&mut first);
                let mut auth = None;
                loop {
                    let mut l = String::new();
                    if reader.read_line(&mut l).unwrap_or(0) == 0 || l.trim().is_empty() {
                        break;
                    }
                    if let Some((k, v)) = l.split_once(':') {
                        if k.eq_ignore_ascii_case("authorization") {
                            auth = Some(v.trim().to_string());
                        }
                    }
                }
                let mut conn = conn;
                let target = first.split_whitespace().nth(1).unwrap_or("");
                let query = target.split_once('?').map_or("", |(_, q)| q);
                let (status, body) = match &auth {
                    Some(a) if *a != expected => (
                        "401 Unauthorized",
                        r#"{"details":"incorrect username or password"}"#.to_string(),
                    ),
                    _ => {
                        let access: Vec<serde_json::Value> = query
                            .split('&')
                            .filter_map(|kv| kv.strip_prefix("scope="))
                            .map(|s| s.replace("%3A", ":").replace("%2F", "/").replace("%2C", ","))
                            .filter_map(|s| {
                                let mut parts = s.splitn(3, ':');
                                let (kind, name, actions) = (parts.next()?, parts.next()?, parts.next()?);
                                let actions: Vec<&str> = actions
                                    .split(',')
                                    .filter(|a| auth.is_some() || *a == "pull")
                                    .collect();
                                Some(serde_json::json!({"type": kind, "name": name, "actions": actions}))
                            })
                            .collect();
                        let now = std::time::SystemTime::now()
                            .duration_since(std::time::UNIX_EPOCH)
                            .unwrap()
                            .as_secs();
                        let header =
                            serde_json::json!({"typ": "JWT", "alg": "ES256", "x5c": [cert]});
                        let claims = serde_json::json!({
                            "iss": ISSUER, "sub": if auth.is_some() { "kiln" } else { "" }, "aud": SERVICE,
                            "exp": now + 300, "nbf": now - 10, "iat": now, "jti": format!("{now}-{}", rand_id()),
                            "access": access,
                        });
                        let signing_input = format!(
                            "{}.{}",
                            b64url(header.to_string().as_bytes()),
                            b64url(claims.to_string().as_bytes())
                        );
                        let sig = key.sign(&rng, signing_input.as_bytes()).unwrap();
                        let jwt = format!("{signing_input}.{}", b64url(sig.as_ref()));
                        ("200 OK", serde_json::json!({"token": jwt, "access_token": jwt, "expires_in": 300}).to_string())
                    }
                };
                let _ = write!(
                    conn,
                    "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        TokenServer {
            realm,
            cert_pem: dir.join("cert.pem"),
        }
    }

    /// The registry's `auth:` section for this issuer.
    pub fn registry_auth(&self) -> String {
        format!(
            "auth:\n  token:\n    realm: {}\n    service: {SERVICE}\n    issuer: {ISSUER}\n    rootcertbundle: {}\n",
            self.realm,
            self.cert_pem.display()
        )
    }
}

fn rand_id() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}
