//! Trust for egress: the CA certificates a sandbox trusts besides its template's roots.
//!
//! Two kinds: the host's extra CAs (the `*.crt` files under `/usr/local/share/ca-certificates`,
//! `kiln serve --host-ca-dir`; a TLS-inspecting proxy's, a company CA), so a sandbox works
//! behind the same proxy as its host (on by default, `kiln serve --host-cas off`), and kiln's
//! interception CA (`network.rules`), trusted from create on so rules added later by `PUT
//! /sandboxes/{id}/network` need no change inside the sandbox.
//!
//! The server reads the host's at start ([`HostCas::read`]: certificates only, re-encoded from
//! their DER, anything else in the files ignored) and gives the manager the list
//! ([`extra_cas`]). Every create, the API's and a template build's alike ([`create`]), puts
//! them in the sandbox's trust store before answering — the manager's `/init` carries them and
//! the agent installs them: [`EXTRA_FILE`] holds them all (Node's `NODE_EXTRA_CA_CERTS` reads
//! one file), and those the system bundle lacks are appended to it; the create also sets
//! `SSL_CERT_FILE`, `REQUESTS_CA_BUNDLE`, `PIP_CERT` (the bundle) and `NODE_EXTRA_CA_CERTS`
//! ([`EXTRA_FILE`]) unless the request sets them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use base64::Engine;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;

use crate::manager::{CreateParams, SandboxService};
use crate::store::SandboxRecord;

/// Where the extra CAs go in a sandbox, all in one file.
pub const EXTRA_FILE: &str = kiln_proto::envd::TRUST_EXTRA_FILE;
/// The system bundle of a sandbox, where the extra CAs are appended.
pub const BUNDLE: &str = kiln_proto::envd::TRUST_BUNDLE;
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
}

/// Every CA a sandbox trusts besides its template's roots: the host's (`host`, when on) and
/// kiln's interception CA (`interception`, PEM), each once.
pub fn extra_cas(host: Option<&HostCas>, interception: Option<&str>) -> Vec<String> {
    let mut out: Vec<String> = host.map(|h| h.certs.clone()).unwrap_or_default();
    if let Some(pem) = interception {
        let pem = format!("{}\n", pem.trim());
        if !out.iter().any(|c| c.trim() == pem.trim()) {
            out.push(pem);
        }
    }
    out
}

/// Environment a create adds when there are extra CAs (where the request does not set it).
pub fn trust_env(cas: &[String], env: &mut BTreeMap<String, String>) {
    if cas.is_empty() {
        return;
    }
    for (k, v) in [
        ("SSL_CERT_FILE", BUNDLE),
        ("REQUESTS_CA_BUNDLE", BUNDLE),
        ("PIP_CERT", BUNDLE),
        ("NODE_EXTRA_CA_CERTS", EXTRA_FILE),
    ] {
        env.entry(k.to_string()).or_insert_with(|| v.to_string());
    }
}

/// Creates a sandbox that trusts the manager's extra CAs: its environment names them, and the
/// manager's `/init` has put them in its trust store before this returns.
pub async fn create(
    manager: &dyn SandboxService,
    mut p: CreateParams,
) -> crate::error::Result<SandboxRecord> {
    trust_env(manager.extra_cas(), &mut p.env_vars);
    manager.create(p).await
}

/// Puts the manager's extra CAs in running sandbox `id`'s trust store (one `/init` that
/// carries only them; the agent writes what is missing).
pub async fn install(
    manager: &dyn SandboxService,
    id: &str,
    token: Option<String>,
) -> crate::error::Result<()> {
    let Some(init) = crate::manager::trust_init(manager.extra_cas()) else {
        return Ok(());
    };
    manager.agent(id, token).init(&init).await.map_err(|e| {
        crate::error::Error::create("adding the extra CA certificates to its trust store")(e.into())
    })
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
        trust_env(&cas.certs, &mut env);
        assert_eq!(env["PIP_CERT"], "mine");
        assert_eq!(env["REQUESTS_CA_BUNDLE"], BUNDLE);
        assert_eq!(env["NODE_EXTRA_CA_CERTS"], EXTRA_FILE);
        assert!(HostCas::read(&dir.path().join("none")).unwrap().is_empty());
        let mut none = BTreeMap::new();
        trust_env(&[], &mut none);
        assert!(none.is_empty());
    }

    #[test]
    fn one_list_with_the_interception_ca_last_and_once() {
        let host = HostCas {
            certs: vec![pem_of(&[1, 2, 3]), pem_of(&[4, 5, 6])],
        };
        let kiln = pem_of(&[7, 8, 9]);
        let all = extra_cas(Some(&host), Some(kiln.trim()));
        assert_eq!(all.len(), 3);
        assert_eq!(all[2].trim(), kiln.trim());
        assert_eq!(extra_cas(Some(&host), Some(&host.certs[0])).len(), 2);
        assert_eq!(extra_cas(None, Some(&kiln)), vec![kiln.clone()]);
        assert!(extra_cas(None, None).is_empty());
    }

    /// A certificate in PEM, 64-column lines (as `pem_of` writes them).
    fn rcgen_free_cert() -> String {
        let der: Vec<u8> = (0u8..200).collect();
        pem_of(&der)
    }
}
