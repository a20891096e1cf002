//! The server's interception CA (ECDSA P-256, made with rcgen at first use): the certificate
//! in `egress-ca.pem` (what sandboxes trust), the key in `egress-ca.key` (mode 0600, never
//! leaves the host). Leaves are minted per server name on first use, cached, and short-lived
//! (a week; re-minted two days before they end).

use std::collections::HashMap;
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::sync::{Arc, Mutex};

use chrono::{Datelike, Duration, Utc};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SerialNumber,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

use crate::{NetError, Result};

pub const CA_CERT_FILE: &str = "egress-ca.pem";
pub const CA_KEY_FILE: &str = "egress-ca.key";
const CA_NAME: &str = "kiln egress interception CA";
const LEAF_DAYS: i64 = 7;
const RENEW_DAYS: i64 = 2;

/// Sets `p`'s validity from `from` to `to` (whole days, UTC).
fn validity(p: &mut CertificateParams, from: chrono::DateTime<Utc>, to: chrono::DateTime<Utc>) {
    p.not_before = rcgen::date_time_ymd(from.year(), from.month() as u8, from.day() as u8);
    p.not_after = rcgen::date_time_ymd(to.year(), to.month() as u8, to.day() as u8);
}

fn random_serial() -> SerialNumber {
    let mut b = [0u8; 16];
    rand_fill(&mut b);
    b[0] &= 0x7f;
    SerialNumber::from_slice(&b)
}

fn rand_fill(b: &mut [u8]) {
    use ring::rand::SecureRandom;
    // The system RNG failing is not recoverable.
    ring::rand::SystemRandom::new()
        .fill(b)
        .expect("system randomness");
}

fn ca_err(what: &str) -> impl FnOnce(rcgen::Error) -> NetError + '_ {
    move |e| NetError::Config(format!("{what}: {e}"))
}

/// The CA's own parameters: the same every time, so a reloaded key signs leaves whose issuer
/// is the certificate on disk.
fn ca_params() -> CertificateParams {
    let mut p = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, CA_NAME);
    dn.push(DnType::OrganizationName, "kiln");
    p.distinguished_name = dn;
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    p
}

/// A leaf: its chain and key, ready for a rustls server, and when to mint a new one.
struct Leaf {
    config: Arc<rustls::ServerConfig>,
    renew_at: chrono::DateTime<Utc>,
}

/// The CA and its leaf cache.
pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    cert_pem: String,
    cert_der: CertificateDer<'static>,
    leaves: Mutex<HashMap<String, Leaf>>,
}

fn write_new(path: &Path, data: &[u8], mode: u32) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)?;
    f.write_all(data)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}

/// The certificate and key (PEM) of the CA of directory `dir`, as [`Ca::open`] finds them.
pub fn read_pems(dir: &Path) -> Result<(String, String)> {
    let read = |name: &str| {
        let p = dir.join(name);
        std::fs::read_to_string(&p).map_err(crate::io_err(format!("reading {}", p.display())))
    };
    Ok((read(CA_CERT_FILE)?, read(CA_KEY_FILE)?))
}

/// Makes `cert_pem` and `key_pem` the CA of directory `dir` (the key mode 0600), after
/// checking that they are a CA certificate and its key; the next [`Ca::open`] loads them.
pub fn install(dir: &Path, cert_pem: &str, key_pem: &str) -> Result<()> {
    use rcgen::PublicKeyData;
    use rustls::pki_types::pem::PemObject;
    let key = KeyPair::from_pem(key_pem).map_err(ca_err("reading the egress CA key"))?;
    let cert = CertificateDer::from_pem_slice(cert_pem.as_bytes())
        .map_err(|e| NetError::Config(format!("egress CA certificate: {e}")))?;
    // The certificate holds the key's public half (its SubjectPublicKeyInfo, byte for byte).
    let spki = key.subject_public_key_info();
    if !cert.windows(spki.len()).any(|w| w == spki.as_slice()) {
        return Err(NetError::Config(
            "the egress CA certificate is not the key's".into(),
        ));
    }
    let io = |what: &str, p: &Path| crate::io_err(format!("{what} {}", p.display()));
    std::fs::create_dir_all(dir).map_err(io("making", dir))?;
    let (cert_path, key_path) = (dir.join(CA_CERT_FILE), dir.join(CA_KEY_FILE));
    write_new(&key_path, key_pem.as_bytes(), 0o600).map_err(io("writing", &key_path))?;
    write_new(&cert_path, cert_pem.as_bytes(), 0o644).map_err(io("writing", &cert_path))
}

impl Ca {
    /// The CA of directory `dir`: loaded, or made (and written) when there is none.
    pub fn open(dir: &Path) -> Result<Self> {
        let (cert_path, key_path) = (dir.join(CA_CERT_FILE), dir.join(CA_KEY_FILE));
        let io = |what: &str, p: &Path| crate::io_err(format!("{what} {}", p.display()));
        std::fs::create_dir_all(dir).map_err(io("making", dir))?;
        let (key, cert_pem) = match std::fs::read_to_string(&key_path) {
            Ok(k) => {
                std::fs::set_permissions(&key_path, std::fs::Permissions::from_mode(0o600))
                    .map_err(io("securing", &key_path))?;
                let key = KeyPair::from_pem(&k).map_err(ca_err("reading the egress CA key"))?;
                let cert =
                    std::fs::read_to_string(&cert_path).map_err(io("reading", &cert_path))?;
                (key, cert)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let key = KeyPair::generate().map_err(ca_err("making the egress CA key"))?;
                let mut p = ca_params();
                let now = Utc::now();
                validity(&mut p, now - Duration::days(1), now + Duration::days(3650));
                p.serial_number = Some(random_serial());
                let cert = p
                    .self_signed(&key)
                    .map_err(ca_err("making the egress CA certificate"))?;
                write_new(&key_path, key.serialize_pem().as_bytes(), 0o600)
                    .map_err(io("writing", &key_path))?;
                write_new(&cert_path, cert.pem().as_bytes(), 0o644)
                    .map_err(io("writing", &cert_path))?;
                (key, cert.pem())
            }
            Err(e) => return Err(io("reading", &key_path)(e)),
        };
        use rustls::pki_types::pem::PemObject;
        let cert_der = CertificateDer::from_pem_slice(cert_pem.as_bytes())
            .map_err(|e| NetError::Config(format!("egress CA certificate: {e}")))?;
        Ok(Self {
            issuer: Issuer::new(ca_params(), key),
            cert_pem,
            cert_der,
            leaves: Mutex::new(HashMap::new()),
        })
    }

    /// The CA certificate (PEM), for sandboxes' trust stores.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// A TLS server configuration presenting a leaf for `name` (a DNS name or an IP address),
    /// offering `alpn`; minted on first use and cached.
    pub fn server_config(&self, name: &str, alpn: &[&[u8]]) -> Result<Arc<rustls::ServerConfig>> {
        let now = Utc::now();
        let mut leaves = self.leaves.lock().unwrap_or_else(|p| p.into_inner());
        let cache_key = format!("{name}|{}", alpn.join(&b","[..]).escape_ascii());
        if let Some(l) = leaves.get(&cache_key).filter(|l| l.renew_at > now) {
            return Ok(l.config.clone());
        }
        let key = KeyPair::generate().map_err(ca_err("making a leaf key"))?;
        let mut p = CertificateParams::new(vec![name.to_string()])
            .map_err(ca_err("leaf certificate name"))?;
        p.distinguished_name = DistinguishedName::new();
        p.distinguished_name.push(DnType::CommonName, name);
        validity(
            &mut p,
            now - Duration::days(1),
            now + Duration::days(LEAF_DAYS),
        );
        p.serial_number = Some(random_serial());
        p.use_authority_key_identifier_extension = true;
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let cert = p
            .signed_by(&key, &self.issuer)
            .map_err(ca_err("signing a leaf"))?;
        let chain = vec![cert.der().clone(), self.cert_der.clone()];
        let der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| NetError::Config(format!("TLS versions: {e}")))?
            .with_no_client_auth()
            .with_single_cert(chain, der)
            .map_err(|e| NetError::Config(format!("leaf certificate: {e}")))?;
        cfg.alpn_protocols = alpn.iter().map(|a| a.to_vec()).collect();
        let cfg = Arc::new(cfg);
        if leaves.len() > 4096 {
            leaves.clear();
        }
        leaves.insert(
            cache_key,
            Leaf {
                config: cfg.clone(),
                renew_at: now + Duration::days(LEAF_DAYS - RENEW_DAYS),
            },
        );
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ca_is_made_once_its_key_is_private_and_leaves_are_cached() {
        let dir = tempfile::tempdir().unwrap();
        let ca = Ca::open(dir.path()).unwrap();
        let mode = std::fs::metadata(dir.path().join(CA_KEY_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        assert!(ca.cert_pem().starts_with("-----BEGIN CERTIFICATE-----"));
        let a = ca
            .server_config("api.example.test", &[b"http/1.1"])
            .unwrap();
        let b = ca
            .server_config("api.example.test", &[b"http/1.1"])
            .unwrap();
        assert!(Arc::ptr_eq(&a, &b), "cached");
        ca.server_config("198.51.100.7", &[]).unwrap();
        let again = Ca::open(dir.path()).unwrap();
        assert_eq!(again.cert_pem(), ca.cert_pem(), "loaded, not made again");
    }

    #[test]
    fn an_installed_ca_is_the_one_loaded_and_a_mismatched_pair_is_refused() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let first = Ca::open(a.path()).unwrap();
        let other = Ca::open(b.path()).unwrap();
        let (cert, key) = read_pems(a.path()).unwrap();
        assert_eq!(cert, first.cert_pem());
        let (_, other_key) = read_pems(b.path()).unwrap();
        let err = install(b.path(), &cert, &other_key).unwrap_err();
        assert!(err.to_string().contains("not the key's"), "{err}");
        assert_eq!(
            read_pems(b.path()).unwrap().0,
            other.cert_pem(),
            "left as it was"
        );
        install(b.path(), &cert, &key).unwrap();
        let mode = std::fs::metadata(b.path().join(CA_KEY_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let loaded = Ca::open(b.path()).unwrap();
        assert_eq!(loaded.cert_pem(), first.cert_pem());
        loaded.server_config("api.example.test", &[]).unwrap();
    }
}
