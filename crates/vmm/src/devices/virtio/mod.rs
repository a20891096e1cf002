//! virtio devices over the virtio-mmio transport (version 2, modern only).
//!
//! The guest notifies a queue by writing its index to `QueueNotify`; KVM turns that write into an
//! ioeventfd signal (registered per queue with a datamatch), and the event loop calls the device's
//! queue handler. Used-buffer interrupts go back through an irqfd. Every value a guest controls
//! (register writes, ring indexes, descriptors) is validated; a device that meets an invalid state
//! marks itself `DEVICE_NEEDS_RESET` and stops processing — the VMM and other devices go on.

pub mod block;
pub mod fuzz;
pub mod mmio;
pub mod rng;
pub mod vsock;

use std::os::fd::RawFd;

use virtio_queue::{Queue, QueueT};
use vm_memory::GuestMemoryMmap;

use crate::devices::IrqLine;

pub const VIRTIO_F_VERSION_1: u64 = 1 << 32;

pub const TYPE_BLOCK: u32 = 2;
pub const TYPE_RNG: u32 = 4;
pub const TYPE_VSOCK: u32 = 19;

/// Largest buffer a device copies for one request: bounds host allocations against guest-chosen
/// descriptor lengths.
pub const MAX_REQUEST_BYTES: usize = 4 << 20;

#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("invalid descriptor chain: {0}")]
    BadChain(&'static str),
    #[error("guest memory access out of range")]
    GuestMemory,
    #[error("host I/O failed: {0}")]
    Io(#[from] std::io::Error),
    #[error("queue {0} is not configured")]
    QueueNotReady(usize),
}

/// What a device handler gets to work with.
pub struct QueueCtx<'a> {
    pub mem: &'a GuestMemoryMmap,
    pub queues: &'a mut [Queue],
    /// Set by a handler that added used buffers; the transport raises the interrupt.
    pub used: bool,
}

/// One virtio device (the part behind the transport).
pub trait VirtioDevice: Send {
    fn device_type(&self) -> u32;
    /// Maximum size of each queue; the length is the number of queues.
    fn queue_max_sizes(&self) -> Vec<u16>;
    /// Feature bits offered (VIRTIO_F_VERSION_1 is added by the transport).
    fn features(&self) -> u64;
    fn read_config(&self, offset: u64, data: &mut [u8]);
    fn write_config(&mut self, _offset: u64, _data: &[u8]) {}
    /// Driver set DRIVER_OK: queues are configured.
    fn activate(&mut self, _ctx: &mut QueueCtx) -> Result<(), DeviceError> {
        Ok(())
    }
    /// Driver reset the device.
    fn reset(&mut self);
    /// The guest notified queue `q`.
    fn queue_event(&mut self, q: usize, ctx: &mut QueueCtx) -> Result<(), DeviceError>;
    /// A host-side file descriptor of the device (see [`VirtioDevice::host_fd`]) is readable.
    fn host_event(&mut self, _ctx: &mut QueueCtx) -> Result<(), DeviceError> {
        Ok(())
    }
    /// The host fd is readable but the device is not active (not yet set up by the driver, or
    /// failed): consume the readiness without touching guest memory.
    fn host_event_idle(&mut self) {}
    /// An fd the event loop must watch for this device (e.g. vsock's inner epoll), if any.
    fn host_fd(&self) -> Option<RawFd> {
        None
    }
    /// Called once after the VM was restored from a snapshot, before vCPUs run.
    fn restored(&mut self, _ctx: &mut QueueCtx) -> Result<(), DeviceError> {
        Ok(())
    }
    fn metrics(&self) -> serde_json::Value;
    /// Device-specific snapshot state.
    fn save(&self) -> serde_json::Value;
}

/// Interrupt source of a transport: status register plus irqfd.
pub struct Interrupt {
    pub line: IrqLine,
    pub status: u32,
}

impl Interrupt {
    pub fn signal_used(&mut self) {
        self.status |= 1;
        self.line.trigger();
    }
    pub fn signal_config(&mut self) {
        self.status |= 2;
        self.line.trigger();
    }
}

/// Serves every available request on queue `q` of a request/response device (block, rng):
/// `handle` gets each chain's descriptors and returns the bytes it wrote for the used ring. A
/// request it rejects is completed with length 0, so the driver can reclaim the descriptors, and
/// is counted in `errors`; the device keeps serving.
pub fn serve_requests(
    q: usize,
    ctx: &mut QueueCtx,
    device: &'static str,
    errors: &mut u64,
    mut handle: impl FnMut(&GuestMemoryMmap, &[(u64, u32, bool)]) -> Result<u32, DeviceError>,
) -> Result<(), DeviceError> {
    let mem = ctx.mem;
    let queue = ctx.queues.get_mut(q).ok_or(DeviceError::QueueNotReady(q))?;
    if !queue.ready() {
        return Err(DeviceError::QueueNotReady(q));
    }
    while let Some(chain) = queue.pop_descriptor_chain(mem) {
        let head = chain.head_index();
        let descs = chain_descriptors(chain);
        let len = handle(mem, &descs).unwrap_or_else(|e| {
            *errors += 1;
            tracing::debug!(error = %e, "{device}: dropping malformed request");
            0
        });
        queue
            .add_used(mem, head, len)
            .map_err(|_| DeviceError::BadChain("used ring not writable"))?;
        ctx.used = true;
    }
    Ok(())
}

/// Reads a descriptor chain into a list of (addr, len, writable) with structural checks.
pub fn chain_descriptors<M>(chain: virtio_queue::DescriptorChain<M>) -> Vec<(u64, u32, bool)>
where
    M: std::ops::Deref,
    M::Target: vm_memory::GuestMemory,
{
    chain
        .map(|d| (d.addr().0, d.len(), d.is_write_only()))
        .take(1024)
        .collect()
}
