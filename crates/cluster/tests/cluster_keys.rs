//! The cluster's keys in etcd, on a real etcd (started by the test on loopback): one egress
//! interception CA for every node. The first node to join publishes its own (made if it had
//! none); every other node's state directory gets that one, written over its own; etcd never
//! holds the CA's key in clear; a node keyed by another cluster secret gets an error naming
//! the key, and its own CA stays as it was.

#[allow(dead_code)]
#[path = "common/etcd.rs"]
mod etcd;

use etcd::EtcdCluster;
use kiln_cluster::cluster_keys::{adopt_interception_ca, cluster_vault};
use kiln_cluster::ClusterSecret;
use kiln_net::intercept::ca;

#[tokio::test]
async fn every_node_gets_the_interception_ca_of_the_first() {
    let name = "every_node_gets_the_interception_ca_of_the_first";
    let Some(cluster) = EtcdCluster::start(name, 1).await else {
        return;
    };
    let secret = ClusterSecret::new("a-cluster-secret-of-the-test").unwrap();
    let etcd = cluster.store("/kiln-keys").await;
    let vault = cluster_vault(&etcd, &secret).unwrap();
    let dirs: Vec<tempfile::TempDir> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();

    // The first node had a CA of its own: it becomes the cluster's, unchanged.
    let first = ca::Ca::open(dirs[0].path()).unwrap();
    adopt_interception_ca(&etcd, &vault, dirs[0].path())
        .await
        .unwrap();
    let (cert, key) = ca::read_pems(dirs[0].path()).unwrap();
    assert_eq!(cert, first.cert_pem());

    // A node without one, and a node with another: both now load the first's.
    let other = ca::Ca::open(dirs[2].path()).unwrap();
    assert_ne!(other.cert_pem(), cert);
    for d in &dirs[1..] {
        let again = cluster_vault(&cluster.store("/kiln-keys").await, &secret).unwrap();
        adopt_interception_ca(&etcd, &again, d.path())
            .await
            .unwrap();
        assert_eq!(
            ca::read_pems(d.path()).unwrap(),
            (cert.clone(), key.clone())
        );
        assert_eq!(ca::Ca::open(d.path()).unwrap().cert_pem(), cert);
    }
    // Joining again changes nothing.
    adopt_interception_ca(&etcd, &vault, dirs[1].path())
        .await
        .unwrap();
    assert_eq!(ca::read_pems(dirs[1].path()).unwrap().0, cert);

    // etcd holds the key sealed: neither its PEM nor its body in clear.
    let body: String = key.lines().filter(|l| !l.starts_with("-----")).collect();
    let mut client = etcd.client();
    let all = client
        .get(
            "/kiln-keys/",
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .unwrap();
    assert!(!all.kvs().is_empty());
    for kv in all.kvs() {
        let text = String::from_utf8_lossy(kv.value());
        assert!(!text.contains(&body[..40]), "{text}");
    }

    // Another cluster secret opens nothing: the error names the key, the directory keeps its CA.
    let stranger = cluster_vault(
        &etcd,
        &ClusterSecret::new("another-cluster-secret!").unwrap(),
    )
    .unwrap();
    let lone = tempfile::tempdir().unwrap();
    let own = ca::Ca::open(lone.path()).unwrap();
    let err = adopt_interception_ca(&etcd, &stranger, lone.path())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("interception-ca"), "{err}");
    assert_eq!(ca::read_pems(lone.path()).unwrap().0, own.cert_pem());
}
