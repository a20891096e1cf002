//! The cluster secret: the shared token control replicas present to nodes' internal APIs
//! (never an API key of the public API), compared in constant time. The key every node and
//! replica seals teams' secrets with is derived from it ([`ClusterSecret::vault_key`]).

use std::fmt;

/// A shared token of at least [`ClusterSecret::MIN_LEN`] bytes.
#[derive(Clone)]
pub struct ClusterSecret(String);

impl fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClusterSecret(…)")
    }
}

impl ClusterSecret {
    /// The shortest secret taken.
    pub const MIN_LEN: usize = 16;

    /// `text` (trimmed) as the secret; None when it is shorter than [`Self::MIN_LEN`].
    pub fn new(text: &str) -> Option<Self> {
        let t = text.trim();
        (t.len() >= Self::MIN_LEN).then(|| Self(t.to_string()))
    }

    /// The `Authorization` value that carries it.
    pub fn bearer(&self) -> String {
        format!("Bearer {}", self.0)
    }

    /// The 32-byte key the cluster's vault seals secrets with: HKDF-SHA256 of the secret
    /// (RFC 5869), bound to its use by a salt and an info string, so the key reveals nothing
    /// of the secret and the secret alone is all a process needs. Changing the cluster secret
    /// changes the key: the stored secrets then no longer open and must be set again.
    pub fn vault_key(&self) -> [u8; 32] {
        use ring::hkdf;
        struct Len;
        impl hkdf::KeyType for Len {
            fn len(&self) -> usize {
                32
            }
        }
        let salt = hkdf::Salt::new(hkdf::HKDF_SHA256, b"kiln cluster vault");
        let mut out = [0u8; 32];
        salt.extract(self.0.as_bytes())
            .expand(&[b"secrets v1"], Len)
            .and_then(|okm| okm.fill(&mut out))
            .expect("32 bytes is a valid HKDF-SHA256 output length");
        out
    }

    /// Whether an `Authorization` value carries this secret (time independent of where the
    /// two differ).
    pub fn admits(&self, authorization: Option<&[u8]>) -> bool {
        let Some(given) = authorization.and_then(|v| v.strip_prefix(b"Bearer ")) else {
            return false;
        };
        let want = self.0.as_bytes();
        let mut diff = u8::from(given.len() != want.len());
        for (i, w) in want.iter().enumerate() {
            diff |= w ^ given.get(i).copied().unwrap_or(0);
        }
        diff == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_same_secret_is_admitted() {
        let s = ClusterSecret::new("0123456789abcdef-secret").unwrap();
        assert!(s.admits(Some(s.bearer().as_bytes())));
        assert!(!s.admits(None));
        assert!(!s.admits(Some(b"Bearer 0123456789abcdef-secreT")));
        assert!(!s.admits(Some(b"Bearer 0123456789abcdef-secret-and-more")));
        assert!(!s.admits(Some(b"Bearer 0123456789abcdef")));
        assert!(!s.admits(Some(b"0123456789abcdef-secret")));
        assert!(ClusterSecret::new("short").is_none());
    }

    #[test]
    fn the_vault_key_is_the_same_for_the_same_secret_only() {
        let a = ClusterSecret::new("0123456789abcdef-secret").unwrap();
        let again = ClusterSecret::new("  0123456789abcdef-secret\n").unwrap();
        let b = ClusterSecret::new("0123456789abcdef-secreT").unwrap();
        assert_eq!(a.vault_key(), again.vault_key());
        assert_ne!(a.vault_key(), b.vault_key());
        assert!(!a.vault_key().windows(8).any(|w| "0123456789abcdef-secret"
            .as_bytes()
            .windows(8)
            .any(|s| s == w)));
    }
}
