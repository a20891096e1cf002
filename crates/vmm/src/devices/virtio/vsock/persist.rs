//! vsock snapshot state: the guest CID. Connections and their sockets do not survive a snapshot;
//! the restored device sends VIRTIO_VSOCK_EVENT_TRANSPORT_RESET so the guest drops them too.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VsockPersist {
    pub cid: u64,
}
