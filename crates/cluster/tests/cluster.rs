//! kiln's cluster state on a real 3-member etcd cluster (Debian's etcd-server, started by the
//! test on loopback): the state-store contract, revision-checked races, node leases, and
//! service through the loss of a member.

mod common;

use std::time::{Duration, Instant};

use common::contract;
use common::etcd::EtcdCluster;
use kiln_cluster::{ClusterError, EtcdStore, NodeCapacity, NodeEvent, Transition};
use kiln_server::store::{
    EventStore, IdempotencyStore, IdempotentAnswer, SandboxState, SandboxStore, SqliteStore,
};

/// The contract on SQLite, the reference the etcd store is held to.
#[tokio::test]
async fn store_contract_on_sqlite() {
    contract::run(&SqliteStore::open_in_memory().unwrap()).await;
}

#[tokio::test]
async fn store_contract_on_etcd() {
    let name = "store_contract_on_etcd";
    let Some(cluster) = EtcdCluster::start(name, 3).await else {
        return;
    };
    let store = cluster.store("/kiln-contract").await;
    contract::run(&store).await;

    // The layout: JSON records under the prefix, an expiry key per running sandbox only.
    let mut c = store.client();
    let raw = c.get("/kiln-contract/sandboxes/a", None).await.unwrap();
    let doc: serde_json::Value = serde_json::from_slice(raw.kvs()[0].value()).unwrap();
    assert_eq!(doc["state"], "killed");
    assert_eq!(doc["metadata"]["slash/key"], "ü");
    let expiry = etcd_client::GetOptions::new()
        .with_prefix()
        .with_count_only();
    let n = c
        .get("/kiln-contract/expiry/", Some(expiry.clone()))
        .await
        .unwrap();
    assert_eq!(n.count(), 0, "every sandbox of the contract ended");
    let mut live = contract::sample("live", SandboxState::Running);
    live.end_at_ms = 77;
    store.insert_sandbox(&live).await.unwrap();
    let n = c.get("/kiln-contract/expiry/", Some(expiry)).await.unwrap();
    assert_eq!(n.count(), 1);

    // Another prefix is another store.
    let other = cluster.store("/kiln-other").await;
    assert!(other.get_sandbox("live").await.unwrap().is_none());
    assert!(other.list_sandboxes(&[]).await.unwrap().is_empty());
}

/// Two replicas (two clients) race one revision-checked state change: exactly one wins.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_state_changes_have_exactly_one_winner() {
    let Some(cluster) = EtcdCluster::start("racing_state_changes_have_exactly_one_winner", 3).await
    else {
        return;
    };
    let a = cluster.store("/kiln-race").await;
    // The second replica talks to the members in another order.
    let mut eps = cluster.all_endpoints();
    eps.reverse();
    let b = EtcdStore::connect(&eps, "/kiln-race").await.unwrap();
    a.insert_sandbox(&contract::sample("s", SandboxState::Paused))
        .await
        .unwrap();
    let paused = [SandboxState::Paused];
    for round in 0..25 {
        let (ra, rb) = tokio::join!(
            tokio::spawn({
                let a = a.clone();
                async move {
                    a.transition("s", &paused, SandboxState::Running, None)
                        .await
                }
            }),
            tokio::spawn({
                let b = b.clone();
                async move {
                    b.transition("s", &paused, SandboxState::Running, None)
                        .await
                }
            }),
        );
        let outcomes = [ra.unwrap().unwrap(), rb.unwrap().unwrap()];
        let won = outcomes
            .iter()
            .filter(|o| matches!(o, Transition::Done(_)))
            .count();
        assert_eq!(won, 1, "round {round}: {outcomes:?}");
        for o in &outcomes {
            if let Transition::Lost(now) = o {
                assert_eq!(
                    now.state,
                    SandboxState::Running,
                    "the loser sees the winner's state"
                );
            }
        }
        // A pause and a kill race from running: one of them happens, never both.
        let (pause, kill) = tokio::join!(
            a.transition("s", &[SandboxState::Running], SandboxState::Paused, None),
            b.transition(
                "s",
                &[SandboxState::Running],
                SandboxState::Killed,
                Some("race")
            ),
        );
        let (pause, kill) = (pause.unwrap(), kill.unwrap());
        let done = [&pause, &kill]
            .iter()
            .filter(|o| matches!(o, Transition::Done(_)))
            .count();
        assert_eq!(done, 1, "round {round}: {pause:?} {kill:?}");
        if matches!(kill, Transition::Done(_)) {
            assert_eq!(
                a.get_sandbox("s").await.unwrap().unwrap().state,
                SandboxState::Killed
            );
            // Start the next round from paused again (the trait's unconditional write).
            a.set_state("s", SandboxState::Paused, None).await.unwrap();
        }
    }
    assert_eq!(
        a.transition("none", &paused, SandboxState::Running, None)
            .await
            .unwrap(),
        Transition::Missing
    );

    // Two creates with one Idempotency-Key: one records its answer, the other gets that one.
    for round in 0..10 {
        let answer = |body: &str| IdempotentAnswer {
            scope: "red/POST /sandboxes".into(),
            key: format!("key-{round}"),
            fingerprint: "f".into(),
            status: 201,
            content_type: None,
            body: body.as_bytes().to_vec(),
            created_at_ms: 1,
        };
        let (from_a, from_b) = (answer("from a"), answer("from b"));
        let (ra, rb) = tokio::join!(a.claim_idempotent(&from_a), b.claim_idempotent(&from_b));
        let (ra, rb) = (ra.unwrap(), rb.unwrap());
        let winner = match (&ra, &rb) {
            (None, Some(seen)) => {
                assert_eq!(seen.body, b"from a");
                "from a"
            }
            (Some(seen), None) => {
                assert_eq!(seen.body, b"from b");
                "from b"
            }
            other => panic!("round {round}: not exactly one winner: {other:?}"),
        };
        let stored = a
            .get_idempotent("red/POST /sandboxes", &format!("key-{round}"), 0)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(stored.body, winner.as_bytes());
    }
}

/// Two replicas queue webhook deliveries at once: every event is queued exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_dispatchers_queue_each_event_once() {
    let name = "racing_dispatchers_queue_each_event_once";
    let Some(cluster) = EtcdCluster::start(name, 3).await else {
        return;
    };
    let a = cluster.store("/kiln-queue").await;
    let b = EtcdStore::connect(&cluster.all_endpoints(), "/kiln-queue")
        .await
        .unwrap();
    let hook = kiln_server::store::WebhookRecord {
        id: "h".into(),
        team: kiln_server::store::DEFAULT_TEAM.into(),
        url: "http://198.51.100.9/hook".into(),
        secret: "s".into(),
        events: vec![],
        created_at_ms: 1,
    };
    a.insert_webhook(&hook).await.unwrap();
    for i in 0..60 {
        a.add_event(&format!("q{i}"), "created", "").await.unwrap();
    }
    // Small batches, so that the two interleave.
    async fn drain(s: EtcdStore) -> usize {
        let mut total = 0;
        loop {
            match s.queue_deliveries(1, 4).await.unwrap() {
                0 => return total,
                n => total += n,
            }
        }
    }
    let (na, nb) = tokio::join!(tokio::spawn(drain(a.clone())), tokio::spawn(drain(b)));
    let (na, nb) = (na.unwrap(), nb.unwrap());
    assert_eq!(na + nb, 60, "a queued {na}, b queued {nb}");
    let log = a.deliveries("h", None, 100).await.unwrap();
    let mut seqs: Vec<i64> = log.iter().map(|d| d.event_seq.unwrap()).collect();
    seqs.sort();
    seqs.dedup();
    assert_eq!((log.len(), seqs.len()), (60, 60));
}

/// The name of a node that joined (empty for any other event).
fn joined(e: NodeEvent) -> String {
    match e {
        NodeEvent::Joined(n) => n.name,
        _ => String::new(),
    }
}

/// Waits for the next membership event, failing after `within`.
async fn next_event(w: &mut kiln_cluster::NodeWatch, within: Duration) -> NodeEvent {
    tokio::time::timeout(within, w.next())
        .await
        .expect("no membership event in time")
        .expect("the node watch failed")
}

#[tokio::test]
async fn a_node_whose_lease_expires_is_reported_lost() {
    let Some(cluster) = EtcdCluster::start("a_node_whose_lease_expires_is_reported_lost", 3).await
    else {
        return;
    };
    let store = cluster.store("/kiln-nodes").await;
    let cap = NodeCapacity {
        cpus: 8,
        memory_mb: 16_384,
        disk_mb: 100_000,
        max_sandboxes: 50,
    };
    let ttl = Duration::from_secs(3);
    let mut watch = store.watch_nodes().await.unwrap();
    assert!(watch.initial().is_empty());
    let n1 = store.register_node("n1", cap.clone(), ttl).await.unwrap();
    let n2 = store.register_node("n2", cap.clone(), ttl).await.unwrap();
    for name in ["n1", "n2"] {
        match next_event(&mut watch, Duration::from_secs(5)).await {
            NodeEvent::Joined(n) => {
                assert_eq!((n.name.as_str(), &n.capacity), (name, &cap));
                assert!(n.lease_id != 0);
            }
            other => panic!("expected {name} to join, got {other:?}"),
        }
    }
    let live = store.live_nodes().await.unwrap();
    assert_eq!(
        live.iter().map(|n| n.name.as_str()).collect::<Vec<_>>(),
        ["n1", "n2"]
    );
    assert!(matches!(
        store.register_node("n1", cap.clone(), ttl).await,
        Err(ClusterError::NodeTaken(name)) if name == "n1"
    ));

    // n1 stops renewing (as a crashed node): its lease expires and the watch says so.
    let started = Instant::now();
    drop(n1);
    assert_eq!(
        next_event(&mut watch, Duration::from_secs(15)).await,
        NodeEvent::Lost("n1".into())
    );
    // The last renewal came at most a third of the TTL before the drop.
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "not before its TTL"
    );
    // n2 kept renewing all that time (longer than its TTL).
    assert!(n2.is_alive());
    let live = store.live_nodes().await.unwrap();
    assert_eq!(
        live.iter().map(|n| n.name.as_str()).collect::<Vec<_>>(),
        ["n2"]
    );
    // A watch opened now starts from n2 alone; n1's name is free again.
    let mut watch2 = store.watch_nodes().await.unwrap();
    assert_eq!(watch2.initial().len(), 1);
    let n1 = store.register_node("n1", cap.clone(), ttl).await.unwrap();
    assert_eq!(
        joined(next_event(&mut watch2, Duration::from_secs(5)).await),
        "n1"
    );
    // Leaving on purpose is not a loss.
    n2.leave().await.unwrap();
    assert_eq!(
        joined(next_event(&mut watch, Duration::from_secs(5)).await),
        "n1"
    );
    assert_eq!(
        next_event(&mut watch, Duration::from_secs(5)).await,
        NodeEvent::Left("n2".into())
    );
    drop(n1);
}

/// Retries `op` until it succeeds or `within` passes (the cluster electing a new leader).
async fn eventually<T, F, Fut>(within: Duration, mut op: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, kiln_server::store::StoreError>>,
{
    let start = Instant::now();
    loop {
        match op().await {
            Ok(v) => return v,
            Err(e) if start.elapsed() < within => {
                eprintln!("retrying after: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("still failing after {within:?}: {e}"),
        }
    }
}

/// One of three members (the leader) is killed: reads and writes go on.
#[tokio::test]
async fn service_continues_when_one_member_stops() {
    let Some(mut cluster) = EtcdCluster::start("service_continues_when_one_member_stops", 3).await
    else {
        return;
    };
    let store = cluster.store("/kiln-ha").await;
    for i in 0..5 {
        store
            .insert_sandbox(&contract::sample(
                &format!("before-{i}"),
                SandboxState::Running,
            ))
            .await
            .unwrap();
    }
    // Find and kill the leader (the harder case: the others must elect a new one).
    let mut leader = None;
    for i in 0..3 {
        let mut c = etcd_client::Client::connect([cluster.client_url(i)], None)
            .await
            .unwrap();
        let st = c.status().await.unwrap();
        if st.leader() == st.header().unwrap().member_id() {
            leader = Some(i);
        }
    }
    let leader = leader.expect("a leader among the members");
    cluster.kill(leader);

    // After an election (bounded), every operation works without retries.
    // The probe write is idempotent: a try that landed before its answer was lost is harmless.
    eventually(Duration::from_secs(20), || {
        store.set_end_at("before-0", 3000)
    })
    .await;
    for round in 0..=10 {
        let id = format!("after-{round}");
        store
            .insert_sandbox(&contract::sample(&id, SandboxState::Running))
            .await
            .unwrap_or_else(|e| panic!("write {round} failed: {e}\n{}", cluster.logs()));
        store.set_end_at(&id, 10 + round).await.unwrap();
        store.add_event(&id, "created", "").await.unwrap();
        assert!(store.get_sandbox(&id).await.unwrap().is_some());
    }
    let all = store.list_sandboxes(&[]).await.unwrap();
    assert_eq!(all.len(), 16, "written before and after the loss");
    assert!(store.get_sandbox("before-3").await.unwrap().is_some());
    assert_eq!(
        store.expired(12).await.unwrap(),
        ["after-0", "after-1", "after-2"]
    );
    let lease = store
        .register_node("survivor", NodeCapacity::default(), Duration::from_secs(2))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await; // past its TTL
    assert!(lease.is_alive(), "keep-alives go to the remaining members");
    assert_eq!(store.live_nodes().await.unwrap().len(), 1);
}

/// A node that cannot reach a quorum stops hearing its lease renewed and, within a TTL or
/// so, knows it lost the lease (the signal a node fences itself on).
#[tokio::test]
async fn a_node_cut_off_from_a_quorum_knows_its_lease_is_lost() {
    let name = "a_node_cut_off_from_a_quorum_knows_its_lease_is_lost";
    let Some(mut cluster) = EtcdCluster::start(name, 3).await else {
        return;
    };
    let store = cluster.store("/kiln-fence").await;
    let ttl = Duration::from_secs(3);
    let mut lease = store
        .register_node("n", NodeCapacity::default(), ttl)
        .await
        .unwrap();
    tokio::time::sleep(ttl + Duration::from_secs(1)).await;
    assert!(lease.is_alive(), "renewed past its TTL while etcd is whole");
    cluster.kill(0);
    cluster.kill(1);
    let cut = Instant::now();
    tokio::time::timeout(Duration::from_secs(10), lease.lost())
        .await
        .expect("the lease was still taken for alive 10 s after the quorum went");
    assert!(!lease.is_alive());
    assert!(
        cut.elapsed() <= ttl + Duration::from_secs(3),
        "{:?}",
        cut.elapsed()
    );
}
