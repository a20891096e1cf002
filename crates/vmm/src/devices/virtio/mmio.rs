//! virtio-mmio transport, version 2 (virtio 1.x "modern" register layout).

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use virtio_queue::{Queue, QueueState, QueueT};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use super::{DeviceError, Interrupt, QueueCtx, VirtioDevice, VIRTIO_F_VERSION_1};
use crate::devices::bus::BusDevice;

const MAGIC: u32 = 0x7472_6976;
const VENDOR: u32 = 0x4b49_4c4e; // "KILN"

const STATUS_DRIVER_OK: u32 = 4;
const STATUS_FEATURES_OK: u32 = 8;
const STATUS_NEEDS_RESET: u32 = 0x40;
const STATUS_FAILED: u32 = 0x80;

/// Snapshot state of one queue (mirror of `virtio_queue::QueueState`).
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct QueuePersist {
    pub max_size: u16,
    pub size: u16,
    pub ready: bool,
    pub desc_table: u64,
    pub avail_ring: u64,
    pub used_ring: u64,
    pub next_avail: u16,
    pub next_used: u16,
    pub event_idx: bool,
}

/// Snapshot state of the transport.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct TransportPersist {
    pub status: u32,
    pub device_features_sel: u32,
    pub driver_features_sel: u32,
    pub acked_features: u64,
    pub queue_sel: u32,
    pub interrupt_status: u32,
    pub config_generation: u32,
    pub activated: bool,
    pub failed: bool,
    pub queues: Vec<QueuePersist>,
}

pub struct MmioTransport {
    pub device: Box<dyn VirtioDevice>,
    pub mem: Arc<GuestMemoryMmap>,
    pub queues: Vec<Queue>,
    /// One eventfd per queue; KVM signals it on a matching `QueueNotify` write (ioeventfd).
    pub queue_evts: Vec<EventFd>,
    pub interrupt: Interrupt,
    status: u32,
    device_features_sel: u32,
    driver_features_sel: u32,
    acked_features: u64,
    queue_sel: u32,
    config_generation: u32,
    activated: bool,
    /// The device met an invalid guest state and stopped until the driver resets it.
    failed: bool,
    pub errors: u64,
}

fn new_queues(sizes: &[u16]) -> Vec<Queue> {
    sizes
        .iter()
        .map(|&s| {
            Queue::new(s).unwrap_or_else(|_| Queue::new(256).expect("256 is a valid queue size"))
        })
        .collect()
}

impl MmioTransport {
    pub fn new(
        device: Box<dyn VirtioDevice>,
        mem: Arc<GuestMemoryMmap>,
        interrupt: Interrupt,
    ) -> std::io::Result<Self> {
        let sizes = device.queue_max_sizes();
        let queue_evts = sizes
            .iter()
            .map(|_| EventFd::new(libc::EFD_NONBLOCK))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(MmioTransport {
            queues: new_queues(&sizes),
            device,
            mem,
            queue_evts,
            interrupt,
            status: 0,
            device_features_sel: 0,
            driver_features_sel: 0,
            acked_features: 0,
            queue_sel: 0,
            config_generation: 0,
            activated: false,
            failed: false,
            errors: 0,
        })
    }

    fn features(&self) -> u64 {
        self.device.features() | VIRTIO_F_VERSION_1
    }

    fn selected(&mut self) -> Option<&mut Queue> {
        self.queues.get_mut(self.queue_sel as usize)
    }

    fn reset(&mut self) {
        self.device.reset();
        self.queues = new_queues(&self.device.queue_max_sizes());
        self.status = 0;
        self.acked_features = 0;
        self.device_features_sel = 0;
        self.driver_features_sel = 0;
        self.queue_sel = 0;
        self.interrupt.status = 0;
        self.activated = false;
        self.failed = false;
    }

    fn fail(&mut self, e: &DeviceError) {
        tracing::warn!(device = self.device.device_type(), error = %e, "virtio device stopped until reset");
        self.errors += 1;
        self.failed = true;
        self.status |= STATUS_NEEDS_RESET;
        self.interrupt.signal_config();
    }

    fn run<F>(&mut self, f: F)
    where
        F: FnOnce(&mut dyn VirtioDevice, &mut QueueCtx) -> Result<(), DeviceError>,
    {
        if !self.activated || self.failed {
            return;
        }
        let mem = self.mem.clone();
        let mut ctx = QueueCtx {
            mem: &mem,
            queues: &mut self.queues,
            used: false,
        };
        let r = f(self.device.as_mut(), &mut ctx);
        let used = ctx.used;
        if used {
            self.interrupt.signal_used();
        }
        if let Err(e) = r {
            self.fail(&e);
        }
    }

    /// Queue `q` was notified (ioeventfd fired).
    pub fn queue_event(&mut self, q: usize) {
        if let Some(e) = self.queue_evts.get(q) {
            let _ = e.read();
        }
        self.run(|d, ctx| d.queue_event(q, ctx));
    }

    /// The device's host fd is readable.
    pub fn host_event(&mut self) {
        if !self.activated || self.failed {
            self.device.host_event_idle();
            return;
        }
        self.run(|d, ctx| d.host_event(ctx));
    }

    /// After restore: let the device react (vsock transport reset), before vCPUs run.
    pub fn restored(&mut self) {
        self.run(|d, ctx| d.restored(ctx));
    }

    fn activate(&mut self) {
        for (i, q) in self.queues.iter().enumerate() {
            if q.ready() && !q.is_valid(self.mem.as_ref()) {
                self.activated = true;
                self.fail(&DeviceError::QueueNotReady(i));
                return;
            }
        }
        self.activated = true;
        self.run(|d, ctx| d.activate(ctx));
    }

    fn set_status(&mut self, v: u32) {
        if v == 0 {
            self.reset();
            return;
        }
        let old = self.status;
        // FEATURES_OK is only accepted when the driver acked VERSION_1 and nothing unknown.
        let mut v = v & 0xff;
        if v & STATUS_FEATURES_OK != 0 && old & STATUS_FEATURES_OK == 0 {
            let ok = self.acked_features & VIRTIO_F_VERSION_1 != 0
                && self.acked_features & !self.features() == 0;
            if !ok {
                v &= !STATUS_FEATURES_OK;
            }
        }
        self.status = v | (old & STATUS_NEEDS_RESET);
        if v & STATUS_DRIVER_OK != 0
            && old & STATUS_DRIVER_OK == 0
            && v & STATUS_FEATURES_OK != 0
            && !self.activated
        {
            self.activate();
        }
        if v & STATUS_FAILED != 0 {
            self.failed = true;
        }
    }

    pub fn save(&self) -> TransportPersist {
        TransportPersist {
            status: self.status,
            device_features_sel: self.device_features_sel,
            driver_features_sel: self.driver_features_sel,
            acked_features: self.acked_features,
            queue_sel: self.queue_sel,
            interrupt_status: self.interrupt.status,
            config_generation: self.config_generation,
            activated: self.activated,
            failed: self.failed,
            queues: self
                .queues
                .iter()
                .map(|q| QueuePersist {
                    max_size: q.max_size(),
                    size: q.size(),
                    ready: q.ready(),
                    desc_table: q.desc_table(),
                    avail_ring: q.avail_ring(),
                    used_ring: q.used_ring(),
                    next_avail: q.next_avail(),
                    next_used: q.next_used(),
                    event_idx: q.event_idx_enabled(),
                })
                .collect(),
        }
    }

    /// Restores transport state saved by [`MmioTransport::save`]; invalid queue state is an error.
    pub fn restore(&mut self, st: &TransportPersist) -> Result<(), String> {
        if st.queues.len() != self.queues.len() {
            return Err(format!(
                "snapshot has {} queues, device has {}",
                st.queues.len(),
                self.queues.len()
            ));
        }
        let mut queues = Vec::new();
        for q in &st.queues {
            let qs = QueueState {
                max_size: q.max_size,
                next_avail: q.next_avail,
                next_used: q.next_used,
                event_idx_enabled: q.event_idx,
                size: q.size,
                ready: q.ready,
                desc_table: q.desc_table,
                avail_ring: q.avail_ring,
                used_ring: q.used_ring,
            };
            queues.push(Queue::try_from(qs).map_err(|e| format!("invalid queue state: {e}"))?);
        }
        self.queues = queues;
        self.status = st.status;
        self.device_features_sel = st.device_features_sel;
        self.driver_features_sel = st.driver_features_sel;
        self.acked_features = st.acked_features;
        self.queue_sel = st.queue_sel;
        self.interrupt.status = st.interrupt_status;
        self.config_generation = st.config_generation;
        self.activated = st.activated;
        self.failed = st.failed;
        Ok(())
    }
}

fn lo(v: u64) -> u32 {
    v as u32
}
fn hi(v: u64) -> u32 {
    (v >> 32) as u32
}

impl BusDevice for MmioTransport {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset >= 0x100 {
            self.device.read_config(offset - 0x100, data);
            return;
        }
        if data.len() != 4 {
            data.fill(0);
            return;
        }
        let v: u32 = match offset {
            0x00 => MAGIC,
            0x04 => 2,
            0x08 => self.device.device_type(),
            0x0c => VENDOR,
            0x10 => match self.device_features_sel {
                0 => lo(self.features()),
                1 => hi(self.features()),
                _ => 0,
            },
            0x34 => self.selected().map(|q| q.max_size() as u32).unwrap_or(0),
            0x44 => self.selected().map(|q| q.ready() as u32).unwrap_or(0),
            0x60 => self.interrupt.status,
            0x70 => self.status,
            0xfc => self.config_generation,
            _ => 0,
        };
        data.copy_from_slice(&v.to_le_bytes());
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= 0x100 {
            if self.status & STATUS_DRIVER_OK == 0 || self.activated {
                self.device.write_config(offset - 0x100, data);
            }
            return;
        }
        let Ok(bytes) = <[u8; 4]>::try_from(data) else {
            return;
        };
        let v = u32::from_le_bytes(bytes);
        // Queue configuration is only allowed before the driver sets DRIVER_OK.
        let can_configure = self.status & STATUS_DRIVER_OK == 0;
        match offset {
            0x14 => self.device_features_sel = v,
            // Driver features can only change before FEATURES_OK.
            0x20 if self.status & STATUS_FEATURES_OK == 0 => match self.driver_features_sel {
                0 => self.acked_features = (self.acked_features & !0xffff_ffff) | v as u64,
                1 => self.acked_features = (self.acked_features & 0xffff_ffff) | (v as u64) << 32,
                _ => {}
            },
            0x24 => self.driver_features_sel = v,
            0x30 => self.queue_sel = v,
            0x38 if can_configure => {
                if let Some(q) = self.selected() {
                    q.set_size(v as u16);
                }
            }
            0x44 if can_configure => {
                if let Some(q) = self.selected() {
                    q.set_ready(v == 1);
                }
            }
            0x50 => {
                // Reached only when the ioeventfd did not take the write (e.g. registration
                // unavailable): forward to the same queue eventfd.
                if let Some(e) = self.queue_evts.get(v as usize) {
                    let _ = e.write(1);
                }
            }
            0x64 => self.interrupt.status &= !v,
            0x70 => self.set_status(v),
            0x80 | 0x84 | 0x90 | 0x94 | 0xa0 | 0xa4 if can_configure => {
                let Some(q) = self.selected() else { return };
                match offset {
                    0x80 => q.set_desc_table_address(Some(v), None),
                    0x84 => q.set_desc_table_address(None, Some(v)),
                    0x90 => q.set_avail_ring_address(Some(v), None),
                    0x94 => q.set_avail_ring_address(None, Some(v)),
                    0xa0 => q.set_used_ring_address(Some(v), None),
                    _ => q.set_used_ring_address(None, Some(v)),
                }
            }
            _ => {}
        }
    }
}
