//! Checkpoint bytes in object storage: `ChunkStore` against a real S3 server (moto, started by
//! the test on 127.0.0.1): round trips, uploads and fetches of only the missing chunks, a
//! corrupted chunk refused without leaving a partial file, and a chunk cache kept under its
//! cap by evicting the least recently used.

#[path = "common/data.rs"]
mod data;
#[path = "common/moto.rs"]
mod moto;

use std::path::Path;

use data::data;
use kiln_cluster::objects::{ChunkCache, ChunkStore, GetReport, ObjectError};
use moto::Moto;
use object_store::path::Path as Key;
use object_store::{ObjectStoreExt, PutPayload};

const CHUNK: usize = 64 * 1024;

async fn store(moto: &Moto, bucket: &str) -> ChunkStore {
    ChunkStore::connect(&moto.bucket(bucket))
        .unwrap()
        .with_chunk_size(CHUNK)
}

/// Every object key under `prefix` in the bucket.
async fn keys(store: &ChunkStore, prefix: &str) -> Vec<String> {
    use futures::TryStreamExt;
    let mut keys: Vec<String> = store
        .bucket()
        .list(Some(&Key::from(prefix)))
        .map_ok(|m| m.location.to_string())
        .try_collect()
        .await
        .unwrap();
    keys.sort();
    keys
}

fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[tokio::test]
async fn files_round_trip_and_a_second_put_uploads_nothing() {
    let Some(moto) = Moto::start("files_round_trip_and_a_second_put_uploads_nothing") else {
        return;
    };
    let store = store(&moto, "round-trip").await;
    let dir = tempfile::tempdir().unwrap();
    let sizes = [0, 1, CHUNK - 1, CHUNK, 3 * CHUNK + 5];
    for (i, &size) in sizes.iter().enumerate() {
        let src = dir.path().join(format!("src-{i}"));
        let bytes = data(size, i as u64 + 1);
        std::fs::write(&src, &bytes).unwrap();
        let chunks = size.div_ceil(CHUNK);

        let put = store.put_file(&src).await.unwrap();
        assert_eq!(put.manifest.size, size as u64);
        assert_eq!(put.manifest.chunk_size, CHUNK as u64);
        assert_eq!(put.manifest.chunks.len(), chunks, "size {size}");
        assert_eq!(
            (put.chunks_uploaded, put.bytes_uploaded),
            (chunks, size as u64)
        );

        let again = store.put_file(&src).await.unwrap();
        assert_eq!(again.id, put.id, "one file, one manifest id");
        assert_eq!((again.chunks_uploaded, again.bytes_uploaded), (0, 0));
        assert_eq!(again.chunks_present, chunks);

        let dest = dir.path().join(format!("dest-{i}"));
        let cache = dir.path().join(format!("cache-{i}"));
        let got = store.get_file(&put.id, &dest, &cache).await.unwrap();
        assert_eq!(std::fs::read(&dest).unwrap(), bytes, "size {size}");
        assert_eq!(
            got,
            GetReport {
                size: size as u64,
                chunks_fetched: chunks,
                bytes_fetched: size as u64,
                chunks_reused: 0,
                bytes_reused: 0,
            }
        );
        assert_eq!(entries(&cache).len(), chunks, "the cache holds each chunk");
    }
    // The bucket's layout: one object per distinct chunk, one manifest per file.
    let chunk_keys = keys(&store, "chunks").await;
    assert_eq!(chunk_keys.len(), 1 + 1 + 1 + 4);
    assert_eq!(keys(&store, "manifests").await.len(), sizes.len());
    // Nothing but the sources, destinations and caches in the directory: no temporary files.
    assert!(entries(dir.path()).iter().all(|n| !n.starts_with('.')));
}

#[tokio::test]
async fn one_changed_chunk_is_uploaded_and_fetched_alone() {
    let Some(moto) = Moto::start("one_changed_chunk_is_uploaded_and_fetched_alone") else {
        return;
    };
    let store = store(&moto, "one-chunk").await;
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let first = data(5 * CHUNK + 100, 7);
    let mut second = first.clone();
    second[2 * CHUNK + 10] ^= 0xff;
    std::fs::write(dir.path().join("a"), &first).unwrap();
    std::fs::write(dir.path().join("b"), &second).unwrap();

    let a = store.put_file(&dir.path().join("a")).await.unwrap();
    assert_eq!(a.chunks_uploaded, 6);
    let b = store.put_file(&dir.path().join("b")).await.unwrap();
    assert_ne!(a.id, b.id);
    assert_eq!((b.chunks_uploaded, b.bytes_uploaded), (1, CHUNK as u64));
    assert_eq!(b.chunks_present, 5);
    let differ: Vec<usize> = (0..6)
        .filter(|&i| a.manifest.chunks[i] != b.manifest.chunks[i])
        .collect();
    assert_eq!(differ, [2]);

    let got_a = store
        .get_file(&a.id, &dir.path().join("a-out"), &cache)
        .await
        .unwrap();
    assert_eq!((got_a.chunks_fetched, got_a.chunks_reused), (6, 0));
    let got_b = store
        .get_file(&b.id, &dir.path().join("b-out"), &cache)
        .await
        .unwrap();
    assert_eq!(
        (got_b.chunks_fetched, got_b.bytes_fetched),
        (1, CHUNK as u64)
    );
    assert_eq!(
        (got_b.chunks_reused, got_b.bytes_reused),
        (5, 4 * CHUNK as u64 + 100)
    );
    assert_eq!(std::fs::read(dir.path().join("a-out")).unwrap(), first);
    assert_eq!(std::fs::read(dir.path().join("b-out")).unwrap(), second);

    // A damaged cache entry is not trusted: it is fetched again.
    std::fs::write(cache.join(&b.manifest.chunks[0]), b"not the chunk").unwrap();
    let again = store
        .get_file(&b.id, &dir.path().join("b-out"), &cache)
        .await
        .unwrap();
    assert_eq!((again.chunks_fetched, again.chunks_reused), (1, 5));
    assert_eq!(std::fs::read(dir.path().join("b-out")).unwrap(), second);
}

#[tokio::test]
async fn repeated_and_zero_chunks_are_sent_and_fetched_once() {
    let Some(moto) = Moto::start("repeated_and_zero_chunks_are_sent_and_fetched_once") else {
        return;
    };
    let store = store(&moto, "repeats").await;
    let dir = tempfile::tempdir().unwrap();
    let zeros = vec![0u8; CHUNK];
    let one = data(CHUNK, 5);
    let file = [&zeros, &one, &zeros, &one, &zeros, &data(100, 6)[..]].concat();
    std::fs::write(dir.path().join("src"), &file).unwrap();

    let put = store.put_file(&dir.path().join("src")).await.unwrap();
    assert_eq!(put.manifest.chunks.len(), 6);
    assert_eq!((put.chunks_uploaded, put.chunks_present), (3, 3));
    assert_eq!(put.bytes_uploaded, 2 * CHUNK as u64 + 100);

    let got = store
        .get_file(&put.id, &dir.path().join("out"), &dir.path().join("cache"))
        .await
        .unwrap();
    assert_eq!(std::fs::read(dir.path().join("out")).unwrap(), file);
    assert_eq!((got.chunks_fetched, got.chunks_reused), (3, 3));
    assert_eq!(got.bytes_fetched, 2 * CHUNK as u64 + 100);
    assert_eq!(got.bytes_reused, 3 * CHUNK as u64);
}

#[tokio::test]
async fn a_corrupted_chunk_fails_naming_it_and_leaves_no_file() {
    let Some(moto) = Moto::start("a_corrupted_chunk_fails_naming_it_and_leaves_no_file") else {
        return;
    };
    let store = store(&moto, "corrupt").await;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    std::fs::create_dir(&out).unwrap();
    let src = dir.path().join("src");
    std::fs::write(&src, data(3 * CHUNK + 1, 3)).unwrap();
    let put = store.put_file(&src).await.unwrap();
    let bad = put.manifest.chunks[1].clone();
    store
        .bucket()
        .put(
            &Key::from(format!("chunks/{bad}")),
            PutPayload::from(data(CHUNK, 99)),
        )
        .await
        .unwrap();

    let cache = dir.path().join("cache");
    let err = store
        .get_file(&put.id, &out.join("file"), &cache)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, ObjectError::CorruptChunk { hash, .. } if *hash == bad),
        "{err}"
    );
    assert!(err.to_string().contains(&bad), "{err}");
    assert!(!err.to_string().contains(&dir.path().display().to_string()));
    assert_eq!(entries(&out), Vec::<String>::new(), "no partial file");
    assert!(
        !entries(&cache).contains(&bad),
        "the bad chunk is not cached"
    );

    // An existing destination stays as it was.
    std::fs::write(out.join("file"), b"old").unwrap();
    store
        .get_file(&put.id, &out.join("file"), &cache)
        .await
        .unwrap_err();
    assert_eq!(std::fs::read(out.join("file")).unwrap(), b"old");
    assert_eq!(entries(&out), ["file"]);

    // A chunk gone from the bucket, an unknown manifest, and an id that is no hash.
    store
        .bucket()
        .delete(&Key::from(format!("chunks/{bad}")))
        .await
        .unwrap();
    let err = store
        .get_file(&put.id, &out.join("file"), &dir.path().join("cold"))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, ObjectError::ChunkMissing(h) if *h == bad),
        "{err}"
    );
    let unknown = "0".repeat(64);
    let err = store
        .get_file(&unknown, &out.join("file"), &cache)
        .await
        .unwrap_err();
    assert!(matches!(err, ObjectError::ManifestNotFound(_)), "{err}");
    let err = store
        .get_file("../manifests", &out.join("file"), &cache)
        .await
        .unwrap_err();
    assert!(matches!(err, ObjectError::BadManifestId(_)), "{err}");
    assert_eq!(entries(&out), ["file"]);
}

#[tokio::test]
async fn a_sparse_file_sends_its_holes_once_and_comes_back_whole() {
    let Some(moto) = Moto::start("a_sparse_file_sends_its_holes_once_and_comes_back_whole") else {
        return;
    };
    let store = store(&moto, "sparse").await;
    store.check().await.expect("the bucket answers");
    let dir = tempfile::tempdir().unwrap();
    // 64 chunks, of which only the 2nd and the 40th hold data: a disk image's shape.
    let src = dir.path().join("disk.img");
    let f = std::fs::File::create(&src).unwrap();
    f.set_len(64 * CHUNK as u64).unwrap();
    use std::os::unix::fs::FileExt;
    f.write_all_at(&data(CHUNK, 1), CHUNK as u64).unwrap();
    f.write_all_at(&data(100, 2), 39 * CHUNK as u64 + 7)
        .unwrap();
    drop(f);
    let put = store.put_file(&src).await.unwrap();
    assert_eq!(put.manifest.chunks.len(), 64);
    assert_eq!(put.chunks_uploaded, 3, "two data chunks and one zero chunk");
    assert_eq!(put.bytes_uploaded, 3 * CHUNK as u64);
    let dest = dir.path().join("back.img");
    let got = store
        .get_file(&put.id, &dest, &dir.path().join("cache"))
        .await
        .unwrap();
    assert_eq!(got.chunks_fetched, 3);
    assert_eq!(std::fs::read(&dest).unwrap(), std::fs::read(&src).unwrap());
    // A bucket that does not exist fails the check.
    let mut missing = moto.bucket("sparse-other");
    missing.bucket = "no-such-bucket".into();
    let err = ChunkStore::connect(&missing)
        .unwrap()
        .check()
        .await
        .unwrap_err();
    assert!(matches!(err, ObjectError::Request { .. }), "{err}");
}

/// The bytes of the chunks in a cache directory.
fn cached_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum()
}

#[tokio::test]
async fn the_chunk_cache_keeps_the_recently_used_under_its_cap() {
    let name = "the_chunk_cache_keeps_the_recently_used_under_its_cap";
    let Some(moto) = Moto::start(name) else {
        return;
    };
    let store = store(&moto, "cache-cap").await;
    let dir = tempfile::tempdir().unwrap();
    let (a_bytes, b_bytes) = (data(4 * CHUNK, 11), data(4 * CHUNK, 12));
    std::fs::write(dir.path().join("a"), &a_bytes).unwrap();
    std::fs::write(dir.path().join("b"), &b_bytes).unwrap();
    let a = store.put_file(&dir.path().join("a")).await.unwrap();
    let b = store.put_file(&dir.path().join("b")).await.unwrap();
    let cache = ChunkCache::new(dir.path().join("cache"), 5 * CHUNK as u64);
    let out = dir.path().join("out");
    let get = |id: String| {
        let (store, cache, out) = (store.clone(), cache.clone(), out.clone());
        async move {
            let using = cache.fetching().await;
            let got = store.get_file(&id, &out, cache.dir()).await.unwrap();
            drop(using);
            let trimmed = cache.trim().await.unwrap().expect("no fetch in flight");
            assert!(trimmed.bytes_kept <= cache.max_bytes(), "{trimmed:?}");
            assert_eq!(cached_bytes(cache.dir()), trimmed.bytes_kept);
            (got, trimmed)
        }
    };

    // A, then B: 8 chunks for a cap of 5, so three of A's (the least recently used) go.
    let (got, trimmed) = get(a.id.clone()).await;
    assert_eq!((got.chunks_fetched, trimmed.chunks_evicted), (4, 0));
    std::thread::sleep(std::time::Duration::from_millis(20));
    let (got, trimmed) = get(b.id.clone()).await;
    assert_eq!((got.chunks_fetched, trimmed.chunks_evicted), (4, 3));
    assert_eq!(std::fs::read(&out).unwrap(), b_bytes);
    std::thread::sleep(std::time::Duration::from_millis(20));

    // A again: three chunks fetched anew, one reused (and used now); then B's oldest go.
    let (got, trimmed) = get(a.id.clone()).await;
    assert_eq!((got.chunks_fetched, got.chunks_reused), (3, 1));
    assert_eq!(trimmed.chunks_evicted, 3);
    assert_eq!(std::fs::read(&out).unwrap(), a_bytes);
    // (B's four chunks were written at once, in any order: one of them is the newest.)
    let kept = entries(cache.dir());
    assert!(
        a.manifest.chunks.iter().all(|c| kept.contains(c)),
        "{kept:?}"
    );
    let of_b = b
        .manifest
        .chunks
        .iter()
        .filter(|c| kept.contains(c))
        .count();
    assert_eq!((kept.len(), of_b), (5, 1));
}
