//! Queue handling for virtio-blk: drain the request queue, complete each request.

use super::device::{Block, QUEUE_SIZE};
use super::disk::SECTOR;
use crate::devices::virtio::{serve_requests, DeviceError, QueueCtx, VirtioDevice, TYPE_BLOCK};

impl VirtioDevice for Block {
    fn device_type(&self) -> u32 {
        TYPE_BLOCK
    }
    fn queue_max_sizes(&self) -> Vec<u16> {
        vec![QUEUE_SIZE]
    }
    fn features(&self) -> u64 {
        let mut f = super::device::F_FLUSH;
        if self.disk.read_only {
            f |= super::device::F_RO;
        }
        f
    }
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        // capacity (u64) at 0, blk_size (u32) at 20; everything else reads as zero.
        let mut cfg = [0u8; 24];
        cfg[..8].copy_from_slice(&self.config_bytes());
        cfg[20..24].copy_from_slice(&(SECTOR as u32).to_le_bytes());
        data.fill(0);
        let off = offset as usize;
        if off < cfg.len() {
            let n = data.len().min(cfg.len() - off);
            data[..n].copy_from_slice(&cfg[off..off + n]);
        }
    }
    fn reset(&mut self) {}
    fn queue_event(&mut self, q: usize, ctx: &mut QueueCtx) -> Result<(), DeviceError> {
        let mut errors = 0;
        let r = serve_requests(q, ctx, "virtio-blk", &mut errors, |mem, descs| {
            self.execute(mem, descs)
        });
        self.metrics.errors += errors;
        r
    }
    fn metrics(&self) -> serde_json::Value {
        let mut m = serde_json::to_value(&self.metrics).unwrap_or_default();
        m["overlay_blocks"] = self.disk.written_blocks().into();
        m["cow_copies"] = self.disk.cow_copies.into();
        m
    }
    fn save(&self) -> serde_json::Value {
        serde_json::to_value(super::persist::BlockPersist::from(self)).unwrap_or_default()
    }
}
