//! `ChunkStore::get_file`: a stored file back onto local disk, fetching only the chunks the
//! local chunk cache lacks, checking every chunk's hash, and writing the destination
//! atomically (a temporary file beside it, renamed over it when complete). A chunk reused
//! from the cache has its modification time set to now (the cache's trim, in `cache.rs`,
//! evicts the least recently used).

use std::collections::HashMap;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use futures::StreamExt;
use object_store::path::Path as Key;
use object_store::ObjectStoreExt;

use super::error::{ObjectError, Result};
use super::manifest::{chunk_key, is_sha256_hex, manifest_key, sha256_hex, Manifest};
use super::store::{ChunkStore, IN_FLIGHT};

/// What `get_file` did, by chunk position: downloaded by this call (each distinct chunk at most
/// once) vs taken from the local cache or from an earlier position. `bytes_fetched +
/// bytes_reused` is the file's size.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GetReport {
    pub size: u64,
    pub chunks_fetched: usize,
    pub bytes_fetched: u64,
    pub chunks_reused: usize,
    pub bytes_reused: u64,
}

/// Each distinct chunk of `manifest` with its length and the indexes it occupies, in the order
/// of first occurrence.
fn places<'m>(id: &str, manifest: &'m Manifest) -> Result<Vec<(&'m str, u64, Vec<usize>)>> {
    let mut places: Vec<(&str, u64, Vec<usize>)> = Vec::new();
    let mut first: HashMap<&str, usize> = HashMap::new();
    for (index, hash) in manifest.chunks.iter().enumerate() {
        let len = manifest.chunk_len(index);
        match first.get(hash.as_str()) {
            Some(&at) if places[at].1 == len => places[at].2.push(index),
            Some(_) => {
                return Err(ObjectError::CorruptManifest {
                    id: id.to_string(),
                    reason: format!("chunk {hash} appears with two lengths"),
                });
            }
            None => {
                first.insert(hash, places.len());
                places.push((hash, len, vec![index]));
            }
        }
    }
    Ok(places)
}

/// `f` on tokio's blocking pool (it runs to its end even when the caller is cancelled).
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> std::io::Result<T> + Send + 'static,
) -> std::io::Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| std::io::Error::other(e.to_string()))?
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
        let out = tokio::fs::File::create(&tmp)
            .await
            .map_err(|e| ObjectError::io("creating the destination", &tmp, e))?;
        out.set_len(manifest.size)
            .await
            .map_err(|e| ObjectError::io("sizing the destination", &tmp, e))?;
        let out = Arc::new(out.into_std().await);
        let mut report = GetReport {
            size: manifest.size,
            ..GetReport::default()
        };
        // Each distinct chunk is got once (IN_FLIGHT at a time) and written at every offset it
        // occupies; an all-zero chunk is left as the hole `set_len` made.
        // (Owned hashes: the stream's future stays `Send` for any caller, an HTTP handler too.)
        let owned: Vec<(String, u64, Vec<usize>)> = places(id, &manifest)?
            .into_iter()
            .map(|(hash, len, at)| (hash.to_string(), len, at))
            .collect();
        let fetches = owned.into_iter().map(|(hash, len, at)| async move {
            let (bytes, fetched) = self.chunk(id, cache_dir, at[0], &hash, len).await?;
            Ok::<_, ObjectError>((bytes, fetched, at))
        });
        let mut fetches = futures::stream::iter(fetches).buffer_unordered(IN_FLIGHT);
        while let Some(got) = fetches.next().await {
            let (bytes, fetched, at) = got?;
            let len = bytes.len() as u64;
            let again = at.len() - usize::from(fetched);
            if fetched {
                report.chunks_fetched += 1;
                report.bytes_fetched += len;
            }
            report.chunks_reused += again;
            report.bytes_reused += len * again as u64;
            if bytes.iter().all(|&b| b == 0) {
                continue;
            }
            let file = out.clone();
            let offsets: Vec<u64> = at.iter().map(|&i| i as u64 * manifest.chunk_size).collect();
            blocking(move || {
                offsets
                    .into_iter()
                    .try_for_each(|off| file.write_all_at(&bytes, off))
            })
            .await
            .map_err(|e| ObjectError::io("writing the destination", &tmp, e))?;
        }
        let file = out.clone();
        blocking(move || file.sync_all())
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
        // Its modification time says when it was last used: the cache's trim evicts the
        // least recently used first. (A chunk evicted meanwhile is fine: the bytes are read.)
        let used = path.clone();
        let touched = blocking(move || {
            std::fs::File::options()
                .write(true)
                .open(&used)?
                .set_modified(std::time::SystemTime::now())
        });
        if let Err(e) = touched.await {
            tracing::debug!(chunk = hash, error = %e, "marking a cached chunk used");
        }
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
