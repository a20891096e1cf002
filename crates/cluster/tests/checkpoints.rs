//! Paused sandboxes' checkpoint records and ownership moves on a real etcd (started by the test
//! on loopback): a checkpoint is recorded only by the node that owns the sandbox, a publication
//! of any state but paused drops it, two nodes taking one paused sandbox over race to one
//! winner, and the old node's publications are refused once the sandbox moved.

#[allow(dead_code)]
#[path = "common/etcd.rs"]
mod etcd;
#[path = "common/records.rs"]
mod records;

use std::collections::BTreeMap;
use std::time::Duration;

use etcd::EtcdCluster;
use kiln_cluster::{CheckpointDoc, CheckpointFile, Moved, NodeCapacity, Published};
use kiln_server::store::{SandboxState, SandboxStore};
use records::sandbox;

fn doc(node: &str) -> CheckpointDoc {
    CheckpointDoc {
        node: node.into(),
        files: vec![CheckpointFile {
            path: "disk.img".into(),
            manifest: "0".repeat(64),
            size: 4096,
        }],
        bytes: 4096,
        bytes_uploaded: 4096,
        upload_ms: 3,
        at_ms: 1,
        // Kept as stored: the sealed network settings the next node opens.
        network: Some("c2VhbGVk".into()),
    }
}

#[tokio::test]
async fn checkpoints_follow_the_owner_and_one_take_over_wins() {
    let name = "checkpoints_follow_the_owner_and_one_take_over_wins";
    let Some(cluster) = EtcdCluster::start(name, 1).await else {
        return;
    };
    let store = cluster.store("/kiln-ckpt").await;
    let ttl = Duration::from_secs(5);
    let mut leases = BTreeMap::new();
    for n in ["n1", "n2", "n3"] {
        let l = store
            .register_node_at(n, "127.0.0.1:1", NodeCapacity::default(), ttl)
            .await
            .unwrap();
        leases.insert(n, l);
    }
    let lease = |n: &str| leases[n].lease_id();

    // n1 pauses s1 and records its checkpoint; n2, not the owner, cannot.
    let paused = sandbox("s1", SandboxState::Paused);
    let published = store.publish_sandbox("n1", lease("n1"), &paused, None);
    assert!(matches!(published.await.unwrap(), Published::At(_)));
    assert!(store.put_checkpoint("s1", &doc("n1")).await.unwrap());
    assert!(!store.put_checkpoint("s1", &doc("n2")).await.unwrap());
    assert_eq!(store.checkpoint("s1").await.unwrap(), Some(doc("n1")));

    // n2 and n3 both take s1 over from n1 at once: one wins, the other is told who did.
    let (a, b) = tokio::join!(
        store.move_owner("s1", "n1", "n2"),
        store.move_owner("s1", "n1", "n3")
    );
    let (a, b) = (a.unwrap(), b.unwrap());
    let winner = match (&a, &b) {
        (Moved::To(_), Moved::Taken(w)) => {
            assert_eq!(w, "n2");
            "n2"
        }
        (Moved::Taken(w), Moved::To(_)) => {
            assert_eq!(w, "n3");
            "n3"
        }
        other => panic!("not one winner: {other:?}"),
    };
    assert_eq!(store.owner_of("s1").await.unwrap().as_deref(), Some(winner));
    // Asking again (a take-over that stopped half-way) is a yes for the winner only.
    assert!(matches!(
        store.move_owner("s1", "n1", winner).await.unwrap(),
        Moved::To(_)
    ));

    // The old owner's publications are refused now (its copy must not overwrite the record).
    let killed = sandbox("s1", SandboxState::Killed);
    let old = store.publish_sandbox("n1", lease("n1"), &killed, None);
    assert_eq!(old.await.unwrap(), Published::Moved);
    assert_eq!(
        store.get_sandbox("s1").await.unwrap().unwrap().state,
        SandboxState::Paused
    );

    // The winner resumes it: running, and its checkpoint record is gone with that write.
    let running = sandbox("s1", SandboxState::Running);
    let now = store.publish_sandbox(winner, lease(winner), &running, None);
    assert!(matches!(now.await.unwrap(), Published::At(_)));
    assert_eq!(store.checkpoint("s1").await.unwrap(), None);
    // A running sandbox does not move.
    let loser = if winner == "n2" { "n3" } else { "n2" };
    assert!(matches!(
        store.move_owner("s1", winner, loser).await.unwrap(),
        Moved::NotPaused
    ));
    assert!(matches!(
        store.move_owner("nope", "n1", "n2").await.unwrap(),
        Moved::NotPaused
    ));
}
