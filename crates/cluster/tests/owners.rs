//! Which node runs which sandbox, on a real etcd (started by the test on loopback): a node's
//! publications are guarded by its lease and never bring back a sandbox the cluster ended, and
//! a lost node's running sandboxes end once as `died: node-lost` while its paused ones stay;
//! a drained node is marked for every replica's view, apart from its lease; a replica whose
//! watch has not yet seen a sandbox published a moment before (another replica's create)
//! answers for it and lists it, no longer shows one ended a moment before, and gives up on an
//! unknown one at once.

#[allow(dead_code)]
#[path = "common/etcd.rs"]
mod etcd;
#[path = "common/records.rs"]
mod records;

use std::time::Duration;

use etcd::EtcdCluster;
use kiln_cluster::{NodeCapacity, Published, NODE_LOST_REASON};
use kiln_server::manager::LifecycleEvent;
use kiln_server::store::{EventStore, SandboxState, SandboxStore};
use records::sandbox;

#[tokio::test]
async fn publications_follow_the_lease_and_never_revive_the_dead() {
    let name = "publications_follow_the_lease_and_never_revive_the_dead";
    let Some(cluster) = EtcdCluster::start(name, 1).await else {
        return;
    };
    let store = cluster.store("/kiln-owners").await;
    let ttl = Duration::from_secs(3);
    let lease = store
        .register_node_at("n1", "127.0.0.1:1", NodeCapacity::default(), ttl)
        .await
        .unwrap();
    let id = lease.lease_id();
    assert_eq!(store.live_nodes().await.unwrap()[0].address, "127.0.0.1:1");

    // Published under the lease: the record, the owner, the event.
    let created = LifecycleEvent {
        ts_ms: 1000,
        sandbox_id: "s1".into(),
        kind: "created".into(),
        detail: "on n1".into(),
    };
    let running = sandbox("s1", SandboxState::Running);
    let Published::At(rev) = store
        .publish_sandbox("n1", id, &running, Some(&created))
        .await
        .unwrap()
    else {
        panic!("not published under a live lease");
    };
    assert!(rev > 0);
    let paused = sandbox("s2", SandboxState::Paused);
    assert!(matches!(
        store
            .publish_sandbox("n1", id, &paused, None)
            .await
            .unwrap(),
        Published::At(_)
    ));
    assert_eq!(
        store.get_sandbox("s1").await.unwrap(),
        Some(running.clone())
    );
    let events = store.events("s1").await.unwrap();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].kind, "created");
    let mut mine = store.sandboxes_of("n1").await.unwrap();
    mine.sort();
    assert_eq!(mine, ["s1", "s2"]);
    // Another lease (a stale holder of the name) publishes nothing.
    assert_eq!(
        store
            .publish_sandbox("n1", id + 1, &running, None)
            .await
            .unwrap(),
        Published::LeaseGone
    );

    // The node is lost: its running sandbox dies node-lost, once; its paused one stays.
    assert_eq!(store.end_lost_node("n1").await.unwrap(), ["s1"]);
    assert!(store.end_lost_node("n1").await.unwrap().is_empty());
    let s1 = store.get_sandbox("s1").await.unwrap().unwrap();
    assert_eq!(s1.state, SandboxState::Killed);
    assert_eq!(s1.end_reason.as_deref(), Some(NODE_LOST_REASON));
    assert!(s1.ended_at_ms.is_some());
    let died = store.events("s1").await.unwrap();
    assert_eq!(died.last().map(|e| e.kind.as_str()), Some("died"));
    assert!(died.last().unwrap().detail.contains("node-lost"));
    assert_eq!(
        store.get_sandbox("s2").await.unwrap().map(|r| r.state),
        Some(SandboxState::Paused)
    );

    // The node, back, cannot bring s1 back to life; it may record it ended.
    assert_eq!(
        store
            .publish_sandbox("n1", id, &running, None)
            .await
            .unwrap(),
        Published::Ended
    );
    assert_eq!(
        store.get_sandbox("s1").await.unwrap().map(|r| r.state),
        Some(SandboxState::Killed)
    );
    let mut ended = sandbox("s1", SandboxState::Killed);
    ended.end_reason = Some(NODE_LOST_REASON.into());
    assert!(matches!(
        store.publish_sandbox("n1", id, &ended, None).await.unwrap(),
        Published::At(_)
    ));

    // Once the lease is gone, nothing more is published.
    lease.leave().await.unwrap();
    assert_eq!(
        store
            .publish_sandbox("n1", id, &paused, None)
            .await
            .unwrap(),
        Published::LeaseGone
    );
}

/// Polls `f` for up to five seconds.
async fn eventually(mut f: impl FnMut() -> bool) -> bool {
    for _ in 0..50 {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

#[tokio::test]
async fn a_drained_node_is_marked_for_every_replica_and_reports_what_stays() {
    let name = "a_drained_node_is_marked_for_every_replica_and_reports_what_stays";
    let Some(cluster) = EtcdCluster::start(name, 1).await else {
        return;
    };
    let store = cluster.store("/kiln-drain").await;
    let cache = kiln_cluster::control::Cache::start(cluster.store("/kiln-drain").await)
        .await
        .unwrap();
    let lease = store
        .register_node_at(
            "n1",
            "127.0.0.1:1",
            NodeCapacity::default(),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    let id = lease.lease_id();
    for (sid, state) in [
        ("r1", SandboxState::Running),
        ("p1", SandboxState::Paused),
        ("k1", SandboxState::Killed),
    ] {
        let published = store
            .publish_sandbox("n1", id, &sandbox(sid, state), None)
            .await
            .unwrap();
        assert!(matches!(published, Published::At(_)));
    }
    assert!(!cache.is_draining("n1"));

    let r = store.drain_node("n1").await.unwrap();
    assert!(r.live && !r.already, "{r:?}");
    assert_eq!(
        (r.running, r.paused),
        (vec!["r1".to_string()], vec!["p1".to_string()])
    );
    assert!(
        eventually(|| cache.is_draining("n1")).await,
        "the replica's view has the mark"
    );
    assert!(store.drain_node("n1").await.unwrap().already);
    let marks = store.draining_nodes().await.unwrap();
    assert_eq!(
        marks.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(),
        ["n1"]
    );

    // The mark is not the node's registration: it outlives the node's lease.
    lease.leave().await.unwrap();
    let r = store.drain_node("n1").await.unwrap();
    assert!(!r.live && r.already, "{r:?}");

    assert!(store.undrain_node("n1").await.unwrap());
    assert!(!store.undrain_node("n1").await.unwrap(), "undrained once");
    assert!(eventually(|| !cache.is_draining("n1")).await);
    assert!(store.draining_nodes().await.unwrap().is_empty());
}

/// Publishes sandbox `sid` in `state` as node `n1` under `lease` from a thread of its own
/// while the calling thread blocks: a current-thread test runtime runs nothing meanwhile, so
/// its replica's watch has not seen the change when this returns (another replica's call).
fn published_elsewhere(endpoints: &[String], lease: i64, sid: &str, state: SandboxState) {
    let (endpoints, sid) = (endpoints.to_vec(), sid.to_string());
    let published = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let store = kiln_cluster::EtcdStore::connect(&endpoints, "/kiln-known")
                .await
                .unwrap();
            let rec = sandbox(&sid, state);
            store
                .publish_sandbox("n1", lease, &rec, None)
                .await
                .unwrap()
        })
    })
    .join()
    .unwrap();
    assert!(matches!(published, Published::At(_)), "{published:?}");
}

#[tokio::test]
async fn a_replica_answers_for_a_sandbox_published_a_moment_before() {
    use kiln_server::SandboxService;
    use SandboxState::{Killed, Running};
    let name = "a_replica_answers_for_a_sandbox_published_a_moment_before";
    let Some(cluster) = EtcdCluster::start(name, 1).await else {
        return;
    };
    let replica = cluster.store("/kiln-known").await;
    let cache = kiln_cluster::control::Cache::start(replica.clone())
        .await
        .unwrap();
    let service = kiln_cluster::control::ClusterService::new(
        kiln_server::LifecycleConfig::default(),
        replica.clone(),
        cache.clone(),
        kiln_cluster::control::NodeClient::new(
            kiln_cluster::ClusterSecret::new("s3cret-s3cret-s3cret").unwrap(),
        ),
    );
    let lease = replica
        .register_node_at(
            "n1",
            "127.0.0.1:1",
            NodeCapacity::default(),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    // Another prefix's writes move the store's revision past anything this replica's watch
    // sees: the wait for an unknown sandbox ends on a progress notice, not on its limit.
    let mut other = cluster.store("/kiln-elsewhere").await.client();
    for i in 0..5 {
        let sid = format!("s{i}");
        published_elsewhere(&cluster.endpoints(), lease.lease_id(), &sid, Running);
        assert!(cache.sandbox(&sid).is_none(), "the watch ran meanwhile");
        service.await_known(&sid).await;
        let got = service
            .get(&sid)
            .unwrap_or_else(|e| panic!("{sid} after await_known: {e}"));
        assert_eq!(got.state, SandboxState::Running);
        assert_eq!(cache.owner_name(&sid).as_deref(), Some("n1"));
        // A list waits likewise.
        let listed = format!("l{i}");
        published_elsewhere(&cluster.endpoints(), lease.lease_id(), &listed, Running);
        service.await_current().await;
        assert!(
            service.list().iter().any(|r| r.id == listed),
            "{listed} listed"
        );
        // Ended elsewhere: not shown running once the view is current.
        published_elsewhere(&cluster.endpoints(), lease.lease_id(), &listed, Killed);
        assert!(cache.sandbox(&listed).is_some(), "the watch ran meanwhile");
        service.await_current().await;
        assert!(service.get(&listed).is_err(), "{listed} ended");
        assert!(!service.list().iter().any(|r| r.id == listed));

        other
            .put("/kiln-elsewhere/x", i.to_string(), None)
            .await
            .unwrap();
        let t = std::time::Instant::now();
        service.await_known("never-made").await;
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "an unknown sandbox waited {:?}",
            t.elapsed()
        );
        assert!(service.get("never-made").is_err());
    }
}
