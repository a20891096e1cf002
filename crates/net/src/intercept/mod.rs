//! TLS interception for `network.rules` (E2B's header transforms): for hosts a rule names,
//! and only those, the egress proxy terminates the sandbox's TLS with a leaf of the server's
//! own CA ([`ca`]), verifies the upstream's certificate against the host's trust store,
//! sets the rule's headers on every request ([`transform`]) and relays HTTP ([`mitm`]).
//! Secret placeholders are resolved per request from a [`SecretSource`] (the server's vault),
//! workload identity placeholders minted per request by a [`TokenSource`] (the server's
//! token issuer): the value exists only in the proxy, on its way to the upstream.

pub mod bench;
pub mod ca;
pub mod mitm;
pub mod transform;

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;

pub use ca::Ca;
pub use transform::{HostRules, RuleSet};

use crate::{NetError, Result};

/// Where a team's secrets come from.
pub trait SecretSource: Send + Sync {
    /// The current value of `team`'s secret `name` (`None`: there is none); an error says
    /// why it could not be read.
    fn value<'a>(
        &'a self,
        team: &'a str,
        name: &'a str,
    ) -> Pin<Box<dyn Future<Output = Result<Option<String>, String>> + Send + 'a>>;
}

/// Where a sandbox's workload identity tokens come from (E2B's `iam.tokens`).
pub trait TokenSource: Send + Sync {
    /// A freshly minted token named `name`; an error says why there is none.
    fn mint(&self, name: &str) -> Result<String, String>;
    /// Tells the source which sandbox the policy holding it was put in force for (the
    /// tokens' subject); called before the sandbox runs and on every update.
    fn bind(&self, _sandbox: &str) {}
}

/// The host's usual CA bundles (Debian/Ubuntu/Alpine, RHEL family, others).
const HOST_BUNDLES: &[&str] = &[
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/cert.pem",
];

/// Environment variable naming extra PEM files (`:`-separated) the upstream check trusts
/// besides the host's store (a private or test CA).
pub const EXTRA_TRUST_ENV: &str = "KILN_EGRESS_TRUST";

/// The host's trust store plus the certificates in `extra` (PEM files).
pub fn host_roots(extra: &[PathBuf]) -> Result<rustls::RootCertStore> {
    let mut roots = rustls::RootCertStore::empty();
    let bundle = HOST_BUNDLES.iter().map(Path::new).find(|p| p.is_file());
    for path in bundle.into_iter().chain(extra.iter().map(PathBuf::as_path)) {
        let certs = CertificateDer::pem_file_iter(path)
            .map_err(|e| NetError::Config(format!("trust store {}: {e}", path.display())))?;
        for c in certs.flatten() {
            // Certificates the verifier cannot use are skipped, as every TLS client does.
            let _ = roots.add(c);
        }
    }
    Ok(roots)
}

/// The server-wide part: the CA and the upstream TLS client.
pub struct Interceptor {
    pub ca: Ca,
    upstream: Arc<rustls::ClientConfig>,
    roots: usize,
}

impl std::fmt::Debug for Interceptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Interceptor")
            .field("roots", &self.roots)
            .finish()
    }
}

impl Interceptor {
    /// The interceptor of state directory `dir` (its CA made there at first use), trusting
    /// the host's store plus the certificates in `extra` upstream.
    pub fn open(dir: &Path, extra: &[PathBuf]) -> Result<Self> {
        let ca = Ca::open(dir)?;
        let roots = host_roots(extra)?;
        let n = roots.len();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| NetError::Config(format!("TLS versions: {e}")))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Self {
            ca,
            upstream: Arc::new(cfg),
            roots: n,
        })
    }

    /// The extra trust files named by [`EXTRA_TRUST_ENV`].
    pub fn extra_trust_from_env() -> Vec<PathBuf> {
        std::env::var(EXTRA_TRUST_ENV)
            .unwrap_or_default()
            .split(':')
            .filter(|s| !s.is_empty())
            .map(PathBuf::from)
            .collect()
    }

    /// How many certificates the upstream check trusts.
    pub fn root_count(&self) -> usize {
        self.roots
    }

    pub(crate) fn upstream(&self) -> Arc<rustls::ClientConfig> {
        self.upstream.clone()
    }
}

/// A sandbox's rules, with what applying them needs: its team, the secrets, its workload
/// identity tokens (if it has any) and the interceptor. Two are equal when their rules and
/// team are.
#[derive(Clone)]
pub struct Transforms {
    pub rules: RuleSet,
    pub team: String,
    pub secrets: Arc<dyn SecretSource>,
    pub tokens: Option<Arc<dyn TokenSource>>,
    pub interceptor: Arc<Interceptor>,
}

impl PartialEq for Transforms {
    fn eq(&self, o: &Self) -> bool {
        self.rules == o.rules && self.team == o.team
    }
}

impl Eq for Transforms {}

impl std::fmt::Debug for Transforms {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transforms")
            .field("rules", &self.rules)
            .field("team", &self.team)
            .finish()
    }
}
