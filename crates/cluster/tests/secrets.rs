//! Teams' secrets in etcd, on a real etcd (started by the test on loopback): the same contract
//! as `kiln serve`'s SQLite table; a secret stored through one replica's vault opens in a
//! node's (both keyed by the cluster secret) and never sits in etcd in clear; a node's opened
//! value follows an update made elsewhere at once (its watch), and a vault keyed by another
//! cluster secret opens nothing.

#[allow(dead_code)]
#[path = "common/etcd.rs"]
mod etcd;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use etcd::EtcdCluster;
use kiln_cluster::{ClusterSecret, EtcdSecrets};
use kiln_server::store::{SecretRecord, SecretStore, SecretsDb};
use kiln_server::vault::Vault;

fn rec(team: &str, id: &str, name: &str, at: i64) -> SecretRecord {
    SecretRecord {
        id: id.into(),
        team: team.into(),
        name: name.into(),
        version: 1,
        metadata: BTreeMap::from([("k".to_string(), "v".to_string())]),
        sealed: format!("sealed-{id}").into_bytes(),
        created_at_ms: at,
        updated_at_ms: at,
    }
}

/// What every [`SecretStore`] does, on a store without secrets.
async fn contract(db: &dyn SecretStore) {
    assert!(db.insert(&rec("red", "sec_a", "one", 10)).await.unwrap());
    assert!(db.insert(&rec("red", "sec_b", "two", 10)).await.unwrap());
    assert!(db.insert(&rec("red", "sec_c", "three", 5)).await.unwrap());
    assert!(
        !db.insert(&rec("red", "sec_d", "one", 11)).await.unwrap(),
        "a name is unique in its team"
    );
    assert!(
        db.insert(&rec("blue/x", "sec_e", "one", 1)).await.unwrap(),
        "another team may use it ('/' in a team's name included)"
    );
    // By id, by name, by name in any case; never another team's.
    assert_eq!(db.get("red", "sec_a").await.unwrap().unwrap().name, "one");
    assert_eq!(db.get("red", "ONE").await.unwrap().unwrap().id, "sec_a");
    assert!(db.get("red", "sec_e").await.unwrap().is_none());
    assert!(db.get("blue", "one").await.unwrap().is_none());
    assert_eq!(db.get("blue/x", "one").await.unwrap().unwrap().id, "sec_e");
    // Creation order, then id; pages after a cursor.
    let ids = |v: Vec<SecretRecord>| v.into_iter().map(|s| s.id).collect::<Vec<_>>();
    assert_eq!(
        ids(db.list("red", None, 10).await.unwrap()),
        ["sec_c", "sec_a", "sec_b"]
    );
    assert_eq!(
        ids(db.list("red", None, 2).await.unwrap()),
        ["sec_c", "sec_a"]
    );
    assert_eq!(
        ids(db.list("red", Some((10, "sec_a".into())), 2).await.unwrap()),
        ["sec_b"]
    );
    assert_eq!(ids(db.list("blue/x", None, 10).await.unwrap()), ["sec_e"]);
    // A new version: sealed for the secret's id; metadata kept unless given.
    let s = db
        .new_version(
            "red",
            "TWO",
            Box::new(|id| format!("v2-{id}").into_bytes()),
            None,
            20,
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!((s.version, s.sealed.as_slice()), (2, &b"v2-sec_b"[..]));
    assert_eq!((s.updated_at_ms, s.metadata["k"].as_str()), (20, "v"));
    let s = db
        .new_version(
            "red",
            "sec_b",
            Box::new(|_| vec![3]),
            Some(BTreeMap::new()),
            4,
        )
        .await
        .unwrap()
        .unwrap();
    assert_eq!(s.version, 3);
    assert!(s.metadata.is_empty());
    assert_eq!(s.updated_at_ms, 10, "never before its creation");
    assert_eq!(db.get("red", "two").await.unwrap().unwrap(), s);
    assert!(db
        .new_version("blue/x", "two", Box::new(|_| vec![]), None, 1)
        .await
        .unwrap()
        .is_none());
    // Deleted by name, then gone by id too; its name free again.
    assert!(db.delete("red", "One").await.unwrap());
    assert!(!db.delete("red", "sec_a").await.unwrap());
    assert!(db.get("red", "one").await.unwrap().is_none());
    assert!(db.insert(&rec("red", "sec_f", "one", 30)).await.unwrap());
    assert!(!db.delete("blue", "sec_f").await.unwrap());
    assert_eq!(db.get("blue/x", "one").await.unwrap().unwrap().id, "sec_e");
}

#[tokio::test]
async fn sqlite_secrets_keep_the_contract() {
    contract(&SecretsDb::open_in_memory().unwrap()).await;
}

#[tokio::test]
async fn etcd_secrets_keep_the_contract() {
    let Some(cluster) = EtcdCluster::start("etcd_secrets_keep_the_contract", 1).await else {
        return;
    };
    let store = cluster.store("/kiln-secrets").await;
    contract(&EtcdSecrets::new(store)).await;
}

#[tokio::test]
async fn a_secret_sealed_at_a_replica_opens_at_a_node_and_follows_updates() {
    let name = "a_secret_sealed_at_a_replica_opens_at_a_node_and_follows_updates";
    let Some(cluster) = EtcdCluster::start(name, 1).await else {
        return;
    };
    let secret = ClusterSecret::new("a-cluster-secret-of-the-test").unwrap();
    let (sa, sb) = (
        cluster.store("/kiln-vault").await,
        cluster.store("/kiln-vault").await,
    );
    // The replica keeps no sandbox settings; the node does, in its own database.
    let replica = Arc::new(
        Vault::with_store(
            &secret.vault_key(),
            Arc::new(EtcdSecrets::new(sa.clone())),
            None,
        )
        .unwrap(),
    );
    let node = Arc::new(
        Vault::with_store(
            &secret.vault_key(),
            Arc::new(EtcdSecrets::new(sb.clone())),
            Some(SecretsDb::open_in_memory().unwrap()),
        )
        .unwrap(),
    );
    assert!(replica.db().is_none() && node.db().is_some());
    let watching = tokio::spawn(kiln_cluster::secrets::forget_on_change(
        sb.clone(),
        node.clone(),
    ));
    let value = "sk-the-value-of-the-test";
    let mut s = rec("red", "sec_1", "svc", 1);
    s.sealed = replica.seal("red", "sec_1", value.as_bytes());
    assert!(replica.insert(&s).await.unwrap());
    assert_eq!(
        node.value("red", "SVC").await.unwrap().as_deref(),
        Some(value)
    );
    assert_eq!(node.value("blue", "svc").await.unwrap(), None);

    // etcd holds no value in clear (nor in base64).
    let mut client = sa.client();
    let all = client
        .get(
            "/kiln-vault/",
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .unwrap();
    let b64 = base64_of(value);
    for kv in all.kvs() {
        let text = String::from_utf8_lossy(kv.value());
        assert!(!text.contains(value) && !text.contains(&b64), "{text}");
    }

    // An update through the replica: the node's cached value is forgotten by its watch.
    let r2 = replica.clone();
    replica
        .new_version(
            "red",
            "svc",
            move |id| r2.seal("red", id, b"sk-second"),
            None,
            2,
        )
        .await
        .unwrap()
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while node.value("red", "svc").await.unwrap().as_deref() != Some("sk-second") {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the node kept the old value"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(replica.delete("red", "sec_1").await.unwrap());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while node.value("red", "svc").await.unwrap().is_some() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "a deleted secret still opened"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    watching.abort();

    // Another cluster secret: the stored values do not open.
    let mut s = rec("red", "sec_2", "other", 3);
    s.sealed = replica.seal("red", "sec_2", b"x");
    assert!(replica.insert(&s).await.unwrap());
    let stranger = Vault::with_store(
        &ClusterSecret::new("another-cluster-secret!")
            .unwrap()
            .vault_key(),
        Arc::new(EtcdSecrets::new(sb)),
        None,
    )
    .unwrap();
    assert!(stranger.value("red", "other").await.is_err());
}

fn base64_of(v: &str) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(v)
}
