//! virtio-blk counters.

use serde::Serialize;

#[derive(Debug, Default, Clone, Serialize)]
pub struct BlockMetrics {
    pub reads: u64,
    pub writes: u64,
    pub flushes: u64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub errors: u64,
}
