//! What can go wrong storing or fetching chunked files, as one typed error.

use std::path::PathBuf;

/// An error of the chunk store. Messages name bucket keys and chunk hashes, never host paths
/// (the path is a field, for the operator's log).
#[derive(Debug, thiserror::Error)]
pub enum ObjectError {
    /// The S3 settings do not make a client (bad endpoint URL, empty bucket or credentials).
    #[error("object storage settings: {0}")]
    Config(String),
    /// A local file or directory could not be read or written.
    #[error("{op}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A request to the bucket failed (after the client's retries).
    #[error("object storage request for {key}: {source}")]
    Request {
        key: String,
        #[source]
        source: object_store::Error,
    },
    /// A manifest id that is not a SHA-256 in lowercase hex.
    #[error("not a manifest id: {0:?}")]
    BadManifestId(String),
    /// No manifest with this id in the bucket.
    #[error("manifest {0} not found")]
    ManifestNotFound(String),
    /// A manifest whose bytes do not hash to its id, or that does not describe a file.
    #[error("manifest {id} is corrupt: {reason}")]
    CorruptManifest { id: String, reason: String },
    /// A chunk the manifest names that the bucket does not hold.
    #[error("chunk {0} not found in the bucket")]
    ChunkMissing(String),
    /// A chunk whose bytes in the bucket do not hash to its name.
    #[error("chunk {hash} in the bucket is corrupt: its {len} bytes hash to {actual}")]
    CorruptChunk {
        hash: String,
        actual: String,
        len: usize,
    },
}

impl ObjectError {
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ObjectError::Io {
            op,
            path: path.into(),
            source,
        }
    }

    pub(crate) fn request(key: impl Into<String>, source: object_store::Error) -> Self {
        ObjectError::Request {
            key: key.into(),
            source,
        }
    }
}

pub type Result<T, E = ObjectError> = std::result::Result<T, E>;
