//! Garbage collection of the checkpoint bucket against a real etcd and a real S3 server (moto),
//! both started by the test on 127.0.0.1: what no checkpoint record names goes once older
//! than the grace, what a record or a young manifest names stays, a round that cannot read
//! the records or a live manifest deletes nothing, one node collects at a time, and an upload
//! that reused chunks a concurrent round deleted stores them again. A template's files stay
//! while its record names them.

#[path = "common/data.rs"]
mod data;
#[allow(dead_code)]
#[path = "common/etcd.rs"]
mod etcd;
#[path = "common/moto.rs"]
mod moto;
#[path = "common/records.rs"]
mod records;

use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant};

use data::data;
use etcd::EtcdCluster;
use kiln_cluster::gc::{self, GcConfig, GcError};
use kiln_cluster::objects::{ChunkStore, GcReport, PutReport};
use kiln_cluster::template_files::TemplateFilesDoc;
use kiln_cluster::{CheckpointDoc, CheckpointFile, EtcdStore, NodeCapacity, NodeLease, Published};
use kiln_server::store::SandboxState;
use moto::Moto;
use object_store::path::Path as Key;
use object_store::{ObjectStoreExt, PutPayload};

const CHUNK: usize = 16 * 1024;

/// Every object key of the bucket.
async fn keys(store: &ChunkStore) -> BTreeSet<String> {
    use futures::TryStreamExt;
    store
        .bucket()
        .list(None)
        .map_ok(|m| m.location.to_string())
        .try_collect()
        .await
        .unwrap()
}

/// The keys of a stored file: its manifest and its chunks.
fn keys_of(put: &PutReport) -> BTreeSet<String> {
    let mut k: BTreeSet<String> = put
        .manifest
        .chunks
        .iter()
        .map(|c| format!("chunks/{c}"))
        .collect();
    k.insert(format!("manifests/{}", put.id));
    k
}

async fn put(store: &ChunkStore, dir: &Path, name: &str, bytes: &[u8]) -> PutReport {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    store.put_file(&path).await.unwrap()
}

/// Records a paused sandbox `id` of node `node` whose checkpoint is the file of `put`.
async fn record(etcd: &EtcdStore, node: &str, lease: i64, id: &str, put: &PutReport) {
    let paused = records::sandbox(id, SandboxState::Paused);
    let published = etcd.publish_sandbox(node, lease, &paused, None).await;
    assert!(matches!(published.unwrap(), Published::At(_)));
    assert!(etcd
        .put_checkpoint(id, &files_doc(node, "disk.img", put))
        .await
        .unwrap());
}

/// A record of node `node` naming the file of `put` at `path`.
fn files_doc(node: &str, path: &str, put: &PutReport) -> CheckpointDoc {
    CheckpointDoc {
        node: node.into(),
        files: vec![CheckpointFile {
            path: path.into(),
            manifest: put.id.clone(),
            size: put.manifest.size,
        }],
        bytes: put.manifest.size,
        bytes_uploaded: put.bytes_uploaded,
        upload_ms: 1,
        at_ms: 1,
        network: None,
    }
}

/// What each test starts from: an S3 server and a bucket's chunk store, a one-member etcd
/// under its own prefix, and a scratch directory. None when the test is skipped.
struct Bed {
    _moto: Moto,
    cluster: EtcdCluster,
    etcd: EtcdStore,
    store: ChunkStore,
    dir: tempfile::TempDir,
}

async fn bed(test: &str, prefix: &str, bucket: &str) -> Option<Bed> {
    let moto = Moto::start(test)?;
    let cluster = EtcdCluster::start(test, 1).await?;
    let etcd = cluster.store(prefix).await;
    let store = ChunkStore::connect(&moto.bucket(bucket))
        .unwrap()
        .with_chunk_size(CHUNK);
    Some(Bed {
        _moto: moto,
        cluster,
        etcd,
        store,
        dir: tempfile::tempdir().unwrap(),
    })
}

/// Node n1 of `etcd`, on a lease of 10 s.
async fn node_n1(etcd: &EtcdStore) -> NodeLease {
    etcd.register_node_at(
        "n1",
        "127.0.0.1:1",
        NodeCapacity::default(),
        Duration::from_secs(10),
    )
    .await
    .unwrap()
}

#[tokio::test]
async fn orphans_older_than_the_grace_go_and_what_checkpoints_need_stays() {
    let name = "orphans_older_than_the_grace_go_and_what_checkpoints_need_stays";
    let Some(b) = bed(name, "/kiln-gc", "gc-orphans").await else {
        return;
    };
    let (etcd, store, dir) = (&b.etcd, &b.store, b.dir.path());
    let lease = node_n1(etcd).await;

    // Live: s1's checkpoint. Orphan: a file sharing all but one chunk with it, and one of its
    // own whose first two chunks a later (young) upload reuses.
    let live_bytes = data(4 * CHUNK, 1);
    let live = put(store, dir, "live", &live_bytes).await;
    record(etcd, "n1", lease.lease_id(), "s1", &live).await;
    let mut sibling_bytes = live_bytes.clone();
    sibling_bytes[CHUNK + 1] ^= 0xff;
    let sibling = put(store, dir, "sibling", &sibling_bytes).await;
    assert_eq!(sibling.chunks_uploaded, 1);
    let own_bytes = data(3 * CHUNK, 2);
    let own = put(store, dir, "own", &own_bytes).await;
    // Something else in the bucket, under kiln's prefixes or not.
    for other in ["notes/readme", "chunks/not-a-hash"] {
        let payload = PutPayload::from_static(b"not kiln's");
        store
            .bucket()
            .put(&Key::from(other), payload)
            .await
            .unwrap();
    }
    let before = keys(store).await;

    // Past the grace, an upload in flight: its manifest is written, its record not yet. It
    // reuses two of `own`'s (old) chunks.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let young_bytes = [&own_bytes[..2 * CHUNK], &data(CHUNK, 3)[..]].concat();
    let young = put(store, dir, "young", &young_bytes).await;
    assert_eq!((young.chunks_uploaded, young.chunks_present), (1, 2));

    let grace = Duration::from_secs(2);
    let report = gc::round(etcd, store, grace).await.unwrap();
    let sibling_only = &sibling.manifest.chunks[1];
    let own_only = &own.manifest.chunks[2];
    let gone: BTreeSet<String> = [
        format!("manifests/{}", sibling.id),
        format!("manifests/{}", own.id),
        format!("chunks/{sibling_only}"),
        format!("chunks/{own_only}"),
    ]
    .into();
    let after = keys(store).await;
    assert_eq!(
        before.difference(&after).cloned().collect::<BTreeSet<_>>(),
        gone
    );
    assert!(keys_of(&live).is_subset(&after) && keys_of(&young).is_subset(&after));
    assert!(after.contains("notes/readme") && after.contains("chunks/not-a-hash"));
    let manifest_len = |p: &PutReport| p.manifest.to_json().len() as u64;
    assert_eq!(
        report,
        GcReport {
            manifests_deleted: 2,
            chunks_deleted: 2,
            bytes_deleted: 2 * CHUNK as u64 + manifest_len(&sibling) + manifest_len(&own),
            manifests_kept: 2,
            chunks_kept: 4 + 3,
            live_missing: 0,
        }
    );

    // Both kept files still come back whole.
    for (p, bytes) in [(&live, &live_bytes), (&young, &young_bytes)] {
        let out = dir.join("out");
        let cache = dir.join(format!("cache-{}", p.id));
        store.get_file(&p.id, &out, &cache).await.unwrap();
        assert_eq!(&std::fs::read(&out).unwrap(), bytes);
    }

    // s1 resumes (its record goes): with no grace, nothing of kiln's is left.
    let running = records::sandbox("s1", SandboxState::Running);
    let published = etcd.publish_sandbox("n1", lease.lease_id(), &running, None);
    assert!(matches!(published.await.unwrap(), Published::At(_)));
    let report = gc::round(etcd, store, Duration::ZERO).await.unwrap();
    assert_eq!((report.manifests_deleted, report.manifests_kept), (2, 0));
    assert_eq!(
        keys(store).await,
        ["chunks/not-a-hash", "notes/readme"]
            .map(String::from)
            .into()
    );
}

#[tokio::test]
async fn a_snapshots_files_stay_while_the_snapshot_does() {
    let name = "a_snapshots_files_stay_while_the_snapshot_does";
    let Some(b) = bed(name, "/kiln-gc-snap", "gc-snapshots").await else {
        return;
    };
    let (etcd, store, dir) = (&b.etcd, &b.store, b.dir.path());
    let put = put(store, dir, "layer", &data(2 * CHUNK, 9)).await;
    let snap = kiln_server::store::SnapshotRecord {
        id: "snap1".into(),
        name: None,
        sandbox_id: "s1".into(),
        template_id: "base".into(),
        envd_token: None,
        env_vars: Default::default(),
        created_at_ms: 1,
        size_bytes: 1,
        team: "t".into(),
    };
    let doc = files_doc("n1", "layers/snap1.img", &put);
    assert!(
        !etcd.put_snapshot_files("snap1", &doc).await.unwrap(),
        "no files record for a snapshot that does not exist"
    );
    etcd.insert_snapshot_at(&snap, Some("n1")).await.unwrap();
    assert!(etcd.put_snapshot_files("snap1", &doc).await.unwrap());
    assert_eq!(etcd.snapshot_files("snap1").await.unwrap(), Some(doc));

    let report = gc::round(etcd, store, Duration::ZERO).await.unwrap();
    assert_eq!((report.manifests_deleted, report.manifests_kept), (0, 1));
    assert!(keys_of(&put).is_subset(&keys(store).await));

    // Deleted: its files record goes with it, and the round takes the files.
    assert!(etcd.delete_snapshot_at("snap1", None).await.unwrap());
    assert_eq!(etcd.snapshot_files("snap1").await.unwrap(), None);
    let report = gc::round(etcd, store, Duration::ZERO).await.unwrap();
    assert_eq!((report.manifests_deleted, report.manifests_kept), (1, 0));
    assert!(keys(store).await.is_empty());
}

#[tokio::test]
async fn a_templates_files_stay_while_recorded_and_an_older_build_goes() {
    let name = "a_templates_files_stay_while_recorded_and_an_older_build_goes";
    let Some(b) = bed(name, "/kiln-gc-tpl", "gc-templates").await else {
        return;
    };
    let (etcd, store, dir) = (&b.etcd, &b.store, b.dir.path());
    let old = put(store, dir, "old", &data(2 * CHUNK, 3)).await;
    let doc = |key: &str, put: &PutReport| TemplateFilesDoc {
        name: "tiny".into(),
        key: key.into(),
        meta: serde_json::json!({"name": "tiny", "key": key}),
        manifest: put.id.clone(),
        bytes: put.manifest.size,
        bytes_uploaded: put.bytes_uploaded,
        node: "n1".into(),
        at_ms: 1,
        upload_ms: 1,
    };
    etcd.put_template_files(&doc("k1", &old)).await.unwrap();
    assert_eq!(
        etcd.template_files("tiny").await.unwrap(),
        Some(doc("k1", &old))
    );
    assert_eq!(etcd.template_files("other").await.unwrap(), None);
    let report = gc::round(etcd, store, Duration::ZERO).await.unwrap();
    assert_eq!((report.manifests_deleted, report.manifests_kept), (0, 1));
    assert!(keys_of(&old).is_subset(&keys(store).await));

    // A newer build recorded under the name: the older archive is collected.
    let new = put(store, dir, "new", &data(2 * CHUNK, 4)).await;
    etcd.put_template_files(&doc("k2", &new)).await.unwrap();
    let report = gc::round(etcd, store, Duration::ZERO).await.unwrap();
    assert_eq!((report.manifests_deleted, report.manifests_kept), (1, 1));
    assert_eq!(keys(store).await, keys_of(&new));
}

#[tokio::test]
async fn a_round_that_cannot_read_what_is_live_deletes_nothing() {
    let name = "a_round_that_cannot_read_what_is_live_deletes_nothing";
    let Some(mut b) = bed(name, "/kiln-gc-fail", "gc-fail").await else {
        return;
    };
    let (etcd, store, dir) = (&b.etcd, &b.store, b.dir.path());
    let lease = node_n1(etcd).await;
    let orphan = put(store, dir, "orphan", &data(2 * CHUNK, 4)).await;
    let live = put(store, dir, "live", &data(2 * CHUNK, 5)).await;
    record(etcd, "n1", lease.lease_id(), "s1", &live).await;
    // The live manifest's bytes in the bucket are damaged: its chunks cannot be known.
    let key = Key::from(format!("manifests/{}", live.id));
    let payload = PutPayload::from_static(b"{\"size\":1}");
    store.bucket().put(&key, payload).await.unwrap();
    let before = keys(store).await;
    assert!(keys_of(&orphan).is_subset(&before));

    let err = gc::round(etcd, store, Duration::ZERO).await.unwrap_err();
    assert!(matches!(err, GcError::Objects(_)), "{err}");
    assert_eq!(keys(store).await, before);

    // etcd is gone: the records cannot be read.
    std::fs::write(dir.join("live"), data(2 * CHUNK, 5)).unwrap();
    store.put_file(&dir.join("live")).await.unwrap();
    b.cluster.kill(0);
    let err = gc::round(etcd, store, Duration::ZERO).await.unwrap_err();
    assert!(matches!(err, GcError::Records(_)), "{err}");
    assert_eq!(keys(store).await, before);
}

#[tokio::test]
async fn one_node_collects_at_a_time_and_another_takes_over() {
    let name = "one_node_collects_at_a_time_and_another_takes_over";
    let Some(b) = bed(name, "/kiln-gc-lead", "gc-lead").await else {
        return;
    };
    let (etcd, store, dir) = (&b.etcd, &b.store, b.dir.path());
    let cfg = GcConfig {
        every: Duration::from_millis(200),
        grace: Duration::ZERO,
        ttl: Duration::from_secs(2),
    };
    let leader = || async {
        let key = etcd.keys().gc_leader();
        let got = etcd.client().get(key, None).await.unwrap();
        got.kvs()
            .first()
            .map(|kv| String::from_utf8_lossy(kv.value()).into_owned())
    };
    let workers: Vec<_> = ["n1", "n2"]
        .into_iter()
        .map(|n| tokio::spawn(gc::run(etcd.clone(), store.clone(), n.into(), cfg)))
        .collect();
    put(store, dir, "a", &data(2 * CHUNK, 6)).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while !keys(store).await.is_empty() {
        assert!(
            Instant::now() < deadline,
            "the first orphan was not collected"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let lead = leader().await.expect("a leader");
    assert!(lead == "n1" || lead == "n2", "{lead}");

    // The leader stops (its lease expires): the other node takes over and collects.
    workers[usize::from(lead == "n2")].abort();
    let other = if lead == "n1" { "n2" } else { "n1" };
    let deadline = Instant::now() + Duration::from_secs(20);
    while leader().await.as_deref() != Some(other) {
        assert!(
            Instant::now() < deadline,
            "the other node did not take over"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    put(store, dir, "b", &data(2 * CHUNK, 7)).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while !keys(store).await.is_empty() {
        assert!(
            Instant::now() < deadline,
            "the second orphan was not collected"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for w in workers {
        w.abort();
    }
}

#[tokio::test]
async fn an_upload_a_round_overlapped_stores_again_what_the_round_deleted() {
    let name = "an_upload_a_round_overlapped_stores_again_what_the_round_deleted";
    let Some(b) = bed(name, "/kiln-gc-settle", "gc-settle").await else {
        return;
    };
    let (etcd, store, dir) = (&b.etcd, &b.store, b.dir.path());
    let node = node_n1(etcd).await;
    let collector = etcd.client().lease_grant(10, None).await.unwrap().id();
    let old_bytes = data(3 * CHUNK, 8);
    put(store, dir, "old", &old_bytes).await;
    let never = gc::round_mark(etcd).await.unwrap();
    assert!(!never.running);
    assert!(!gc::settle(etcd, store, &never, &[]).await.unwrap());

    // An upload begins and reuses two chunks of an orphan; a round collects them (and, with
    // no grace, the upload's manifest) before the upload's record is written.
    let before = gc::round_mark(etcd).await.unwrap();
    let new_bytes = [&old_bytes[..2 * CHUNK], &data(CHUNK, 9)[..]].concat();
    let new = put(store, dir, "new", &new_bytes).await;
    assert_eq!(new.chunks_present, 2);
    gc::begin_round(etcd, collector).await.unwrap();
    assert!(gc::round_mark(etcd).await.unwrap().running);
    let report = gc::round(etcd, store, Duration::ZERO).await.unwrap();
    gc::end_round(etcd).await.unwrap();
    assert_eq!((report.manifests_deleted, report.chunks_deleted), (2, 4));

    // The record is written, then the upload settles: its file is whole in the bucket again.
    record(etcd, "n1", node.lease_id(), "s1", &new).await;
    let files = [(dir.join("new"), new.id.clone())];
    assert!(gc::settle(etcd, store, &before, &files).await.unwrap());
    assert_eq!(keys(store).await, keys_of(&new));
    let out = dir.join("out");
    store
        .get_file(&new.id, &out, &dir.join("cache"))
        .await
        .unwrap();
    assert_eq!(std::fs::read(&out).unwrap(), new_bytes);
    // The record protects it from every later round.
    gc::round(etcd, store, Duration::ZERO).await.unwrap();
    assert_eq!(keys(store).await, keys_of(&new));

    // An upload no round overlapped has nothing to do; one that a running round overlaps
    // waits for the round's end.
    let quiet = gc::round_mark(etcd).await.unwrap();
    assert!(!gc::settle(etcd, store, &quiet, &files).await.unwrap());
    gc::begin_round(etcd, collector).await.unwrap();
    let during = gc::round_mark(etcd).await.unwrap();
    let ending = {
        let etcd = etcd.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            gc::end_round(&etcd).await.unwrap();
        })
    };
    let t = Instant::now();
    assert!(gc::settle(etcd, store, &during, &files).await.unwrap());
    assert!(
        t.elapsed() >= Duration::from_millis(1400),
        "{:?}",
        t.elapsed()
    );
    ending.await.unwrap();
    // A file that is no longer what its record names is refused.
    std::fs::write(dir.join("new"), b"other bytes").unwrap();
    let err = gc::settle(etcd, store, &during, &files).await.unwrap_err();
    assert!(matches!(err, GcError::Changed { .. }), "{err}");
}
