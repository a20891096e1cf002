//! virtio-rng: guest entropy from the host's getrandom(2).

pub mod device;
pub mod event_handler;
pub mod metrics;
pub mod persist;

pub use device::Rng;
