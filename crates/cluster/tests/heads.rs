//! Audit chain heads in etcd, on a real etcd (started by the test on loopback) and two nodes'
//! real audit logs (each its own SQLite state database, guarded as `kiln node` guards it):
//! the node running a sandbox moves its chain's head with every append; another node's
//! records of that chain are refused until it takes the chain over; then the chain continues
//! there from the head, the first node's late records are refused and say where the chain
//! went, and the two parts join into one chain that verifies against etcd's head (and fails
//! when the newest record is cut off). A fork made on the second node links to its parent's
//! head kept by the first.

#[allow(dead_code)]
#[path = "common/etcd.rs"]
mod etcd;

use std::sync::Arc;

use etcd::EtcdCluster;
use kiln_cluster::heads::assemble;
use kiln_cluster::node::heads::Heads;
use kiln_server::audit::chain::{self, Start, GENESIS};
use kiln_server::audit::guard::Given;
use kiln_server::audit::{AuditConfig, AuditLog, Kind, NewRecord};
use kiln_server::store::{StateDb, StoredChain};
use serde_json::json;

struct Node {
    log: AuditLog,
    heads: Heads,
    _dir: tempfile::TempDir,
}

fn node(name: &str, store: &kiln_cluster::EtcdStore) -> Node {
    let dir = tempfile::tempdir().unwrap();
    let db = StateDb::open(&dir.path().join("kiln.db")).unwrap();
    let heads = Heads::new(
        store.clone(),
        name.to_string(),
        tokio::runtime::Handle::current(),
    );
    // Given with the log's settings, as `kiln node` gives it: guarded from the first record.
    let cfg = AuditConfig {
        guard: Some(Given(Arc::new(heads.clone()))),
        ..Default::default()
    };
    let log = AuditLog::start(db.audit().unwrap(), &cfg).unwrap();
    Node {
        log,
        heads,
        _dir: dir,
    }
}

fn handed(id: &str, n: i64) -> NewRecord {
    NewRecord {
        sandbox_id: id.to_string(),
        ts_ms: 1_700_000_000_000 + n,
        kind: Kind::Api,
        body: json!({ "route": "/sandboxes/{id}", "n": n }),
    }
}

async fn chain_of(n: &Node, id: &str) -> StoredChain {
    n.log.flush().await;
    let id = id.to_string();
    n.log.read(move |s| s.chain(&id)).await.unwrap()
}

fn genesis() -> Start {
    Start {
        seq: 0,
        hash: Some(GENESIS.to_string()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_moves_with_its_sandbox_and_never_forks() {
    let Some(cluster) =
        EtcdCluster::start("a_chain_moves_with_its_sandbox_and_never_forks", 1).await
    else {
        return;
    };
    let store = cluster.store("/kiln-heads").await;
    let (n1, n2) = (node("n1", &store), node("n2", &store));

    for i in 1..=3 {
        n1.log
            .record("sbx", Kind::Process, json!({ "cmd": "ls", "i": i }))
            .await;
    }
    n1.log.flush().await;
    let doc = store.audit_head("sbx").await.unwrap().unwrap().doc;
    assert_eq!((doc.node.as_str(), doc.seq), ("n1", 3));
    assert_eq!(doc.nodes, ["n1"]);
    let a = chain_of(&n1, "sbx").await;
    assert_eq!(
        doc.hash, a.records[2].hash,
        "etcd holds the head of what n1 stored"
    );

    // n2 does not extend a chain n1 holds: its records come back, nothing is stored there.
    let back = n2.log.append_records(vec![handed("sbx", 1)]).await;
    assert_eq!(back.len(), 1);
    assert_eq!(n2.heads.holder("sbx").as_deref(), Some("n1"));
    assert!(chain_of(&n2, "sbx").await.records.is_empty());

    // The sandbox moves to n2: its chain continues there from n1's head.
    let head = n2.heads.take("sbx").await.unwrap().unwrap();
    assert_eq!(head.seq, 3);
    n2.log.continue_chain("sbx", head).await;
    assert!(n2
        .log
        .append_records(vec![handed("sbx", 2)])
        .await
        .is_empty());
    n2.log
        .record("sbx", Kind::Lifecycle, json!({ "event": "resumed" }))
        .await;
    n2.log.flush().await;
    let doc = store.audit_head("sbx").await.unwrap().unwrap().doc;
    assert_eq!((doc.node.as_str(), doc.seq), ("n2", 5));
    assert_eq!(doc.nodes, ["n1", "n2"]);

    // n1's late records are refused and name where the chain went; its part stays as it was.
    let late = n1.log.append_records(vec![handed("sbx", 3)]).await;
    assert_eq!(late.len(), 1);
    assert_eq!(n1.heads.holder("sbx").as_deref(), Some("n2"));
    n1.log
        .record("sbx", Kind::Lifecycle, json!({ "event": "killed" }))
        .await;
    let a = chain_of(&n1, "sbx").await;
    assert_eq!(a.records.len(), 3, "n1 added nothing after the move");

    // The parts join into one chain 1..5 that verifies against etcd's head.
    let b = chain_of(&n2, "sbx").await;
    assert_eq!(b.records.iter().map(|r| r.seq).collect::<Vec<_>>(), [4, 5]);
    assert_eq!(b.records[0].prev_hash, a.records[2].hash);
    let whole = assemble(vec![b.clone(), a.clone()], Some(&doc));
    assert_eq!(
        whole.records.iter().map(|r| r.seq).collect::<Vec<_>>(),
        [1, 2, 3, 4, 5]
    );
    chain::verify(&whole.records, &genesis(), whole.head.as_ref()).unwrap();
    // n2's part verifies on its own too (it starts at n1's head as at an anchor).
    let start = Start {
        seq: 3,
        hash: Some(a.records[2].hash.clone()),
    };
    assert_eq!(b.anchor, Some((3, a.records[2].hash.clone())));
    chain::verify(&b.records, &start, b.head.as_ref()).unwrap();
    // Its newest record cut off n2's database: etcd's head says so.
    let mut cut = b;
    cut.records.pop();
    cut.head = None;
    let broken = assemble(vec![a, cut], Some(&doc));
    let e = chain::verify(&broken.records, &genesis(), broken.head.as_ref()).unwrap_err();
    assert!(e.reason.contains("missing"), "{}", e.reason);

    // A fork made on n2 of a sandbox n1 runs links to that sandbox's head in etcd.
    for i in 1..=2 {
        n1.log
            .record("parent", Kind::Process, json!({ "i": i }))
            .await;
    }
    n1.log.flush().await;
    n2.log
        .link("child", "parent", json!({ "snapshot": "snap1" }))
        .await;
    let child = chain_of(&n2, "child").await;
    let parent = chain_of(&n1, "parent").await;
    let first = child.records[0].body_json();
    assert_eq!(
        (first["parent"].as_str(), first["parentSeq"].as_i64()),
        (Some("parent"), Some(2))
    );
    assert_eq!(child.records[0].prev_hash, parent.records[1].hash);
    let child_doc = store.audit_head("child").await.unwrap().unwrap().doc;
    assert_eq!((child_doc.node.as_str(), child_doc.seq), ("n2", 1));

    // A take-over that fails hands the chain back.
    n2.heads.give("sbx", "n1").await.unwrap();
    let doc = store.audit_head("sbx").await.unwrap().unwrap().doc;
    assert_eq!((doc.node.as_str(), doc.seq), ("n1", 5));
}
