//! virtio-vsock with Firecracker-style hybrid Unix sockets.
//!
//! * host → guest: connect to the VM's socket `<uds>`, send `CONNECT <port>\n`; once the guest
//!   accepts, the VMM answers `OK <hostport>\n` and the stream carries the connection's bytes.
//! * guest → host: a guest connection to host (CID 2) port P is connected to `<uds>_P`.
//!
//! Flow control is credit based (virtio spec 5.10.6.3): the VMM never sends more than the guest
//! advertised (`buf_alloc - (sent - fwd_cnt)`), advertises its own buffer and reports consumption
//! with credit updates. After a snapshot restore the device sends a TRANSPORT_RESET event
//! (connections do not survive a restore).

pub mod device;
pub mod event_handler;
pub mod metrics;
pub mod packet;
pub mod persist;

pub use device::Vsock;
