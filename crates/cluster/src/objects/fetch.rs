//! `ChunkStore::get_file`: a stored file back onto local disk, fetching only the chunks the
//! local chunk cache lacks, checking every chunk's hash, and writing the destination
//! atomically (a temporary file beside it, renamed over it when complete).

use std::path::{Path, PathBuf};

use bytes::Bytes;
use futures::StreamExt;
use object_store::path::Path as Key;
use object_store::ObjectStoreExt;
use tokio::io::AsyncWriteExt;

use super::error::{ObjectError, Result};
use super::manifest::{chunk_key, is_sha256_hex, manifest_key, sha256_hex, Manifest};
use super::store::{ChunkStore, IN_FLIGHT};

/// What `get_file` did: chunks (and bytes) downloaded vs taken from the local cache.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GetReport {
    pub size: u64,
    pub chunks_fetched: usize,
    pub bytes_fetched: u64,
    pub chunks_reused: usize,
    pub bytes_reused: u64,
}

/// A temporary file removed when dropped, unless it was renamed into place.
struct Partial(Option<PathBuf>);

impl Drop for Partial {
    fn drop(&mut self) {
        if let Some(path) = self.0.take() {
            let _ = std::fs::remove_file(path);
        }
    }
}

impl ChunkStore {
    /// Writes the file of manifest `id` to `dest`. Chunks found in `cache_dir` (files named by
    /// their hash, checked before use) are reused; the others are downloaded, checked, and added
    /// to the cache. On any error `dest` is left as it was and no partial file remains.
    pub async fn get_file(&self, id: &str, dest: &Path, cache_dir: &Path) -> Result<GetReport> {
        let manifest = self.manifest(id).await?;
        tokio::fs::create_dir_all(cache_dir)
            .await
            .map_err(|e| ObjectError::io("creating the chunk cache", cache_dir, e))?;
        let name = dest.file_name().ok_or_else(|| {
            ObjectError::io(
                "naming the destination",
                dest,
                std::io::Error::new(std::io::ErrorKind::InvalidInput, "no file name"),
            )
        })?;
        let dir = match dest.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let tmp = dir.join(format!(
            ".{}.part-{}",
            name.to_string_lossy(),
            uuid::Uuid::new_v4().simple()
        ));
        let mut partial = Partial(Some(tmp.clone()));
        let mut out = tokio::fs::File::create(&tmp)
            .await
            .map_err(|e| ObjectError::io("creating the destination", &tmp, e))?;
        let mut report = GetReport {
            size: manifest.size,
            ..GetReport::default()
        };
        // Chunks are fetched (or read from the cache) IN_FLIGHT at a time, written in order.
        let chunks = manifest.chunks.iter().enumerate().map(|(index, hash)| {
            let len = manifest.chunk_len(index);
            async move {
                let got = self.chunk(id, cache_dir, index, hash, len).await?;
                Ok::<_, ObjectError>((got, len))
            }
        });
        let mut chunks = futures::stream::iter(chunks).buffered(IN_FLIGHT);
        while let Some(got) = chunks.next().await {
            let ((bytes, fetched), len) = got?;
            if fetched {
                report.chunks_fetched += 1;
                report.bytes_fetched += len;
            } else {
                report.chunks_reused += 1;
                report.bytes_reused += len;
            }
            out.write_all(&bytes)
                .await
                .map_err(|e| ObjectError::io("writing the destination", &tmp, e))?;
        }
        out.sync_all()
            .await
            .map_err(|e| ObjectError::io("syncing the destination", &tmp, e))?;
        drop(out);
        tokio::fs::rename(&tmp, dest)
            .await
            .map_err(|e| ObjectError::io("renaming into the destination", dest, e))?;
        partial.0 = None;
        Ok(report)
    }

    /// The manifest stored under `id`, checked against its id.
    pub async fn manifest(&self, id: &str) -> Result<Manifest> {
        if !is_sha256_hex(id) {
            return Err(ObjectError::BadManifestId(id.to_string()));
        }
        let key = manifest_key(id);
        let bytes = match self.read(&key).await? {
            Some(b) => b,
            None => return Err(ObjectError::ManifestNotFound(id.to_string())),
        };
        Manifest::parse(id, &bytes)
    }

    /// Chunk `index` of manifest `id`: from the cache when intact (false), else from the
    /// bucket, checked and then cached (true).
    async fn chunk(
        &self,
        id: &str,
        cache_dir: &Path,
        index: usize,
        hash: &str,
        len: u64,
    ) -> Result<(Bytes, bool)> {
        if let Some(bytes) = cached(cache_dir, hash, len).await? {
            return Ok((bytes, false));
        }
        let bytes = self.fetch_chunk(id, index, hash, len).await?;
        store_cached(cache_dir, hash, &bytes).await?;
        Ok((bytes, true))
    }

    /// Chunk `index` of manifest `id` from the bucket, checked against its name and length.
    async fn fetch_chunk(&self, id: &str, index: usize, hash: &str, len: u64) -> Result<Bytes> {
        let bytes = self
            .read(&chunk_key(hash))
            .await?
            .ok_or_else(|| ObjectError::ChunkMissing(hash.to_string()))?;
        let actual = sha256_hex(&bytes);
        if actual != hash {
            return Err(ObjectError::CorruptChunk {
                hash: hash.to_string(),
                actual,
                len: bytes.len(),
            });
        }
        if bytes.len() as u64 != len {
            return Err(ObjectError::CorruptManifest {
                id: id.to_string(),
                reason: format!("chunk {index} has {} bytes, not {len}", bytes.len()),
            });
        }
        Ok(bytes)
    }

    /// The object at `key`, or None when the bucket has none.
    async fn read(&self, key: &str) -> Result<Option<Bytes>> {
        let got = match self.bucket.get(&Key::from(key)).await {
            Ok(got) => got,
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(ObjectError::request(key, e)),
        };
        got.bytes()
            .await
            .map(Some)
            .map_err(|e| ObjectError::request(key, e))
    }
}

/// The cached chunk `hash` when the cache holds it intact; a damaged entry is removed.
async fn cached(cache_dir: &Path, hash: &str, len: u64) -> Result<Option<Bytes>> {
    let path = cache_dir.join(hash);
    let bytes = match tokio::fs::read(&path).await {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(ObjectError::io("reading the chunk cache", path, e)),
    };
    if bytes.len() as u64 == len && sha256_hex(&bytes) == hash {
        return Ok(Some(Bytes::from(bytes)));
    }
    tracing::warn!(
        chunk = hash,
        "damaged chunk in the local cache, fetching it again"
    );
    match tokio::fs::remove_file(&path).await {
        Ok(()) => Ok(None),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(ObjectError::io("removing a damaged cached chunk", path, e)),
    }
}

/// Adds a checked chunk to the cache: a temporary file renamed into place, so readers never
/// see half a chunk, written by one blocking task that finishes even when the caller is
/// cancelled (so no temporary file outlives it).
async fn store_cached(cache_dir: &Path, hash: &str, bytes: &Bytes) -> Result<()> {
    let path = cache_dir.join(hash);
    let tmp = cache_dir.join(format!(".{hash}.part-{}", uuid::Uuid::new_v4().simple()));
    let bytes = bytes.clone();
    let task = tokio::task::spawn_blocking(move || {
        let mut partial = Partial(Some(tmp.clone()));
        std::fs::write(&tmp, &bytes)
            .map_err(|e| ObjectError::io("writing the chunk cache", &tmp, e))?;
        std::fs::rename(&tmp, &path)
            .map_err(|e| ObjectError::io("writing the chunk cache", &path, e))?;
        partial.0 = None;
        Ok(())
    });
    task.await.map_err(|e| {
        ObjectError::io(
            "writing the chunk cache",
            cache_dir,
            std::io::Error::other(e.to_string()),
        )
    })?
}
