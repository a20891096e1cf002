//! virtio-rng snapshot state: the device has none beyond its transport and queue; after restore
//! the guest keeps drawing fresh host entropy (no bytes are ever replayed from the snapshot).

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct RngPersist {}
