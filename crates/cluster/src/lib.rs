//! kiln's cluster on etcd v3. [`EtcdStore`] implements the server's
//! [`kiln_server::store::StateStore`] on an etcd cluster (each method's change one txn,
//! revision-checked where replicas can race); [`nodes`] keeps node membership on etcd leases;
//! [`node`] runs a host's sandboxes for the cluster (`kiln node`) and [`control`] serves the
//! E2B API and the gateway over them (`kiln control`). The key layout is in [`keys`].
//! [`console`] keeps the web console's sessions, shared by every replica; [`drain`] marks nodes
//! that take no new sandboxes.
//! [`objects`] stores checkpoint bytes in an S3-compatible bucket as content-addressed chunks;
//! [`checkpoints`] records in etcd which paused sandbox's checkpoint is there; [`gc`] deletes
//! from the bucket what no checkpoint needs any more; [`snapshots`] records snapshots with the
//! node that keeps their files. [`audit`] says where a sandbox's audit chain is kept (by its
//! node, with what replicas record of it). [`secrets`] keeps teams' secrets, sealed, for
//! every replica and node; [`volumes`] records volumes with the node that keeps their files.

pub mod audit;
mod blocking;
mod campaign;
mod catalog;
pub mod checkpoints;
pub mod cluster_keys;
pub mod console;
pub mod control;
mod deliveries;
pub mod docs;
pub mod drain;
pub mod error;
mod events;
pub mod gc;
pub mod heads;
pub mod keys;
pub mod node;
pub mod nodes;
pub mod objects;
mod owners;
pub mod placements;
pub mod restarts;
mod retry;
mod sandboxes;
pub mod seats;
pub mod secret;
pub mod secrets;
pub mod sign_ins;
pub mod snapshots;
mod state;
mod store;
pub mod template_files;
pub mod volumes;
pub mod wire;

pub use checkpoints::{CheckpointDoc, CheckpointFile, Moved};
pub use console::EtcdSessions;
pub use drain::{DrainMark, DrainReport};
pub use error::ClusterError;
pub use nodes::{NodeCapacity, NodeEvent, NodeInfo, NodeLease, NodeLoad, NodeTemplate, NodeWatch};
pub use owners::{Published, NODE_LOST_REASON};
pub use sandboxes::Transition;
pub use secret::ClusterSecret;
pub use secrets::EtcdSecrets;
pub use sign_ins::EtcdSignIns;
pub use snapshots::{Located, SnapshotDrop};
pub use store::EtcdStore;
