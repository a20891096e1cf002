//! A team's seats on a real etcd (started by the test on loopback): creates racing through
//! two replicas' connections never hold more seats than the team's quota leaves, a seat given
//! back frees its place, a seat of a replica that died ends with its lease, a view that cannot
//! count leaves no seat, and teams (names with `/` included) never share seats.

#[allow(dead_code)]
#[path = "common/etcd.rs"]
mod etcd;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd::EtcdCluster;
use kiln_cluster::seats::{Seat, Taken};
use kiln_cluster::EtcdStore;

const TTL: i64 = 60;

/// A seat for `team` (quota `max`) with `live` sandboxes already counted.
async fn take(store: &EtcdStore, team: &str, max: usize, live: &AtomicUsize) -> Taken {
    let n = live.load(Ordering::SeqCst);
    store
        .take_seat(team, max, TTL, |_| async move { Some(n) })
        .await
        .unwrap()
}

fn seat(t: Taken) -> Option<Box<Seat>> {
    match t {
        Taken::Seat(s) => Some(s),
        Taken::Full { .. } => None,
        Taken::ViewBehind(rev) => panic!("view behind at {rev}"),
    }
}

/// Waits until the team has `n` seats (given-back seats go in the background).
async fn seats_become(store: &EtcdStore, team: &str, n: usize, within: Duration) {
    let start = Instant::now();
    loop {
        let (now, _) = store.seats(team).await.unwrap();
        if now == n {
            return;
        }
        assert!(
            start.elapsed() < within,
            "team {team}: {now} seats, not {n}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn racing_creates_never_take_more_seats_than_the_quota_leaves() {
    let name = "racing_creates_never_take_more_seats_than_the_quota_leaves";
    let Some(cluster) = EtcdCluster::start(name, 1).await else {
        return;
    };
    let replicas = [
        cluster.store("/kiln-seats").await,
        cluster.store("/kiln-seats").await,
    ];
    let live = Arc::new(AtomicUsize::new(1));
    // Twelve creates at once, six through each replica: quota 5, one sandbox live.
    let mut racing = Vec::new();
    for i in 0..12 {
        let (store, live) = (replicas[i % 2].clone(), live.clone());
        racing.push(tokio::spawn(async move {
            seat(take(&store, "team-a", 5, &live).await)
        }));
    }
    let mut held = Vec::new();
    for r in racing {
        held.extend(r.await.unwrap());
    }
    assert_eq!(held.len(), 4, "5 at once, 1 live: 4 seats");
    assert_eq!(replicas[0].seats("team-a").await.unwrap().0, 4);
    match take(&replicas[1], "team-a", 5, &live).await {
        Taken::Full { live, seats } => assert_eq!((live, seats), (1, 4)),
        _ => panic!("a seat beyond the quota"),
    }

    // Two creates end: one failed (no sandbox), one made its sandbox (now live).
    drop(held.pop());
    live.fetch_add(1, Ordering::SeqCst);
    drop(held.pop());
    seats_become(&replicas[0], "team-a", 2, Duration::from_secs(5)).await;
    // One place is free: of three racing creates one gets it.
    let mut racing = Vec::new();
    for i in 0..3 {
        let (store, live) = (replicas[i % 2].clone(), live.clone());
        racing.push(tokio::spawn(async move {
            seat(take(&store, "team-a", 5, &live).await)
        }));
    }
    let before = held.len();
    for r in racing {
        held.extend(r.await.unwrap());
    }
    assert_eq!(held.len() - before, 1);

    // Another team, and a team whose name extends this one's after a `/`, have their own.
    let none = AtomicUsize::new(0);
    assert!(seat(take(&replicas[0], "team-b", 1, &none).await).is_some());
    assert!(seat(take(&replicas[0], "team-a/x", 1, &none).await).is_some());
    assert_eq!(replicas[1].seats("team-a").await.unwrap().0, 3);
}

#[tokio::test]
async fn a_seat_ends_with_its_lease_and_a_view_behind_leaves_none() {
    let name = "a_seat_ends_with_its_lease_and_a_view_behind_leaves_none";
    let Some(cluster) = EtcdCluster::start(name, 1).await else {
        return;
    };
    let store = cluster.store("/kiln-seats-lease").await;
    // A replica that died mid-create never gives its seat back: its lease ends it.
    let t = store
        .take_seat("team", 1, 2, |_| async { Some(0) })
        .await
        .unwrap();
    std::mem::forget(seat(t).expect("a seat"));
    let none = AtomicUsize::new(0);
    assert!(seat(take(&store, "team", 1, &none).await).is_none());
    seats_become(&store, "team", 0, Duration::from_secs(10)).await;
    assert!(seat(take(&store, "team", 1, &none).await).is_some());
    seats_become(&store, "team", 0, Duration::from_secs(5)).await;

    // The count's view cannot reach the revision read: no seat, the revision said.
    let t = store
        .take_seat("team", 3, TTL, |_| async { None })
        .await
        .unwrap();
    assert!(matches!(t, Taken::ViewBehind(rev) if rev > 0));
    seats_become(&store, "team", 0, Duration::from_secs(5)).await;
}
