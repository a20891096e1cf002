//! What can go wrong talking to etcd, as one typed error.

/// An error of the etcd-backed store or of node membership.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("etcd: {0}")]
    Etcd(#[from] etcd_client::Error),
    /// A value under kiln's prefix that does not parse as the record it should hold.
    #[error("corrupt value at etcd key {key}: {source}")]
    Corrupt {
        key: String,
        #[source]
        source: serde_json::Error,
    },
    /// An insert whose id (or unique name) is taken.
    #[error("{what} {id} already exists")]
    Exists { what: &'static str, id: String },
    /// A revision-checked write that lost to other writers every time it was retried.
    #[error("etcd key {key} kept changing under a revision-checked write ({tries} tries)")]
    Contended { key: String, tries: u32 },
    /// A node name held by a live lease of another node.
    #[error("node {0} is already registered with a live lease")]
    NodeTaken(String),
    /// etcd ended a stream kiln was reading (a watch or a lease keep-alive).
    #[error("etcd closed the {0} stream")]
    StreamClosed(&'static str),
    /// The server's store seam failed (a control replica's first key).
    #[error(transparent)]
    Store(#[from] kiln_server::store::StoreError),
    /// A key the cluster keeps sealed does not open with this cluster secret.
    #[error("etcd key {0} does not open with this cluster secret: was the cluster secret changed? Give every node and replica the secret the cluster was started with, or delete that key to have a new one made (workload identity tokens minted before then no longer verify; sandboxes started before then no longer trust a new interception CA)")]
    KeyUnsealed(String),
    /// The cluster's identity key.
    #[error(transparent)]
    Identity(#[from] kiln_server::identity::IdentityError),
    /// The cluster's vault (its key).
    #[error(transparent)]
    Vault(#[from] kiln_server::vault::VaultError),
    /// A control replica's or node's listener.
    #[error("listening on {addr}: {source}")]
    Listen {
        addr: String,
        #[source]
        source: std::io::Error,
    },
}

/// The trait's error type has no etcd variant: the typed error travels as its message.
impl From<ClusterError> for kiln_server::store::StoreError {
    fn from(e: ClusterError) -> Self {
        match e {
            ClusterError::Corrupt { source, .. } => kiln_server::store::StoreError::Json(source),
            ClusterError::Store(e) => e,
            other => kiln_server::store::StoreError::Task(other.to_string()),
        }
    }
}

/// A failure of the cluster's state as the server's typed error (a store failure).
impl From<ClusterError> for kiln_server::Error {
    fn from(e: ClusterError) -> Self {
        kiln_server::Error::Store(e.into())
    }
}

pub type Result<T, E = ClusterError> = std::result::Result<T, E>;
