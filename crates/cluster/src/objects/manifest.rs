//! The manifest of a stored file: its size, its chunk size and its chunks' SHA-256 names in
//! order. A manifest is itself content-addressed: its id is the SHA-256 of its JSON bytes.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::error::{ObjectError, Result};

/// Where chunks live in the bucket: `chunks/<sha256>`.
pub fn chunk_key(hash: &str) -> String {
    format!("chunks/{hash}")
}

/// Where manifests live in the bucket: `manifests/<sha256 of the manifest's JSON>`.
pub fn manifest_key(id: &str) -> String {
    format!("manifests/{id}")
}

/// The SHA-256 of `bytes` in lowercase hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// True for a SHA-256 in lowercase hex (so it is safe as a key segment and a file name).
pub fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// A file as stored: `size` bytes cut into `chunk_size` pieces (the last one shorter), each
/// named by its SHA-256.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub size: u64,
    pub chunk_size: u64,
    pub chunks: Vec<String>,
}

impl Manifest {
    /// The JSON stored in the bucket (field order fixed, so one manifest has one id).
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a manifest always serializes")
    }

    /// The manifest's id: the SHA-256 of [`Manifest::to_json`].
    pub fn id(&self) -> String {
        sha256_hex(&self.to_json())
    }

    /// The length chunk `index` must have.
    pub fn chunk_len(&self, index: usize) -> u64 {
        let start = index as u64 * self.chunk_size;
        self.chunk_size.min(self.size.saturating_sub(start))
    }

    /// Parses the bytes stored under `manifests/<id>`, checking that they hash to `id` and
    /// describe a file (a chunk count that matches the size, chunk names that are SHA-256s).
    pub fn parse(id: &str, bytes: &[u8]) -> Result<Manifest> {
        let corrupt = |reason: String| ObjectError::CorruptManifest {
            id: id.to_string(),
            reason,
        };
        let actual = sha256_hex(bytes);
        if actual != id {
            return Err(corrupt(format!("its bytes hash to {actual}")));
        }
        let m: Manifest = serde_json::from_slice(bytes).map_err(|e| corrupt(e.to_string()))?;
        if m.chunk_size == 0 {
            return Err(corrupt("chunk size 0".into()));
        }
        if m.chunks.len() as u64 != m.size.div_ceil(m.chunk_size) {
            return Err(corrupt(format!(
                "{} chunks for {} bytes in chunks of {}",
                m.chunks.len(),
                m.size,
                m.chunk_size
            )));
        }
        if let Some(bad) = m.chunks.iter().find(|c| !is_sha256_hex(c)) {
            return Err(corrupt(format!("chunk name {bad:?} is not a SHA-256")));
        }
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest(size: u64, chunk_size: u64) -> Manifest {
        let n = size.div_ceil(chunk_size) as usize;
        Manifest {
            size,
            chunk_size,
            chunks: (0..n).map(|i| sha256_hex(&[i as u8])).collect(),
        }
    }

    #[test]
    fn id_is_the_hash_of_the_json_and_parse_checks_it() {
        let m = manifest(10, 4);
        let json = m.to_json();
        assert_eq!(Manifest::parse(&m.id(), &json).unwrap(), m);
        let err = Manifest::parse(&sha256_hex(b"other"), &json).unwrap_err();
        assert!(matches!(err, ObjectError::CorruptManifest { .. }), "{err}");
    }

    #[test]
    fn parse_rejects_a_chunk_count_that_does_not_match_the_size() {
        let mut m = manifest(10, 4);
        m.chunks.pop();
        let err = Manifest::parse(&m.id(), &m.to_json()).unwrap_err();
        assert!(err.to_string().contains("2 chunks for 10 bytes"), "{err}");
    }

    #[test]
    fn chunk_lengths_end_with_the_remainder() {
        let m = manifest(10, 4);
        assert_eq!(
            (0..3).map(|i| m.chunk_len(i)).collect::<Vec<_>>(),
            [4, 4, 2]
        );
        assert_eq!(manifest(0, 4).chunks.len(), 0);
        assert_eq!(manifest(8, 4).chunk_len(1), 4);
    }

    #[test]
    fn ids_are_lowercase_sha256_hex_only() {
        assert!(is_sha256_hex(&sha256_hex(b"x")));
        assert!(!is_sha256_hex(&sha256_hex(b"x").to_uppercase()));
        assert!(!is_sha256_hex("../../etc/passwd"));
        assert!(!is_sha256_hex(""));
    }
}
