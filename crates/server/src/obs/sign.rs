//! Webhook signatures. Every delivery carries
//!
//! ```text
//! Kiln-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>
//! ```
//!
//! A receiver recomputes the HMAC over the timestamp, a dot and the raw body with the
//! webhook's secret, compares in constant time, and rejects timestamps too far from its clock
//! (replays). Retries are signed again with a fresh timestamp.

use hmac::{Hmac, Mac};
use sha2::Sha256;

pub const SIGNATURE_HEADER: &str = "kiln-signature";

fn mac(secret: &str, ts: i64, body: &[u8]) -> Hmac<Sha256> {
    // HMAC takes keys of any length, so this cannot fail.
    let mut m = Hmac::<Sha256>::new_from_slice(secret.as_bytes())
        .unwrap_or_else(|_| unreachable!("HMAC accepts any key length"));
    m.update(ts.to_string().as_bytes());
    m.update(b".");
    m.update(body);
    m
}

/// The `Kiln-Signature` header value of `body` sent at `ts` (unix seconds).
pub fn sign(secret: &str, ts: i64, body: &[u8]) -> String {
    let tag = mac(secret, ts, body).finalize().into_bytes();
    format!("t={ts},v1={}", hex::encode(tag))
}

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum VerifyError {
    #[error("malformed signature header")]
    Malformed,
    #[error("timestamp outside the tolerance")]
    Stale,
    #[error("signature mismatch")]
    Mismatch,
}

/// Checks a `Kiln-Signature` header against `body`, accepting timestamps within
/// `tolerance_secs` of `now` (unix seconds).
pub fn verify(
    secret: &str,
    header: &str,
    body: &[u8],
    now: i64,
    tolerance_secs: i64,
) -> Result<(), VerifyError> {
    let mut ts = None;
    let mut sigs = Vec::new();
    for part in header.split(',') {
        match part.trim().split_once('=') {
            Some(("t", v)) => ts = v.parse::<i64>().ok(),
            Some(("v1", v)) => sigs.push(hex::decode(v).map_err(|_| VerifyError::Malformed)?),
            _ => {}
        }
    }
    let ts = ts.ok_or(VerifyError::Malformed)?;
    if sigs.is_empty() {
        return Err(VerifyError::Malformed);
    }
    if (now - ts).abs() > tolerance_secs {
        return Err(VerifyError::Stale);
    }
    if sigs
        .iter()
        .any(|s| mac(secret, ts, body).verify_slice(s).is_ok())
    {
        Ok(())
    } else {
        Err(VerifyError::Mismatch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_vector() {
        // Computed independently: printf '1700000000.{"a":1}' | openssl dgst -sha256 -hmac s3cret
        assert_eq!(
            sign("s3cret", 1_700_000_000, br#"{"a":1}"#),
            format!("t=1700000000,v1={}", KNOWN)
        );
    }
    const KNOWN: &str = "1698a50bc74d1ff1db85c4e0a5297c2ad9fdba245d5737cdb789e4cc6e098940";

    #[test]
    fn round_trip_and_rejections() {
        let body = br#"{"type":"sandbox.created"}"#;
        let h = sign("k", 1000, body);
        assert_eq!(verify("k", &h, body, 1010, 300), Ok(()));
        assert_eq!(
            verify("other", &h, body, 1010, 300),
            Err(VerifyError::Mismatch)
        );
        assert_eq!(
            verify("k", &h, b"{}", 1010, 300),
            Err(VerifyError::Mismatch)
        );
        assert_eq!(verify("k", &h, body, 2000, 300), Err(VerifyError::Stale));
        assert_eq!(
            verify("k", "v1=00", body, 1000, 300),
            Err(VerifyError::Malformed)
        );
        assert_eq!(
            verify("k", "t=1000", body, 1000, 300),
            Err(VerifyError::Malformed)
        );
        // A tampered timestamp breaks the signature.
        let forged = h.replace("t=1000", "t=1001");
        assert_eq!(
            verify("k", &forged, body, 1001, 300),
            Err(VerifyError::Mismatch)
        );
    }
}
