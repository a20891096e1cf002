//! Snapshots as a cluster records them, on a real etcd (started by the test on loopback): the
//! node that keeps a snapshot's files travels with its record (read by id and by name, and in
//! the list), names stay unique across nodes, a record written by the server's store seam has
//! no node, and a snapshot deleted while its node is away leaves that node a note it reads
//! and forgets once the files are gone (and only that node).

#[allow(dead_code)]
#[path = "common/etcd.rs"]
mod etcd;

use std::collections::BTreeMap;

use etcd::EtcdCluster;
use kiln_cluster::{ClusterError, SnapshotDrop};
use kiln_server::store::{SandboxStore, SnapshotRecord};

fn snap(id: &str, name: Option<&str>, at: i64, team: &str) -> SnapshotRecord {
    SnapshotRecord {
        id: id.into(),
        name: name.map(str::to_string),
        sandbox_id: "sbx".into(),
        template_id: "base".into(),
        envd_token: None,
        env_vars: BTreeMap::new(),
        created_at_ms: at,
        size_bytes: 4096,
        team: team.into(),
    }
}

#[tokio::test]
async fn a_snapshot_keeps_its_node_and_a_deleted_one_leaves_its_absent_node_a_note() {
    let name = "a_snapshot_keeps_its_node_and_a_deleted_one_leaves_its_absent_node_a_note";
    let Some(cluster) = EtcdCluster::start(name, 1).await else {
        return;
    };
    let s = cluster.store("/kiln-snapshots").await;
    s.insert_snapshot_at(&snap("s1", Some("first"), 10, "red"), Some("n1"))
        .await
        .unwrap();
    s.insert_snapshot_at(&snap("s2", None, 20, "blue/x"), Some("n2"))
        .await
        .unwrap();
    // Through the server's seam: no node.
    SandboxStore::insert_snapshot(&s, &snap("s0", None, 5, "red"))
        .await
        .unwrap();

    let by_name = s.snapshot_at("first").await.unwrap().unwrap();
    assert_eq!(by_name.snapshot, snap("s1", Some("first"), 10, "red"));
    assert_eq!(by_name.node.as_deref(), Some("n1"));
    assert_eq!(s.snapshot_at("s1").await.unwrap(), Some(by_name));
    assert!(s.snapshot_at("nope").await.unwrap().is_none());
    let all: Vec<(String, Option<String>)> = s
        .snapshots_at()
        .await
        .unwrap()
        .into_iter()
        .map(|l| (l.snapshot.id, l.node))
        .collect();
    assert_eq!(
        all,
        [
            ("s0".into(), None),
            ("s1".into(), Some("n1".into())),
            ("s2".into(), Some("n2".into()))
        ]
    );
    // The seam reads the same records, without where they are.
    assert_eq!(
        SandboxStore::get_snapshot(&s, "first").await.unwrap(),
        Some(snap("s1", Some("first"), 10, "red"))
    );

    // A name taken on one node cannot be taken on another; the id is not written either.
    let e = s
        .insert_snapshot_at(&snap("s3", Some("first"), 30, "red"), Some("n2"))
        .await
        .unwrap_err();
    assert!(
        matches!(e, ClusterError::Exists { ref id, .. } if id == "first"),
        "{e}"
    );
    assert!(s.snapshot_at("s3").await.unwrap().is_none());

    // Deleted with its node present: no note.
    assert!(s.delete_snapshot_at("s1", None).await.unwrap());
    assert!(
        s.snapshot_at("first").await.unwrap().is_none(),
        "the name goes too"
    );
    assert!(s.snapshot_drops("n1").await.unwrap().is_empty());
    // The name is free again.
    s.insert_snapshot_at(&snap("s4", Some("first"), 40, "red"), Some("n2"))
        .await
        .unwrap();

    // Deleted while n2 is away: a note for n2 only, with the team.
    assert!(s.delete_snapshot_at("s2", Some("n2")).await.unwrap());
    assert!(!s.delete_snapshot_at("s2", Some("n2")).await.unwrap());
    assert!(s.snapshot_at("s2").await.unwrap().is_none());
    assert_eq!(
        s.snapshot_drops("n2").await.unwrap(),
        [SnapshotDrop {
            id: "s2".into(),
            team: "blue/x".into()
        }]
    );
    assert!(s.snapshot_drops("n1").await.unwrap().is_empty());
    assert!(
        s.snapshot_drops("n").await.unwrap().is_empty(),
        "a node's notes are not a prefix of another's"
    );
    s.forget_snapshot_drop("n2", "s2").await.unwrap();

    // A fork's capture: found by id, marked in the list (replicas leave it out).
    s.insert_fork_capture(&snap("f1", None, 50, "red"), "n1")
        .await
        .unwrap();
    let f = s.snapshot_at("f1").await.unwrap().unwrap();
    assert!(f.transient && f.node.as_deref() == Some("n1"), "{f:?}");
    let listed = s.snapshots_at().await.unwrap();
    assert!(listed
        .iter()
        .all(|l| l.transient == (l.snapshot.id == "f1")));
    assert!(!s.snapshot_at("s4").await.unwrap().unwrap().transient);
    assert!(s.snapshot_drops("n2").await.unwrap().is_empty());
    assert!(s.snapshot_at("s4").await.unwrap().is_some(), "others stay");
}
