//! virtio-rng counters.

use serde::Serialize;

#[derive(Debug, Default, Clone, Serialize)]
pub struct RngMetrics {
    pub requests: u64,
    pub bytes: u64,
    pub errors: u64,
}
