//! [`ChunkStore`]: files in an S3-compatible bucket as content-addressed chunks plus a
//! manifest. `put_file` uploads only the chunks the bucket lacks; `get_file` (in `fetch.rs`)
//! downloads only the chunks a local cache lacks.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::stream::FuturesUnordered;
use futures::StreamExt;
use object_store::aws::AmazonS3Builder;
use object_store::path::Path as Key;
use object_store::{ClientOptions, ObjectStore, ObjectStoreExt, PutPayload, RetryConfig};

use super::error::{ObjectError, Result};
use super::manifest::{chunk_key, manifest_key, sha256_hex, Manifest};

/// The default chunk size: 4 MiB.
pub const DEFAULT_CHUNK_SIZE: usize = 4 << 20;

/// Chunk requests in flight at once, per `put_file` or `get_file`.
pub(super) const IN_FLIGHT: usize = 4;

/// Where the bucket is and how to sign requests to it. Credentials are required: the client
/// never falls back to the environment or an instance metadata service.
#[derive(Debug, Clone)]
pub struct S3Config {
    /// `http://host:port` or `https://host:port` of the S3 API.
    pub endpoint: String,
    pub bucket: String,
    pub region: String,
    pub access_key_id: String,
    pub secret_access_key: String,
    /// Path-style addressing (`endpoint/bucket/key`) rather than `bucket.endpoint/key`.
    pub path_style: bool,
}

/// What `put_file` did: the manifest's id (the handle `get_file` takes) and how much it sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PutReport {
    pub id: String,
    pub manifest: Manifest,
    /// Chunks sent to the bucket, and their bytes.
    pub chunks_uploaded: usize,
    pub bytes_uploaded: u64,
    /// Chunks the bucket already held (or that appeared earlier in the same file).
    pub chunks_present: usize,
}

/// Content-addressed file storage in one bucket: `chunks/<sha256>` and `manifests/<sha256>`.
#[derive(Clone)]
pub struct ChunkStore {
    pub(super) bucket: Arc<dyn ObjectStore>,
    chunk_size: usize,
}

impl std::fmt::Debug for ChunkStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChunkStore")
            .field("bucket", &self.bucket.to_string())
            .field("chunk_size", &self.chunk_size)
            .finish()
    }
}

impl ChunkStore {
    /// A client for the bucket in `config` (no request is made yet), cutting files into
    /// [`DEFAULT_CHUNK_SIZE`] chunks.
    pub fn connect(config: &S3Config) -> Result<ChunkStore> {
        for (what, value) in [
            ("endpoint", &config.endpoint),
            ("bucket", &config.bucket),
            ("region", &config.region),
            ("access key id", &config.access_key_id),
            ("secret access key", &config.secret_access_key),
        ] {
            if value.is_empty() {
                return Err(ObjectError::Config(format!("the {what} is empty")));
            }
        }
        let http = config.endpoint.starts_with("http://");
        if !http && !config.endpoint.starts_with("https://") {
            return Err(ObjectError::Config(
                "the endpoint is not an http:// or https:// URL".into(),
            ));
        }
        // The HTTP client's TLS (rustls without a built-in provider) takes the process default.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let retry = RetryConfig {
            max_retries: 4,
            retry_timeout: Duration::from_secs(60),
            ..RetryConfig::default()
        };
        let bucket = AmazonS3Builder::new()
            .with_endpoint(&config.endpoint)
            .with_bucket_name(&config.bucket)
            .with_region(&config.region)
            .with_access_key_id(&config.access_key_id)
            .with_secret_access_key(&config.secret_access_key)
            .with_virtual_hosted_style_request(!config.path_style)
            .with_allow_http(http)
            .with_client_options(
                ClientOptions::new()
                    .with_allow_http(http)
                    .with_connect_timeout(Duration::from_secs(10))
                    .with_timeout(Duration::from_secs(300)),
            )
            .with_retry(retry)
            .build()
            .map_err(|e| ObjectError::Config(e.to_string()))?;
        Ok(ChunkStore {
            bucket: Arc::new(bucket),
            chunk_size: DEFAULT_CHUNK_SIZE,
        })
    }

    /// The same store cutting new files into chunks of `bytes` (at least 1).
    pub fn with_chunk_size(mut self, bytes: usize) -> ChunkStore {
        self.chunk_size = bytes.max(1);
        self
    }

    pub fn chunk_size(&self) -> usize {
        self.chunk_size
    }

    /// The bucket client itself (for housekeeping the chunk API does not cover).
    pub fn bucket(&self) -> &Arc<dyn ObjectStore> {
        &self.bucket
    }

    /// Whether the bucket answers: one listing of its manifests (an error for a bucket that
    /// does not exist or refuses the credentials).
    pub async fn check(&self) -> Result<()> {
        let prefix = Key::from("manifests");
        let mut listing = self.bucket.list(Some(&prefix));
        match listing.next().await {
            None | Some(Ok(_)) => Ok(()),
            Some(Err(e)) => Err(ObjectError::request("manifests/", e)),
        }
    }

    /// Stores the file at `path`: each chunk the bucket lacks (a HEAD first; a held object of
    /// the wrong size counts as lacking), then the manifest, last, so a stored manifest never
    /// names a missing chunk.
    pub async fn put_file(&self, path: &Path) -> Result<PutReport> {
        let file = std::fs::File::open(path)
            .map_err(|e| ObjectError::io("opening the file to store", path, e))?;
        let size = file
            .metadata()
            .map_err(|e| ObjectError::io("reading the file to store", path, e))?
            .len();
        let file = Arc::new(file);
        let chunk_size = self.chunk_size;
        let mut report = PutReport {
            id: String::new(),
            manifest: Manifest {
                size,
                chunk_size: chunk_size as u64,
                chunks: Vec::new(),
            },
            chunks_uploaded: 0,
            bytes_uploaded: 0,
            chunks_present: 0,
        };
        let mut seen = std::collections::HashSet::new();
        let mut zero: Option<(String, Bytes)> = None;
        let mut pending = FuturesUnordered::new();
        let mut off = 0u64;
        while off < size {
            let len = chunk_size.min((size - off) as usize);
            let f = file.clone();
            let full = len == chunk_size;
            let read = tokio::task::spawn_blocking(move || read_chunk(&f, off, len, full))
                .await
                .map_err(|e| std::io::Error::other(e.to_string()))
                .and_then(|r| r)
                .map_err(|e| ObjectError::io("reading the file to store", path, e))?;
            // A full all-zero chunk (a sparse file's hole, not even read) is hashed once.
            let (hash, chunk) = match read {
                Some((hash, bytes)) => (hash, bytes),
                None => zero
                    .get_or_insert_with(|| {
                        let bytes = Bytes::from(vec![0u8; chunk_size]);
                        (sha256_hex(&bytes), bytes)
                    })
                    .clone(),
            };
            report.manifest.chunks.push(hash.clone());
            if seen.insert(hash.clone()) {
                if pending.len() >= IN_FLIGHT {
                    if let Some(done) = pending.next().await {
                        tally(&mut report, done?);
                    }
                }
                pending.push(self.upload_missing(hash, chunk));
            } else {
                report.chunks_present += 1;
            }
            off += len as u64;
        }
        while let Some(done) = pending.next().await {
            tally(&mut report, done?);
        }
        report.id = report.manifest.id();
        let key = manifest_key(&report.id);
        self.bucket
            .put(
                &Key::from(key.as_str()),
                PutPayload::from(report.manifest.to_json()),
            )
            .await
            .map_err(|e| ObjectError::request(key, e))?;
        Ok(report)
    }

    /// Uploads chunk `hash` unless the bucket holds it with its length (a HEAD first); the
    /// bytes sent, None when it was there.
    async fn upload_missing(&self, hash: String, chunk: Bytes) -> Result<Option<u64>> {
        let key = chunk_key(&hash);
        let len = chunk.len() as u64;
        match self.bucket.head(&Key::from(key.as_str())).await {
            Ok(meta) if meta.size == len => return Ok(None),
            Ok(_) | Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => return Err(ObjectError::request(key, e)),
        }
        self.bucket
            .put(&Key::from(key.as_str()), PutPayload::from(chunk))
            .await
            .map_err(|e| ObjectError::request(key, e))?;
        Ok(Some(len))
    }
}

/// Counts one chunk's upload (its bytes) or its being found in the bucket (None).
fn tally(report: &mut PutReport, uploaded: Option<u64>) {
    match uploaded {
        Some(bytes) => {
            report.chunks_uploaded += 1;
            report.bytes_uploaded += bytes;
        }
        None => report.chunks_present += 1,
    }
}

/// The `len` bytes at `off` of `file` with their hash, or None for a full chunk of zeros:
/// one with no data in the file (a hole, found with `SEEK_DATA` and not read) or read as
/// zeros.
/// Only a `full` chunk (the store's chunk size) is ever None.
fn read_chunk(
    file: &std::fs::File,
    off: u64,
    len: usize,
    full: bool,
) -> std::io::Result<Option<(String, Bytes)>> {
    use std::os::unix::fs::FileExt;
    use std::os::unix::io::AsRawFd;
    if full {
        // SAFETY: lseek on a descriptor the caller keeps open; it moves only this descriptor's
        // offset, which reads here never use (they are positional).
        let data = unsafe { libc::lseek(file.as_raw_fd(), off as libc::off_t, libc::SEEK_DATA) };
        let hole = if data < 0 {
            // ENXIO: no data from `off` to the end; other errors: no hole support, read it.
            std::io::Error::last_os_error().raw_os_error() == Some(libc::ENXIO)
        } else {
            data as u64 >= off + len as u64
        };
        if hole {
            return Ok(None);
        }
    }
    let mut buf = vec![0u8; len];
    file.read_exact_at(&mut buf, off)?;
    if full && buf.iter().all(|&b| b == 0) {
        return Ok(None);
    }
    Ok(Some((sha256_hex(&buf), Bytes::from(buf))))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> S3Config {
        S3Config {
            endpoint: "http://127.0.0.1:9".into(),
            bucket: "kiln".into(),
            region: "us-east-1".into(),
            access_key_id: "id".into(),
            secret_access_key: "secret".into(),
            path_style: true,
        }
    }

    #[test]
    fn settings_without_credentials_or_an_http_endpoint_are_refused() {
        assert!(ChunkStore::connect(&config()).is_ok());
        let mut c = config();
        c.secret_access_key.clear();
        let err = ChunkStore::connect(&c).unwrap_err();
        assert!(
            err.to_string().contains("secret access key is empty"),
            "{err}"
        );
        let mut c = config();
        c.endpoint = "127.0.0.1:9".into();
        assert!(matches!(
            ChunkStore::connect(&c),
            Err(ObjectError::Config(_))
        ));
        let store = ChunkStore::connect(&config()).unwrap().with_chunk_size(0);
        assert_eq!(store.chunk_size(), 1);
    }
}
