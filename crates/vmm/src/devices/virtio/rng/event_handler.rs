//! Queue handling for virtio-rng.

use virtio_queue::QueueT;

use super::device::{Rng, QUEUE_SIZE};
use crate::devices::virtio::{chain_descriptors, DeviceError, QueueCtx, VirtioDevice, TYPE_RNG};

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
        let mem = ctx.mem;
        let queue = ctx.queues.get_mut(q).ok_or(DeviceError::QueueNotReady(q))?;
        if !queue.ready() {
            return Err(DeviceError::QueueNotReady(q));
        }
        while let Some(chain) = queue.pop_descriptor_chain(mem) {
            let head = chain.head_index();
            let descs = chain_descriptors(chain);
            let len = match self.fill(mem, &descs) {
                Ok(n) => n,
                Err(e) => {
                    self.metrics.errors += 1;
                    tracing::debug!(error = %e, "virtio-rng: dropping malformed request");
                    0
                }
            };
            queue
                .add_used(mem, head, len)
                .map_err(|_| DeviceError::BadChain("used ring not writable"))?;
            ctx.used = true;
        }
        Ok(())
    }
    fn metrics(&self) -> serde_json::Value {
        serde_json::to_value(&self.metrics).unwrap_or_default()
    }
    fn save(&self) -> serde_json::Value {
        serde_json::to_value(super::persist::RngPersist {}).unwrap_or_default()
    }
}
