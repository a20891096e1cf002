//! Garbage collection of the bucket: `ChunkStore::collect` deletes the manifests that no live
//! checkpoint names and the chunks that no kept manifest names, provided they are older than
//! a grace period. An upload writes its chunks, then its manifest, then its etcd record; the
//! grace keeps what an upload in flight just wrote, and every manifest younger than it counts
//! as live (its chunks stay, shared ones too). Only `chunks/<sha256>` and
//! `manifests/<sha256>` keys are ever deleted; anything else in the bucket is left alone.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::{StreamExt, TryStreamExt};
use object_store::path::Path as Key;
use object_store::ObjectMeta;

use super::error::{ObjectError, Result};
use super::manifest::{chunk_key, is_sha256_hex, manifest_key};
use super::store::{ChunkStore, IN_FLIGHT};

/// What one collection found and did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcReport {
    pub manifests_deleted: usize,
    pub chunks_deleted: usize,
    /// The bytes of the deleted objects (manifests and chunks).
    pub bytes_deleted: u64,
    pub manifests_kept: usize,
    pub chunks_kept: usize,
    /// Live manifests (named by a checkpoint record) the bucket does not hold.
    pub live_missing: usize,
}

/// One object of a listing: its hash (the key's last segment), size and age.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    pub hash: String,
    pub size: u64,
    /// Time since its last modification (zero for one dated in the future).
    pub age: Duration,
}

/// What a collection deletes, given the listings.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Doomed {
    pub manifests: Vec<Listed>,
    pub chunks: Vec<Listed>,
}

/// The manifests whose chunks must stay: the live ones and every one younger than `grace`
/// (an upload that wrote it has not recorded it yet).
pub fn kept_manifests<'a>(
    manifests: &'a [Listed],
    live: &HashSet<String>,
    grace: Duration,
) -> Vec<&'a str> {
    manifests
        .iter()
        .filter(|m| live.contains(&m.hash) || m.age < grace)
        .map(|m| m.hash.as_str())
        .collect()
}

/// The manifests no live record names and the chunks no kept manifest names (`kept_chunks`),
/// each only when older than `grace`.
pub fn select(
    manifests: &[Listed],
    chunks: &[Listed],
    live: &HashSet<String>,
    kept_chunks: &HashSet<String>,
    grace: Duration,
) -> Doomed {
    let old = |o: &&Listed| o.age >= grace;
    Doomed {
        manifests: manifests
            .iter()
            .filter(old)
            .filter(|m| !live.contains(&m.hash))
            .cloned()
            .collect(),
        chunks: chunks
            .iter()
            .filter(old)
            .filter(|c| !kept_chunks.contains(&c.hash))
            .cloned()
            .collect(),
    }
}

/// The object of a listing as a [`Listed`], None for a key that is not `<prefix>/<sha256>`.
fn listed(meta: &ObjectMeta, prefix: &str, now_ms: i64) -> Option<Listed> {
    let key = meta.location.as_ref();
    let hash = key.strip_prefix(prefix)?.strip_prefix('/')?;
    if !is_sha256_hex(hash) {
        return None;
    }
    let age_ms = now_ms.saturating_sub(meta.last_modified.timestamp_millis());
    Some(Listed {
        hash: hash.to_string(),
        size: meta.size,
        age: Duration::from_millis(age_ms.max(0) as u64),
    })
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

impl ChunkStore {
    /// Deletes what no checkpoint needs: manifests not in `live` and chunks named by no kept
    /// manifest (see [`kept_manifests`]), only those older than `grace`. Every kept manifest
    /// is read first; when one cannot be (a failed request, a corrupt manifest), nothing is
    /// deleted. A live manifest the bucket does not hold is counted in `live_missing` and
    /// otherwise ignored: its checkpoint cannot be fetched anyway. Manifests go before
    /// chunks, so a manifest left by an interrupted collection still names only stored
    /// chunks.
    pub async fn collect(&self, live: &HashSet<String>, grace: Duration) -> Result<GcReport> {
        // Chunks are listed before manifests: a manifest written in between (an upload
        // finishing) is then seen, and its chunks kept.
        let chunks = self.listing("chunks").await?;
        let manifests = self.listing("manifests").await?;
        let kept = kept_manifests(&manifests, live, grace);
        let held: HashSet<&str> = manifests.iter().map(|m| m.hash.as_str()).collect();
        let live_missing = live.iter().filter(|id| !held.contains(id.as_str())).count();
        // (Owned ids: the stream's future stays `Send` for any caller, a spawned task too.)
        let kept: Vec<String> = kept.into_iter().map(str::to_string).collect();
        let reads = kept
            .into_iter()
            .map(|id| async move { self.manifest(&id).await });
        let read: Vec<_> = futures::stream::iter(reads)
            .buffer_unordered(IN_FLIGHT)
            .try_collect()
            .await?;
        let kept_chunks: HashSet<String> = read.into_iter().flat_map(|m| m.chunks).collect();
        let doomed = select(&manifests, &chunks, live, &kept_chunks, grace);
        let mut report = GcReport {
            manifests_kept: manifests.len() - doomed.manifests.len(),
            chunks_kept: chunks.len() - doomed.chunks.len(),
            live_missing,
            ..GcReport::default()
        };
        let manifests: Vec<(String, u64)> = doomed
            .manifests
            .iter()
            .map(|m| (manifest_key(&m.hash), m.size))
            .collect();
        let (n, bytes) = self.delete_all(manifests).await?;
        report.manifests_deleted = n;
        report.bytes_deleted += bytes;
        let chunks: Vec<(String, u64)> = doomed
            .chunks
            .iter()
            .map(|c| (chunk_key(&c.hash), c.size))
            .collect();
        let (n, bytes) = self.delete_all(chunks).await?;
        report.chunks_deleted = n;
        report.bytes_deleted += bytes;
        Ok(report)
    }

    /// Every `<prefix>/<sha256>` object of the bucket.
    async fn listing(&self, prefix: &str) -> Result<Vec<Listed>> {
        let now = now_ms();
        let metas: Vec<ObjectMeta> = self
            .bucket
            .list(Some(&Key::from(prefix)))
            .try_collect()
            .await
            .map_err(|e| ObjectError::request(format!("{prefix}/"), e))?;
        Ok(metas
            .iter()
            .filter_map(|m| listed(m, prefix, now))
            .collect())
    }

    /// Deletes the `(key, size)` objects (in batches where the store has them): how many went
    /// and their bytes. A key already gone counts as deleted.
    async fn delete_all(&self, objects: Vec<(String, u64)>) -> Result<(usize, u64)> {
        let sizes: HashMap<String, u64> = objects.iter().cloned().collect();
        let locations = futures::stream::iter(objects.into_iter().map(|(k, _)| Ok(Key::from(k))));
        let mut gone = self.bucket.delete_stream(locations.boxed());
        let (mut n, mut bytes) = (0, 0);
        while let Some(r) = gone.next().await {
            let key = match r {
                Ok(key) => key.to_string(),
                Err(object_store::Error::NotFound { path, .. }) => path,
                Err(e) => return Err(ObjectError::request("deleting collected objects", e)),
            };
            n += 1;
            bytes += sizes.get(&key).copied().unwrap_or(0);
        }
        Ok((n, bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::objects::manifest::sha256_hex;

    fn obj(seed: &str, age_s: u64) -> Listed {
        Listed {
            hash: sha256_hex(seed.as_bytes()),
            size: 10,
            age: Duration::from_secs(age_s),
        }
    }

    fn hashes(v: &[Listed]) -> Vec<&str> {
        v.iter().map(|o| o.hash.as_str()).collect()
    }

    const GRACE: Duration = Duration::from_secs(3600);

    #[test]
    fn old_manifests_nothing_names_go_live_and_young_ones_stay() {
        let (live_m, orphan, young) = (obj("m1", 7200), obj("m2", 7200), obj("m3", 60));
        let manifests = [live_m.clone(), orphan.clone(), young.clone()];
        let live: HashSet<String> = [live_m.hash.clone()].into();
        assert_eq!(
            kept_manifests(&manifests, &live, GRACE),
            [live_m.hash.as_str(), young.hash.as_str()]
        );
        let doomed = select(&manifests, &[], &live, &HashSet::new(), GRACE);
        assert_eq!(hashes(&doomed.manifests), [orphan.hash.as_str()]);
        assert!(doomed.chunks.is_empty());
    }

    #[test]
    fn only_old_chunks_no_kept_manifest_names_go() {
        let (shared, orphan, young) = (obj("c1", 7200), obj("c2", 7200), obj("c3", 10));
        let chunks = [shared.clone(), orphan.clone(), young.clone()];
        let kept: HashSet<String> = [shared.hash.clone()].into();
        let doomed = select(&[], &chunks, &HashSet::new(), &kept, GRACE);
        assert_eq!(hashes(&doomed.chunks), [orphan.hash.as_str()]);
        // An object exactly as old as the grace is old enough; a grace of zero takes all.
        let edge = Listed {
            age: GRACE,
            ..orphan.clone()
        };
        let doomed = select(&[], &[edge], &HashSet::new(), &kept, GRACE);
        assert_eq!(doomed.chunks.len(), 1);
        let doomed = select(&[], &chunks, &HashSet::new(), &kept, Duration::ZERO);
        assert_eq!(doomed.chunks.len(), 2);
    }

    #[test]
    fn listings_keep_sha256_keys_only_and_date_them() {
        use object_store::ObjectMeta;
        let hash = sha256_hex(b"x");
        let meta = |key: &str, at_ms: i64| ObjectMeta {
            location: Key::from(key),
            last_modified: chrono::DateTime::from_timestamp_millis(at_ms).unwrap(),
            size: 5,
            e_tag: None,
            version: None,
        };
        let got = listed(&meta(&format!("chunks/{hash}"), 1_000), "chunks", 61_000).unwrap();
        assert_eq!(
            got,
            Listed {
                hash: hash.clone(),
                size: 5,
                age: Duration::from_secs(60)
            }
        );
        // A clock ahead of ours: age zero, not a wrap-around.
        let ahead = listed(&meta(&format!("chunks/{hash}"), 9_000), "chunks", 1_000).unwrap();
        assert_eq!(ahead.age, Duration::ZERO);
        for other in ["chunks/notes.txt", "chunksx/abc", "manifests/x"] {
            assert!(listed(&meta(other, 0), "chunks", 0).is_none(), "{other}");
        }
        assert!(listed(&meta(&format!("chunks/a/{hash}"), 0), "chunks", 0).is_none());
    }
}
