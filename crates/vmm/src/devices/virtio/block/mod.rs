//! virtio-blk: a read-only base image plus a per-VM sparse copy-on-write overlay.

pub mod device;
pub mod disk;
pub mod event_handler;
pub mod metrics;
pub mod persist;

pub use device::Block;
pub use disk::{CowDisk, DiskError};
