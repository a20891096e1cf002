//! Host trust for egress: the CA certificates the host added to its own trust store (the
//! `*.crt` files under `/usr/local/share/ca-certificates`, `kiln serve --host-ca-dir`; a
//! TLS-inspecting proxy's, a company CA) are trusted inside every sandbox too, so a sandbox
//! works behind the same proxy as its host. On by default (`kiln serve --host-cas off`).
//!
//! The server reads them at start ([`HostCas::read`]: certificates only, re-encoded from their
//! DER, anything else in the files ignored). Each create puts them in the sandbox's trust
//! store before answering: [`HOST_FILE`] holds them, and those the system bundle lacks are
//! appended to it; the create also sets `SSL_CERT_FILE`, `REQUESTS_CA_BUNDLE`, `PIP_CERT`
//! (the bundle) and `NODE_EXTRA_CA_CERTS` ([`HOST_FILE`]) unless the request sets them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use base64::Engine;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;

use super::rules::BUNDLE;
use super::{ApiError, ApiResult, AppState};

/// Where the host's CAs go in a sandbox (Debian's layout).
pub const HOST_FILE: &str = "/usr/local/share/ca-certificates/kiln-host-cas.crt";
/// The directory `update-ca-certificates` reads on Debian-family hosts.
pub const DEFAULT_DIR: &str = "/usr/local/share/ca-certificates";
/// Most files and certificates read (a directory is not a dumping ground).
const MAX_FILES: usize = 256;
const MAX_FILE_BYTES: u64 = 1 << 20;

/// The host's extra CA certificates, as PEM.
#[derive(Debug, Clone, Default)]
pub struct HostCas {
    /// One PEM block per certificate.
    pub certs: Vec<String>,
}

fn pem_of(der: &[u8]) -> String {
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let mut out = String::from("-----BEGIN CERTIFICATE-----\n");
    for line in b64.as_bytes().chunks(64) {
        out.push_str(&String::from_utf8_lossy(line));
        out.push('\n');
    }
    out.push_str("-----END CERTIFICATE-----\n");
    out
}

/// The `*.crt` files under `dir` (its subdirectories too, as `update-ca-certificates` reads
/// them), sorted.
fn crt_files(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d)? {
            let p = e?.path();
            let meta = std::fs::metadata(&p)?;
            if meta.is_dir() {
                todo.push(p);
            } else if meta.is_file()
                && meta.len() <= MAX_FILE_BYTES
                && p.extension().is_some_and(|x| x == "crt")
            {
                out.push(p);
            }
            if out.len() >= MAX_FILES {
                break;
            }
        }
    }
    out.sort();
    Ok(out)
}

impl HostCas {
    /// The certificates of the `*.crt` files under `dir` (none when it does not exist).
    pub fn read(dir: &Path) -> std::io::Result<Self> {
        if !dir.is_dir() {
            return Ok(Self::default());
        }
        let mut certs = Vec::new();
        for f in crt_files(dir)? {
            let bytes = std::fs::read(&f)?;
            for c in CertificateDer::pem_slice_iter(&bytes).flatten() {
                let pem = pem_of(c.as_ref());
                if !certs.contains(&pem) && certs.len() < MAX_FILES {
                    certs.push(pem);
                }
            }
        }
        Ok(Self { certs })
    }

    pub fn is_empty(&self) -> bool {
        self.certs.is_empty()
    }

    /// Environment a create adds (where the request does not set it).
    pub fn trust_env(&self, env: &mut BTreeMap<String, String>) {
        if self.is_empty() {
            return;
        }
        for (k, v) in [
            ("SSL_CERT_FILE", BUNDLE),
            ("REQUESTS_CA_BUNDLE", BUNDLE),
            ("PIP_CERT", BUNDLE),
            ("NODE_EXTRA_CA_CERTS", HOST_FILE),
        ] {
            env.entry(k.to_string()).or_insert_with(|| v.to_string());
        }
    }
}

/// Puts the host's CAs in sandbox `id`'s trust store.
pub async fn install(st: &AppState, id: &str, token: Option<String>) -> ApiResult<()> {
    let Some(cas) = st.host_cas.as_ref().filter(|c| !c.is_empty()) else {
        return Ok(());
    };
    let agent = st.manager.agent(id, token);
    let fail = |what: &str, e: kiln_envd::EnvdError| {
        ApiError::bad_gateway(format!(
            "adding the host's CA certificates to the sandbox's trust store ({what}): {e}"
        ))
    };
    // The two calls are independent: one round trip for both.
    let (written, bundle) = tokio::join!(
        agent.write_file(HOST_FILE, cas.certs.concat().into_bytes(), Some("root")),
        agent.read_file(BUNDLE, Some("root")),
    );
    written.map_err(|e| fail(HOST_FILE, e))?;
    let mut bundle = bundle.unwrap_or_default();
    let have = String::from_utf8_lossy(&bundle).replace("\r\n", "\n");
    let missing: Vec<&String> = cas
        .certs
        .iter()
        .filter(|c| !have.contains(c.trim()))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    if !bundle.is_empty() && !bundle.ends_with(b"\n") {
        bundle.push(b'\n');
    }
    for c in missing {
        bundle.extend_from_slice(c.as_bytes());
    }
    agent
        .write_file(BUNDLE, bundle, Some("root"))
        .await
        .map_err(|e| fail(BUNDLE, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn certificates_only_from_crt_files() {
        let dir = tempfile::tempdir().unwrap();
        let cert = rcgen_free_cert();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        std::fs::write(dir.path().join("a.crt"), format!("junk\n{cert}")).unwrap();
        std::fs::write(dir.path().join("sub/b.crt"), &cert).unwrap();
        std::fs::write(dir.path().join("c.pem"), &cert).unwrap();
        std::fs::write(
            dir.path().join("d.crt"),
            "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
        )
        .unwrap();
        let cas = HostCas::read(dir.path()).unwrap();
        // The same certificate twice is kept once; the key and the .pem are not read.
        assert_eq!(cas.certs.len(), 1);
        assert_eq!(cas.certs[0].trim(), cert.trim());
        let mut env = BTreeMap::from([("PIP_CERT".to_string(), "mine".to_string())]);
        cas.trust_env(&mut env);
        assert_eq!(env["PIP_CERT"], "mine");
        assert_eq!(env["REQUESTS_CA_BUNDLE"], BUNDLE);
        assert!(HostCas::read(&dir.path().join("none")).unwrap().is_empty());
    }

    /// A certificate in PEM, 64-column lines (as `pem_of` writes them).
    fn rcgen_free_cert() -> String {
        let der: Vec<u8> = (0u8..200).collect();
        pem_of(&der)
    }
}
