//! TLS on the server's listener (`kiln serve --tls-cert PEM --tls-key PEM`), with rustls.
//!
//! The e2b SDK given only `E2B_DOMAIN=<domain>` talks `https://api.<domain>` and
//! `https://<port>-<sandboxID>.<domain>` (port 443), so a certificate for `<domain>` and
//! `*.<domain>` lets it reach kiln with no other setting. ALPN offers `h2` and `http/1.1`.
//!
//! The listener tells the two apart per connection: one that opens with a TLS handshake
//! record is served over TLS, any other as plain HTTP (HTTP/1.1, or HTTP/2 with prior
//! knowledge), so `http://` clients keep working on the same port.

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// The first byte of a TLS record carrying a handshake (a ClientHello opens with it).
pub const TLS_HANDSHAKE: u8 = 0x16;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    // (The I/O error is in the message, not a source: callers print error chains.)
    #[error("reading {what} {path}: {error}")]
    Read {
        what: &'static str,
        path: String,
        error: std::io::Error,
    },
    #[error("{what} {path}: {message}")]
    Pem {
        what: &'static str,
        path: String,
        message: String,
    },
    #[error("the TLS certificate and key do not go together or are unusable: {0}")]
    Config(String),
}

/// A server-side TLS configuration (ALPN `h2`, `http/1.1`) from a PEM certificate chain
/// (leaf first) and a PEM private key (PKCS#8, PKCS#1 or SEC1).
pub fn load(cert: &Path, key: &Path) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let read = |what, path: &Path| {
        std::fs::read(path).map_err(|error| TlsError::Read {
            what,
            path: path.display().to_string(),
            error,
        })
    };
    let pem_err = |what, path: &Path, message: String| TlsError::Pem {
        what,
        path: path.display().to_string(),
        message,
    };
    let cert_pem = read("certificate", cert)?;
    let chain = CertificateDer::pem_slice_iter(&cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem_err("certificate", cert, e.to_string()))?;
    if chain.is_empty() {
        return Err(pem_err(
            "certificate",
            cert,
            "no CERTIFICATE block in it".into(),
        ));
    }
    let key_pem = read("private key", key)?;
    let key_der = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| {
        pem_err(
            "private key",
            key,
            format!("no usable private key in it ({e})"),
        )
    })?;
    from_parts(chain, key_der)
}

/// A server-side TLS configuration from DER parts (see [`load`]).
pub fn from_parts(
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let config_err = |e: rustls::Error| TlsError::Config(e.to_string());
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(config_err)?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(config_err)?;
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_and_empty_files_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let cert = dir.path().join("cert.pem");
        let key = dir.path().join("key.pem");
        let e = load(&cert, &key).unwrap_err().to_string();
        assert!(e.starts_with("reading certificate"), "{e}");
        std::fs::write(&cert, "not pem").unwrap();
        let e = load(&cert, &key).unwrap_err().to_string();
        assert!(e.contains("no CERTIFICATE block"), "{e}");
    }
}
