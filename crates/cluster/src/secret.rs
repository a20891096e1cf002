//! The cluster secret: the shared token control replicas present to nodes' internal APIs
//! (never an API key of the public API), compared in constant time.

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
}
