//! Emulated devices. Legacy port-I/O devices (8250 serial, i8042) and virtio-mmio devices
//! (block, vsock, rng). Each virtio device keeps the same shape: `device.rs` (the device and its
//! request handling), `event_handler.rs` (queue/socket events from the event loop), `persist.rs`
//! (snapshot state) and `metrics.rs` (counters reported by the `stats` API call).

pub mod bus;
pub mod legacy;
pub mod virtio;

use vmm_sys_util::eventfd::EventFd;

/// Interrupt line into the in-kernel irqchip, backed by an irqfd.
pub struct IrqLine {
    pub gsi: u32,
    pub evt: EventFd,
}

impl IrqLine {
    pub fn new(gsi: u32) -> std::io::Result<Self> {
        Ok(IrqLine {
            gsi,
            evt: EventFd::new(libc::EFD_NONBLOCK)?,
        })
    }
    pub fn trigger(&self) {
        // An eventfd write only fails when the counter would overflow, which means the
        // interrupt is already pending: nothing to do then.
        let _ = self.evt.write(1);
    }
}
