//! A node's local cache of fetched chunks, capped in bytes: [`ChunkCache::trim`] evicts the
//! least recently used chunks (by modification time, which a fetch that reuses a chunk sets
//! to now) until the cache fits. Fetches hold [`ChunkCache::fetching`] while they use the
//! cache and a trim runs only when none does, so no chunk is evicted under a fetch of this
//! process; a chunk removed by anyone else is only a miss (fetched again).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::{OwnedRwLockReadGuard, RwLock};

use super::error::{ObjectError, Result};
use super::manifest::is_sha256_hex;

/// The default cap of a node's chunk cache: 10 GiB.
pub const DEFAULT_CACHE_MAX_BYTES: u64 = 10 << 30;

/// A temporary file of the cache (a chunk being written) this old was left by a writer that
/// died, and is removed by a trim.
const STALE_PART: Duration = Duration::from_secs(600);

/// A directory of chunks named by their hash, at most `max_bytes` of them after a trim.
#[derive(Debug, Clone)]
pub struct ChunkCache {
    dir: PathBuf,
    max_bytes: u64,
    /// Read: a fetch uses the cache; write: a trim runs.
    users: Arc<RwLock<()>>,
}

/// One cached chunk, as a trim sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cached {
    pub name: String,
    pub size: u64,
    /// When it was last written or reused.
    pub used: SystemTime,
}

/// What a trim did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Trimmed {
    pub chunks_evicted: usize,
    pub bytes_evicted: u64,
    pub chunks_kept: usize,
    pub bytes_kept: u64,
}

/// The chunks to evict so that the rest fit in `max_bytes`: the least recently used first.
pub fn evictions(mut chunks: Vec<Cached>, max_bytes: u64) -> Vec<Cached> {
    let mut total: u64 = chunks.iter().map(|c| c.size).sum();
    chunks.sort_by(|a, b| a.used.cmp(&b.used).then_with(|| a.name.cmp(&b.name)));
    let mut out = Vec::new();
    for c in chunks {
        if total <= max_bytes {
            break;
        }
        total -= c.size;
        out.push(c);
    }
    out
}

impl ChunkCache {
    pub fn new(dir: impl Into<PathBuf>, max_bytes: u64) -> ChunkCache {
        ChunkCache {
            dir: dir.into(),
            max_bytes,
            users: Arc::new(RwLock::new(())),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    /// Held by a fetch for as long as it uses the cache: no trim runs meanwhile.
    pub async fn fetching(&self) -> OwnedRwLockReadGuard<()> {
        self.users.clone().read_owned().await
    }

    /// Evicts the least recently used chunks beyond the cap (and temporary files a dead
    /// writer left); None, doing nothing, while a fetch uses the cache.
    pub async fn trim(&self) -> Result<Option<Trimmed>> {
        let Ok(guard) = self.users.clone().try_write_owned() else {
            return Ok(None);
        };
        let (dir, max) = (self.dir.clone(), self.max_bytes);
        let trimmed = tokio::task::spawn_blocking(move || {
            let _guard = guard;
            trim_dir(&dir, max)
        })
        .await
        .map_err(|e| {
            ObjectError::io(
                "trimming the chunk cache",
                &self.dir,
                std::io::Error::other(e.to_string()),
            )
        })??;
        if trimmed.chunks_evicted > 0 {
            tracing::info!(
                chunks = trimmed.chunks_evicted,
                bytes = trimmed.bytes_evicted,
                kept_bytes = trimmed.bytes_kept,
                max_bytes = self.max_bytes,
                "chunk cache trimmed"
            );
        }
        Ok(Some(trimmed))
    }
}

/// [`ChunkCache::trim`]'s work on the directory itself (a missing one is empty).
fn trim_dir(dir: &Path, max_bytes: u64) -> Result<Trimmed> {
    let io = |e| ObjectError::io("trimming the chunk cache", dir, e);
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Trimmed::default()),
        Err(e) => return Err(io(e)),
    };
    let now = SystemTime::now();
    let mut chunks = Vec::new();
    for entry in entries {
        let entry = entry.map_err(io)?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let meta = match entry.metadata() {
            Ok(m) if m.is_file() => m,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(io(e)),
        };
        let used = meta.modified().map_err(io)?;
        if is_sha256_hex(&name) {
            chunks.push(Cached {
                name,
                size: meta.len(),
                used,
            });
        } else if name.starts_with('.')
            && name.contains(".part-")
            && now.duration_since(used).unwrap_or_default() >= STALE_PART
        {
            remove(&entry.path()).map_err(io)?;
        }
    }
    let mut t = Trimmed {
        chunks_kept: chunks.len(),
        bytes_kept: chunks.iter().map(|c| c.size).sum(),
        ..Trimmed::default()
    };
    for c in evictions(chunks, max_bytes) {
        remove(&dir.join(&c.name)).map_err(io)?;
        t.chunks_evicted += 1;
        t.bytes_evicted += c.size;
        t.chunks_kept -= 1;
        t.bytes_kept -= c.size;
    }
    Ok(t)
}

/// Removes `path`; one already gone is fine.
fn remove(path: &Path) -> std::io::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(name: &str, size: u64, used_s: u64) -> Cached {
        Cached {
            name: name.into(),
            size,
            used: SystemTime::UNIX_EPOCH + Duration::from_secs(used_s),
        }
    }

    fn names(v: &[Cached]) -> Vec<&str> {
        v.iter().map(|c| c.name.as_str()).collect()
    }

    #[test]
    fn the_least_recently_used_go_until_the_rest_fit() {
        let all = vec![
            chunk("new", 40, 30),
            chunk("old", 40, 10),
            chunk("mid", 40, 20),
        ];
        assert!(evictions(all.clone(), 120).is_empty());
        assert_eq!(names(&evictions(all.clone(), 119)), ["old"]);
        assert_eq!(names(&evictions(all.clone(), 80)), ["old"]);
        assert_eq!(names(&evictions(all.clone(), 79)), ["old", "mid"]);
        assert_eq!(names(&evictions(all, 0)), ["old", "mid", "new"]);
        assert!(evictions(Vec::new(), 0).is_empty());
    }

    #[test]
    fn a_trim_evicts_old_chunks_and_dead_temporaries_only() {
        let dir = tempfile::tempdir().unwrap();
        let hash = |i: u8| crate::objects::manifest::sha256_hex(&[i]);
        let t0 = SystemTime::now() - Duration::from_secs(3600);
        for i in 0..4u8 {
            let path = dir.path().join(hash(i));
            std::fs::write(&path, [i; 100]).unwrap();
            let f = std::fs::File::options().write(true).open(&path).unwrap();
            f.set_modified(t0 + Duration::from_secs(i as u64)).unwrap();
        }
        let stale = dir.path().join(format!(".{}.part-1", hash(9)));
        std::fs::write(&stale, b"half").unwrap();
        let f = std::fs::File::options().write(true).open(&stale).unwrap();
        f.set_modified(t0).unwrap();
        let fresh = dir.path().join(format!(".{}.part-2", hash(8)));
        std::fs::write(&fresh, b"half").unwrap();
        std::fs::write(dir.path().join("notes"), b"not a chunk").unwrap();

        let t = trim_dir(dir.path(), 250).unwrap();
        assert_eq!(
            t,
            Trimmed {
                chunks_evicted: 2,
                bytes_evicted: 200,
                chunks_kept: 2,
                bytes_kept: 200
            }
        );
        assert!(!dir.path().join(hash(0)).exists() && !dir.path().join(hash(1)).exists());
        assert!(dir.path().join(hash(2)).exists() && dir.path().join(hash(3)).exists());
        assert!(!stale.exists() && fresh.exists() && dir.path().join("notes").exists());
        assert_eq!(
            trim_dir(&dir.path().join("none"), 0).unwrap(),
            Trimmed::default()
        );
    }

    #[tokio::test]
    async fn no_trim_runs_while_a_fetch_uses_the_cache() {
        let dir = tempfile::tempdir().unwrap();
        let name = crate::objects::manifest::sha256_hex(b"c");
        std::fs::write(dir.path().join(&name), b"chunk").unwrap();
        let cache = ChunkCache::new(dir.path(), 0);
        let using = cache.fetching().await;
        assert_eq!(cache.trim().await.unwrap(), None);
        assert!(dir.path().join(&name).exists());
        drop(using);
        let t = cache.trim().await.unwrap().unwrap();
        assert_eq!((t.chunks_evicted, t.bytes_kept), (1, 0));
        assert!(!dir.path().join(&name).exists());
    }
}
