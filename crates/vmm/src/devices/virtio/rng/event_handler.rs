//! Queue handling for virtio-rng.

use super::device::{Rng, QUEUE_SIZE};
use crate::devices::virtio::{serve_requests, DeviceError, QueueCtx, VirtioDevice, TYPE_RNG};

impl VirtioDevice for Rng {
    fn device_type(&self) -> u32 {
        TYPE_RNG
    }
    fn queue_max_sizes(&self) -> Vec<u16> {
        vec![QUEUE_SIZE]
    }
    fn features(&self) -> u64 {
        0
    }
    fn read_config(&self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }
    fn reset(&mut self) {}
    fn queue_event(&mut self, q: usize, ctx: &mut QueueCtx) -> Result<(), DeviceError> {
        let mut errors = 0;
        let r = serve_requests(q, ctx, "virtio-rng", &mut errors, |mem, descs| {
            self.fill(mem, descs)
        });
        self.metrics.errors += errors;
        r
    }
    fn metrics(&self) -> serde_json::Value {
        serde_json::to_value(&self.metrics).unwrap_or_default()
    }
    fn save(&self) -> serde_json::Value {
        serde_json::to_value(super::persist::RngPersist {}).unwrap_or_default()
    }
}
