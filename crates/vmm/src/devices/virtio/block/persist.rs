//! virtio-blk snapshot state: the disk geometry, compared at restore with the disk given then.
//! The disk contents are not in the state: the overlay file is copied next to the snapshot and
//! each restored VM gets its own copy.

use serde::{Deserialize, Serialize};

use super::device::Block;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BlockPersist {
    pub id: String,
    pub capacity_sectors: u64,
    pub read_only: bool,
}

impl From<&Block> for BlockPersist {
    fn from(b: &Block) -> Self {
        BlockPersist {
            id: b.id.clone(),
            capacity_sectors: b.capacity_sectors(),
            read_only: b.disk.read_only,
        }
    }
}
