//! kiln's cluster state on etcd v3. [`EtcdStore`] implements the server's
//! [`kiln_server::store::StateStore`] on an etcd cluster (each method's change one txn,
//! revision-checked where replicas can race); [`nodes`] keeps node membership on etcd leases. The key
//! layout is in [`keys`]. [`objects`] stores checkpoint bytes in an S3-compatible bucket as
//! content-addressed chunks.

mod catalog;
mod deliveries;
mod docs;
pub mod error;
mod events;
pub mod keys;
pub mod nodes;
pub mod objects;
mod retry;
mod sandboxes;
mod state;
mod store;

pub use error::ClusterError;
pub use nodes::{NodeCapacity, NodeEvent, NodeInfo, NodeLease, NodeWatch};
pub use sandboxes::Transition;
pub use store::EtcdStore;
