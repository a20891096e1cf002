//! The web console's sessions in etcd, on a real etcd (started by the test on loopback): the
//! same contract as `kiln serve`'s SQLite sessions, a session opened through one replica's
//! store is found, and ended, through another's, etcd drops an ended session by its lease, and
//! only hashes are stored; failed sign-ins count across replicas.

#[allow(dead_code)]
#[path = "common/etcd.rs"]
mod etcd;

use std::sync::Arc;
use std::time::Duration;

use etcd::EtcdCluster;
use http::{HeaderMap, HeaderValue};
use kiln_cluster::EtcdSessions;
use kiln_server::console::session::{Sessions, SignInError, COOKIE};
use kiln_server::console::{ConsoleDb, SessionRow, SessionStore};
use kiln_server::store::{now_ms, AccessStore};

fn row(id: &str, expires: i64) -> SessionRow {
    SessionRow {
        id_hash: id.into(),
        key_hash: format!("k-{id}"),
        created_at_ms: 1,
        expires_at_ms: expires,
    }
}

/// What every [`SessionStore`] does, on a store with no sessions yet; `now` is a time before
/// which nothing has ended (etcd's leases run on the wall clock).
async fn contract(db: &dyn SessionStore, now: i64) {
    let hour = now + 3_600_000;
    assert_eq!(db.count().await.unwrap(), 0);
    assert!(db.create(row("a", hour), now, 2).await.unwrap());
    assert!(db.create(row("b", hour + 1), now, 2).await.unwrap());
    assert!(
        !db.create(row("c", hour), now, 2).await.unwrap(),
        "two open: a third is refused"
    );
    assert_eq!(db.get("a", now).await.unwrap(), Some(row("a", hour)));
    assert!(db.get("c", now).await.unwrap().is_none(), "never stored");
    assert!(
        db.get("a", hour).await.unwrap().is_none(),
        "ended at its end"
    );
    assert_eq!(db.get("b", hour).await.unwrap(), Some(row("b", hour + 1)));
    assert!(db.delete("a").await.unwrap());
    assert!(!db.delete("a").await.unwrap(), "deleted once");
    assert!(db.get("a", now).await.unwrap().is_none());
    assert!(
        db.create(row("c", hour), now, 2).await.unwrap(),
        "room again"
    );
    assert_eq!(db.count().await.unwrap(), 2);
    assert_eq!(
        db.expire(hour).await.unwrap(),
        1,
        "c ends at `hour`, b after"
    );
    assert_eq!(db.count().await.unwrap(), 1);
    assert!(db.get("b", now).await.unwrap().is_some());
    assert!(db.delete("b").await.unwrap());
    assert_eq!(db.count().await.unwrap(), 0);
}

#[tokio::test]
async fn sqlite_sessions_keep_the_contract() {
    contract(&ConsoleDb::open_in_memory().unwrap(), now_ms()).await;
}

#[tokio::test]
async fn etcd_sessions_keep_the_contract_and_end_with_their_lease() {
    let name = "etcd_sessions_keep_the_contract_and_end_with_their_lease";
    let Some(cluster) = EtcdCluster::start(name, 1).await else {
        return;
    };
    let store = cluster.store("/kiln-console").await;
    let db = EtcdSessions::new(store.clone());
    contract(&db, now_ms()).await;

    // A session ending in 1.5 s: etcd drops its key by itself within a second after.
    let now = now_ms();
    assert!(db.create(row("short", now + 1500), now, 10).await.unwrap());
    assert!(db.get("short", now).await.unwrap().is_some());
    let mut client = store.client();
    let key = store.keys().console_session("short");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let r = client.get(key.as_str(), None).await.unwrap();
        if r.kvs().is_empty() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the lease kept the key"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(now_ms() >= now + 1500, "not before the session's end");
    assert_eq!(db.count().await.unwrap(), 0);
}

fn cookie(id: &str) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert(
        "cookie",
        HeaderValue::from_str(&format!("{COOKIE}={id}")).unwrap(),
    );
    h
}

#[tokio::test]
async fn a_session_opened_at_one_replica_is_known_and_ended_at_another() {
    let name = "a_session_opened_at_one_replica_is_known_and_ended_at_another";
    let Some(cluster) = EtcdCluster::start(name, 1).await else {
        return;
    };
    // Two replicas: each its own etcd connection, one cluster prefix.
    let (sa, sb) = (
        cluster.store("/kiln-console2").await,
        cluster.store("/kiln-console2").await,
    );
    let key = kiln_server::auth::create_team_key(&sa, "web", "red")
        .await
        .unwrap();
    let a = Sessions::new(Arc::new(EtcdSessions::new(sa.clone())));
    let b = Sessions::new(Arc::new(EtcdSessions::new(sb.clone())));
    assert!(matches!(
        a.sign_in(&sa, "e2b_wrong").await,
        Err(SignInError::Refused(_))
    ));
    let (id, s) = a.sign_in(&sa, &key.secret).await.unwrap();
    let h = cookie(&id);
    let seen = b
        .current(&sb, &h)
        .await
        .expect("replica b knows the session");
    assert_eq!((seen.caller.team.as_str(), &seen.csrf), ("red", &s.csrf));
    assert!(b.current(&sb, &cookie("nope")).await.is_none());

    // Only hashes are in etcd: neither the session id, its CSRF token nor the key.
    let mut client = sa.client();
    let all = client
        .get(
            "/kiln-console2/",
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .unwrap();
    for kv in all.kvs() {
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(kv.key()),
            String::from_utf8_lossy(kv.value())
        );
        assert!(!text.contains(&id) && !text.contains(&s.csrf) && !text.contains(&key.secret));
    }

    // Signing out at b ends it at a.
    b.end(&h).await;
    assert!(a.current(&sa, &h).await.is_none(), "ended everywhere");
    assert_eq!(a.count().await, 0);

    // A revoked key ends its sessions on every replica.
    let (id2, _) = b.sign_in(&sb, &key.secret).await.unwrap();
    assert!(a.current(&sa, &cookie(&id2)).await.is_some());
    sa.revoke_key(&key.record.id).await.unwrap();
    assert!(b.current(&sb, &cookie(&id2)).await.is_none());
    assert_eq!(b.count().await, 0, "a revoked key's session is dropped");
}

#[tokio::test]
async fn failed_sign_ins_count_across_replicas() {
    use kiln_cluster::EtcdSignIns;
    use kiln_server::console::limit::{SignInCounter, MAX_FAILURES};

    let name = "failed_sign_ins_count_across_replicas";
    let Some(cluster) = EtcdCluster::start(name, 1).await else {
        return;
    };
    let (a, b) = (
        EtcdSignIns::new(cluster.store("/kiln-console3").await),
        EtcdSignIns::new(cluster.store("/kiln-console3").await),
    );
    let ip: std::net::IpAddr = "10.20.30.40".parse().unwrap();
    let other: std::net::IpAddr = "10.20.30.4".parse().unwrap();
    // Spread over two replicas, the failures add up: neither gives a fresh allowance.
    for i in 0..MAX_FAILURES {
        let at = if i % 2 == 0 { &a } else { &b };
        assert_eq!(at.check(ip).await, None, "failure {i} is still let through");
        at.failed(ip).await;
    }
    for r in [&a, &b] {
        let wait = r.check(ip).await.expect("the limit holds at every replica");
        assert!((55..=60).contains(&wait), "{wait}");
    }
    assert_eq!(
        a.check(other).await,
        None,
        "another address (a key prefix of it) is apart"
    );
    // Each failure is a key on a lease of the window: etcd drops them by itself.
    let mut client = cluster.store("/kiln-console3").await.client();
    let all = client
        .get(
            "/kiln-console3/console-sign-ins/",
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .unwrap();
    assert_eq!(all.kvs().len(), MAX_FAILURES);
    for kv in all.kvs() {
        let lease = client.lease_time_to_live(kv.lease(), None).await.unwrap();
        assert!((55..=61).contains(&lease.ttl()), "{}", lease.ttl());
    }
}
